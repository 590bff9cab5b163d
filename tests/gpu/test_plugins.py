"""plugins/' Triton kernels on a GPU, against torch's unfused ops.

Tolerances (torch.testing.assert_close's atol, rtol; against torch's unfused op in the same dtype):
- fp32 5e-5: both reduce in fp32 but in another order; groups of up to 2^24 elements.
- fp16 4e-3, bf16 3e-2: the fused kernels round once, from fp32; torch rounds the GroupNorm
  (or gelu) output to the dtype and again after SiLU (or the product), so the two differ by up to
  ~1.5 ulp (fp16 ulp is 2^-10 relative, bf16 2^-7). In half precision the fused result must also
  be within half an ulp (+ 1e-5 relative for fp32 arithmetic) of a float64 reference computed
  from the same half-precision inputs: correctly rounded, which torch's two roundings are not.
Compiled and graph-replayed ops run the very same kernels as eager, so they must be bit-equal.
Run with `tests/gpu/run.sh` on the GPU machine; skipped elsewhere.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import plugins

pytestmark = pytest.mark.gpu
TOL = {torch.float32: (5e-5, 5e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 3e-2)}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# SDXL at 1024 px (latent 128x128, batch 2 for classifier-free guidance), its VAE decoder at
# full resolution, and odd sizes that leave partial tiles.
GN_SHAPES = [(2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (1, 512, 1024, 1024),
             (1, 256, 1024, 1024), (3, 96, 17, 23), (2, 64, 5)]
# GEGLU input [batch, tokens, 2*D]: FeedForward(640, mult 4) at 64x64 tokens, (1280) at 32x32.
GEGLU_SHAPES = [(2, 4096, 2 * 2560), (2, 1024, 2 * 5120), (3, 77, 2 * 1000), (5, 2 * 24)]


def _gn_inputs(shape, dtype, seed=0):
    g = torch.Generator("cuda").manual_seed(seed)
    x = (torch.randn(shape, device="cuda", generator=g) * 2 + 0.5).to(dtype)
    C = shape[1]
    w = (1 + 0.2 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    b = (0.2 * torch.randn(C, device="cuda", generator=g)).to(dtype)
    return x, w, b


def _check(out, unfused, golden, dtype, layout=torch.contiguous_format):
    assert out.dtype == dtype and out.shape == unfused.shape and out.is_contiguous(memory_format=layout)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out, unfused, atol=atol, rtol=rtol)
    if golden is not None:  # half precision: correctly rounded, up to the fp32 arithmetic
        rounded = golden.to(dtype).abs()
        half_ulp = 0.5 * (torch.nextafter(rounded, torch.full_like(rounded, float("inf"))) - rounded).double()
        excess = (out.double() - golden).abs() - half_ulp - 1e-5 * golden.abs() - 1e-6
        assert excess.max().item() <= 0, f"fused output over half an ulp off float64 by {excess.max().item():.3g}"


@pytest.mark.parametrize("pre_bias", [False, True], ids=["", "pre_bias"])
@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GN_SHAPES, ids=str)
def test_group_norm_silu_matches_unfused(shape, dtype, layout, pre_bias):
    """NCHW and NHWC kernels, with and without a convolution's bias folded in (the reference adds
    it as torch would: a tensor of x's dtype)."""
    if layout == torch.channels_last and len(shape) != 4:
        pytest.skip("channels_last is 4-D only")
    groups = 32 if shape[1] % 32 == 0 else 8
    x, w, b = _gn_inputs(shape, dtype)
    x = x.contiguous(memory_format=layout)
    c = (0.5 * torch.randn(shape[1], device="cuda", generator=torch.Generator("cuda").manual_seed(9))).to(dtype)
    out = plugins.group_norm_silu(x, w, b, groups, 1e-5, c if pre_bias else None)
    if pre_bias:
        x = x + c.view(1, -1, *[1] * (x.dim() - 2))
    unfused = F.silu(F.group_norm(x, groups, w, b, 1e-5))
    golden = F.silu(F.group_norm(x.double(), groups, w.double(), b.double(), 1e-5)) if dtype != torch.float32 else None
    _check(out, unfused, golden, dtype, layout)


@pytest.mark.parametrize("layout", [torch.contiguous_format, torch.channels_last], ids=["nchw", "nhwc"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 128, 1024, 1024), (2, 320, 128, 128), (3, 96, 17, 23)], ids=str)
def test_bias_residual_is_torchs_three_ops_bit_for_bit(shape, dtype, layout):
    """Each intermediate rounded to the dtype as torch's separate ops round it: equal, not close."""
    g = torch.Generator("cuda").manual_seed(3)
    h, r = (torch.randn(shape, device="cuda", generator=g).to(dtype).contiguous(memory_format=layout)
            for _ in range(2))
    bias = torch.randn(shape[1], device="cuda", generator=g).to(dtype)
    for scale in (1.0, 1.4142):
        out = plugins.bias_residual(h, bias, r, scale)
        assert out.is_contiguous(memory_format=layout)
        assert torch.equal(out, (r + (h + bias.view(1, -1, 1, 1))) / scale)


def test_group_norm_silu_large_mean_and_channels_last():
    """A mean 100 std from zero, channels_last input: within 1e-4 of float64 (the CPU
    interpreter run measures 9e-6). Torch's own channels_last kernel is no yardstick here:
    on CPU it is 4e-2 off."""
    x, w, b = _gn_inputs((2, 320, 64, 64), torch.float32)
    x = (x + 200).to(memory_format=torch.channels_last)
    out = plugins.group_norm_silu(x, w, b, 32, 1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)
    golden = F.silu(F.group_norm(x.double(), 32, w.double(), b.double(), 1e-5))
    torch.testing.assert_close(out, golden.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GEGLU_SHAPES, ids=str)
def test_geglu_matches_unfused(shape, dtype):
    x = (torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 2).to(dtype)
    hidden, gate = x.chunk(2, dim=-1)
    out = plugins.geglu(x)
    h64, g64 = x.double().chunk(2, dim=-1)
    golden = h64 * F.gelu(g64) if dtype != torch.float32 else None
    _check(out, hidden * F.gelu(gate), golden, dtype)


@pytest.mark.parametrize("shape", [(2, 1024, 1280, 5120), (3, 77, 96, 40)], ids=str)  # (rows, tokens, K, D)
def test_geglu_linear_matches_the_unfused_projection_and_geglu(shape):
    """The measured, unused GEGLU-in-the-product kernel (plugins/geglu_linear_kernel.py), fp16, on
    SDXL's shape and on one with partial tiles: the products differ from cuBLAS's in the order of
    fp32 accumulation only, so the fp16 tolerance holds."""
    from plugins.geglu_linear_kernel import geglu_linear

    rows, tokens, k, d = shape
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, tokens, k, device="cuda", generator=g).half()
    w = (torch.randn(2 * d, k, device="cuda", generator=g) / k ** 0.5).half()
    b = (0.1 * torch.randn(2 * d, device="cuda", generator=g)).half()
    hidden, gate = F.linear(x, w, b).chunk(2, dim=-1)
    out = geglu_linear(x, w, b)
    assert out.shape == (rows, tokens, d)
    torch.testing.assert_close(out, hidden * F.gelu(gate), atol=TOL[torch.float16][0], rtol=TOL[torch.float16][1])


def test_ops_registration_passes_opcheck_on_cuda():
    """Fake and Triton implementations agree on shapes, dtypes and strides (channels_last in,
    channels_last out), which inductor and CUDA graphs rely on."""
    x, w, b = _gn_inputs((2, 64, 8, 8), torch.float16)
    for x in (x, x.to(memory_format=torch.channels_last)):
        torch.library.opcheck(torch.ops.easel.group_norm_silu.default, (x, w, b, 32, 1e-5))
        torch.library.opcheck(torch.ops.easel.group_norm_silu.default, (x, w, b, 32, 1e-5, b))
        torch.library.opcheck(torch.ops.easel.bias_residual.default, (x, b, x.clone(), 0.5))
    torch.library.opcheck(torch.ops.easel.geglu.default, (torch.randn(2, 3, 64, device="cuda", dtype=torch.float16),))


def _fn(x, w, b, proj):
    return plugins.geglu(plugins.group_norm_silu(x, w, b, 32, 1e-5).flatten(2).transpose(1, 2) @ proj)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_ops_under_torch_compile_equal_eager(dtype):
    x, w, b = _gn_inputs((2, 640, 32, 32), dtype)
    proj = torch.randn(640, 2 * 1280, device="cuda", dtype=dtype) / 640 ** 0.5
    torch._dynamo.reset()
    compiled = torch.compile(_fn, fullgraph=True)  # default mode: inductor, no autotuning
    with torch.no_grad():
        got, want = compiled(x, w, b, proj), _fn(x, w, b, proj)
    # the ops themselves are opaque to inductor; the matmul between them may be its own choice
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    op = torch.compile(lambda x, w, b: plugins.group_norm_silu(x, w, b, 32, 1e-5), fullgraph=True)
    assert torch.equal(op(x, w, b), plugins.group_norm_silu(x, w, b, 32, 1e-5))


def test_ops_in_cuda_graph_equal_eager_and_see_in_place_weight_updates():
    x, w, b = _gn_inputs((2, 640, 64, 64), torch.float16)
    xg = torch.randn(2, 1024, 2 * 5120, device="cuda", dtype=torch.float16)

    def step():
        return plugins.group_norm_silu(x, w, b, 32, 1e-6), plugins.geglu(xg)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside capture: Triton compiles on first launch
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_gn, static_geglu = step()

    for seed in (1, 2):
        x2, w2, _ = _gn_inputs(x.shape, x.dtype, seed=seed)
        x.copy_(x2)
        w.copy_(w2)  # an in-place weight update, as a LoRA merge does
        xg.normal_()
        graph.replay()
        want_gn, want_geglu = step()
        assert torch.equal(static_gn, want_gn)
        assert torch.equal(static_geglu, want_geglu)


def _tiny_unet(dtype):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, block_out_channels=(64, 128), layers_per_block=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=64, attention_head_dim=16, norm_num_groups=32, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=16, projection_class_embeddings_input_dim=6 * 16 + 32,
    ).eval().to("cuda", dtype)


def _unet_inputs(dtype):
    g = torch.Generator("cuda").manual_seed(1)
    sample = torch.randn(2, 4, 32, 32, device="cuda", generator=g).to(dtype)
    ctx = torch.randn(2, 77, 64, device="cuda", generator=g).to(dtype)
    added = {"text_embeds": torch.randn(2, 32, device="cuda", generator=g).to(dtype),
             "time_ids": torch.randn(2, 6, device="cuda", generator=g).to(dtype)}
    return (sample, torch.tensor([10.0, 700.0], device="cuda"), ctx), {"added_cond_kwargs": added}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


@pytest.fixture
def no_tf32():
    """fp32 convs and matmuls in full fp32: TF32 would round away the differences measured."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@torch.no_grad()
def test_patched_unet_matches_unpatched(no_tf32):
    """fp32: within 1e-5 of the largest output (reduction order only; the CPU interpreter run
    measures ~7e-7). fp16: within 5e-3, and no further from the fp32 model than the unpatched
    fp16 model is (x1.25 + 1e-4)."""
    args32, kw32 = _unet_inputs(torch.float32)
    ref32 = _tiny_unet(torch.float32)
    want32 = ref32(*args32, **kw32).sample
    fused32 = copy.deepcopy(ref32)
    counts = plugins.use_fused_kernels(fused32)
    assert counts["resnet_blocks"] > 0 and counts["geglu"] > 0 and counts["norm_out"] == 1
    assert _rel_err(fused32(*args32, **kw32).sample, want32) < 1e-5

    args16, kw16 = _unet_inputs(torch.float16)
    ref16 = _tiny_unet(torch.float16)
    fused16 = copy.deepcopy(ref16)
    plugins.use_fused_kernels(fused16)
    plain, fused = ref16(*args16, **kw16).sample, fused16(*args16, **kw16).sample
    assert _rel_err(fused, plain) < 5e-3
    assert _rel_err(fused, want32) <= 1.25 * _rel_err(plain, want32) + 1e-4


@torch.no_grad()
def test_patched_unet_under_torch_compile():
    """Compiled (default mode) patched UNet against the eager patched one, fp16: inductor
    fuses and reorders the ops around ours, so 1e-2 of the largest output, as the fast
    runtime's tests allow."""
    args, kw = _unet_inputs(torch.float16)
    unet = _tiny_unet(torch.float16)
    plugins.use_fused_kernels(unet)
    want = unet(*args, **kw).sample
    torch._dynamo.reset()
    compiled = torch.compile(unet, fullgraph=True)
    assert _rel_err(compiled(*args, **kw).sample, want) < 1e-2
