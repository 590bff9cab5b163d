"""plugins/ on CPU: the ops' reference path, their registration, the diffusers patch, and (when
`triton` is importable) the Triton kernels themselves through Triton's interpreter."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import AutoencoderKL, UNet2DConditionModel
from diffusers.models.resnet import ResnetBlock2D

import plugins
from plugins.patch import FusedGEGLU, FusedResnetBlock2D

ROOT = Path(__file__).resolve().parents[2]
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, groups", [((2, 64, 8, 8), 8), ((3, 12, 5, 7), 4), ((2, 8, 6), 2)])
def test_group_norm_silu_on_cpu_is_the_unfused_reference(shape, groups, dtype):
    torch.manual_seed(0)
    x = (torch.randn(shape) * 2 + 1).to(dtype)
    w, b = torch.randn(shape[1], dtype=dtype), torch.randn(shape[1], dtype=dtype)
    out = plugins.group_norm_silu(x, w, b, groups, 1e-5)
    assert torch.equal(out, F.silu(F.group_norm(x, groups, w, b, 1e-5)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 5, 64), (7, 2 * 100)])
def test_geglu_on_cpu_is_the_unfused_reference(shape, dtype):
    torch.manual_seed(0)
    x = torch.randn(shape, dtype=dtype)
    hidden, gate = x.chunk(2, dim=-1)
    assert torch.equal(plugins.geglu(x), hidden * F.gelu(gate))


def test_ops_on_cpu_give_contiguous_outputs():
    """Channels_last stays channels_last only where the NHWC kernels run (CUDA, the interpreter:
    tests/gpu/test_plugins.py and the interpreter test below)."""
    x = torch.randn(2, 16, 4, 4).to(memory_format=torch.channels_last)
    out = plugins.group_norm_silu(x, torch.ones(16), torch.zeros(16), 4, 1e-6)
    assert out.is_contiguous()
    assert torch.allclose(out, F.silu(F.group_norm(x, 4, torch.ones(16), torch.zeros(16), 1e-6)))
    assert plugins.bias_residual(x, torch.randn(16), x.contiguous(), 1.0).is_contiguous()
    strided = torch.randn(2, 16, 4, 8)[..., ::2]
    assert plugins.group_norm_silu(strided, torch.ones(16), torch.zeros(16), 4, 1e-6).is_contiguous()
    assert plugins.bias_residual(strided, torch.randn(16), strided, 1.0).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_pre_bias_and_bias_residual_on_cpu_are_the_unfused_reference(dtype):
    """The biases of convolutions run without them: x + bias is rounded to x's dtype first, as
    torch's materialized sum is."""
    torch.manual_seed(0)
    x, r = torch.randn(2, 8, 5, 5, dtype=dtype), torch.randn(2, 8, 5, 5, dtype=dtype)
    w, b, c = torch.randn(8, dtype=dtype), torch.randn(8, dtype=dtype), torch.randn(8, dtype=dtype)
    biased = x + c.view(1, -1, 1, 1)
    assert torch.equal(plugins.group_norm_silu(x, w, b, 2, 1e-5, c), F.silu(F.group_norm(biased, 2, w, b, 1e-5)))
    assert torch.equal(plugins.bias_residual(x, c, r, 2.0), (r + biased) / 2.0)


def test_ops_reject_bad_shapes():
    with pytest.raises(RuntimeError, match="do not split into 5 groups"):
        plugins.group_norm_silu(torch.randn(1, 8, 2, 2), torch.ones(8), torch.zeros(8), 5, 1e-6)
    with pytest.raises(RuntimeError, match=r"weight must be \[8\]"):
        plugins.group_norm_silu(torch.randn(1, 8, 2, 2), torch.ones(4), torch.zeros(8), 2, 1e-6)
    with pytest.raises(RuntimeError, match=r"pre_bias must be \[8\]"):
        plugins.group_norm_silu(torch.randn(1, 8, 2, 2), torch.ones(8), torch.zeros(8), 2, 1e-6, torch.ones(3))
    with pytest.raises(RuntimeError, match=r"bias_residual: residual \(1, 8, 2, 3\) is not h's"):
        plugins.bias_residual(torch.randn(1, 8, 2, 2), torch.ones(8), torch.randn(1, 8, 2, 3), 1.0)
    with pytest.raises(RuntimeError, match=r"geglu wants \[..., 2\*D\]"):
        plugins.geglu(torch.randn(3, 7))


def test_ops_registration_passes_opcheck():
    """Schema, fake (meta) implementation and dispatch agree: what torch.compile relies on."""
    for x in (torch.randn(2, 16, 4, 4), torch.randn(2, 16, 4, 4).to(memory_format=torch.channels_last)):
        torch.library.opcheck(torch.ops.easel.group_norm_silu.default, (x, torch.randn(16), torch.randn(16), 4, 1e-5))
        torch.library.opcheck(torch.ops.easel.group_norm_silu.default,
                              (x, torch.randn(16), torch.randn(16), 4, 1e-5, torch.randn(16)))
        torch.library.opcheck(torch.ops.easel.bias_residual.default, (x, torch.randn(16), torch.randn(2, 16, 4, 4), 0.5))
    torch.library.opcheck(torch.ops.easel.geglu.default, (torch.randn(2, 3, 8),))


def _tiny_unet(seed: int = 0) -> UNet2DConditionModel:
    """SDXL's block layout (text_time added conditioning, GEGLU feed-forwards) at toy width."""
    torch.manual_seed(seed)
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8, use_linear_projection=True,
        addition_embed_type="text_time", addition_time_embed_dim=8, projection_class_embeddings_input_dim=6 * 8 + 16,
    ).eval()


def _unet_inputs(batch: int = 2, size: int = 16) -> tuple[tuple, dict]:
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(batch, 4, size, size, generator=g)
    t = torch.tensor([10.0, 500.0][:batch])
    ctx = torch.randn(batch, 7, 32, generator=g)
    added = {"text_embeds": torch.randn(batch, 16, generator=g), "time_ids": torch.randn(batch, 6, generator=g)}
    return (sample, t, ctx), {"added_cond_kwargs": added}


def _perturb_in_place(model: torch.nn.Module) -> None:
    """What an in-place LoRA merge does: write into the existing parameters."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ff.net.0.proj" in name:
                p.mul_(1.25).add_(0.01)


@torch.no_grad()
def test_patched_tiny_unet_matches_unpatched():
    unet = _tiny_unet()
    ref = copy.deepcopy(unet)
    params_before = {n: p for n, p in unet.named_parameters()}
    args, kwargs = _unet_inputs()

    counts = plugins.use_fused_kernels(unet)
    # resnets: down 1+1, mid 2, up 2+2; one GEGLU per transformer block: down 1, mid 1, up 2
    assert counts == {"resnet_blocks": 8, "norm_out": 1, "geglu": 4, "resnet_blocks_skipped": 0}
    assert type(unet.down_blocks[0].resnets[0]) is FusedResnetBlock2D
    assert type(unet.conv_act) is torch.nn.Identity
    assert dict(unet.named_parameters()).keys() == params_before.keys()
    assert all(p is params_before[n] for n, p in unet.named_parameters())

    # On CPU the ops run the same torch functions in the same order as the unpatched
    # modules, so the outputs are bit-equal, not merely close.
    assert torch.equal(unet(*args, **kwargs).sample, ref(*args, **kwargs).sample)
    _perturb_in_place(unet)
    _perturb_in_place(ref)
    assert torch.equal(unet(*args, **kwargs).sample, ref(*args, **kwargs).sample)
    assert plugins.use_fused_kernels(unet) == {"resnet_blocks": 0, "norm_out": 0, "geglu": 0,
                                               "resnet_blocks_skipped": 0}


@torch.no_grad()
def test_patched_unet_compiles_fullgraph():
    """Dynamo traces the swapped-in forwards and the ops' fake implementations without a
    graph break (aot_eager: the same tracing as inductor, no code generation on CPU)."""
    unet = _tiny_unet()
    plugins.use_fused_kernels(unet)
    args, kwargs = _unet_inputs()
    torch._dynamo.reset()
    compiled = torch.compile(unet, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(*args, **kwargs).sample, unet(*args, **kwargs).sample)


@torch.no_grad()
def test_patched_vae_matches_unpatched():
    torch.manual_seed(0)
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 64),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=8).eval()
    ref = copy.deepcopy(vae)
    counts = plugins.use_fused_kernels(vae)
    # encoder 1+1 + mid 2, decoder mid 2 + up 2+2 (time_embedding_norm "group"); both conv_norm_outs
    assert counts == {"resnet_blocks": 10, "norm_out": 2, "geglu": 0, "resnet_blocks_skipped": 0}
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    assert torch.equal(vae.decode(latents).sample, ref.decode(latents).sample)
    image = torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(3))
    assert torch.equal(vae.encode(image).latent_dist.mean, ref.encode(image).latent_dist.mean)


def test_patch_leaves_what_it_cannot_reproduce():
    blocks = torch.nn.ModuleList([
        ResnetBlock2D(in_channels=16, temb_channels=8, groups=4, time_embedding_norm="scale_shift"),
        ResnetBlock2D(in_channels=16, temb_channels=8, groups=4, non_linearity="mish"),
        ResnetBlock2D(in_channels=16, temb_channels=8, groups=4),
        ResnetBlock2D(in_channels=16, temb_channels=8, groups=4),
    ])
    hooked = blocks[3]
    hooked.forward = lambda *a, **k: ResnetBlock2D.forward(hooked, *a, **k)  # as accelerate's hooks do
    counts = plugins.use_fused_kernels(blocks, geglu=False)
    assert counts["resnet_blocks"] == 1 and counts["resnet_blocks_skipped"] == 2
    assert [type(b) for b in blocks] == [ResnetBlock2D, ResnetBlock2D, FusedResnetBlock2D, ResnetBlock2D]


def test_patch_switches():
    unet = _tiny_unet()
    assert plugins.use_fused_kernels(unet, groupnorm_silu=False)["resnet_blocks"] == 0
    assert all(type(m) is not FusedResnetBlock2D for m in unet.modules())
    assert any(type(m) is FusedGEGLU for m in unet.modules())


def _run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter: TRITON_INTERPRET must be set before triton is first imported."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env},
                          timeout=600)


def test_import_and_cpu_ops_need_no_triton():
    proc = _run_python("""
        import sys
        sys.modules["triton"] = None  # any `import triton` now raises ImportError
        import torch, plugins
        plugins.group_norm_silu(torch.randn(1, 4, 2, 2), torch.ones(4), torch.zeros(4), 2, 1e-6)
        plugins.geglu(torch.randn(2, 4))
        from plugins.ops import _kernels
        try:
            _kernels("geglu")
        except RuntimeError as e:
            print(e)
    """)
    assert proc.returncode == 0, proc.stderr
    assert "easel::geglu on a GPU needs the `triton` package" in proc.stdout


# Against a float64 reference rounded to the dtype: within about one unit in the last place.
# bf16 gets a full extra ulp because Triton's interpreter truncates fp32 -> bf16 (GPUs round
# to nearest), so the check here is looser than on the device.
INTERPRETER_TOL = {"float32": (1e-5, 1e-5), "float16": (1e-3, 2e-3), "bfloat16": (1e-2, 1.6e-2)}

_INTERPRETER_OPS = """
    import torch, torch.nn.functional as F
    import plugins
    from plugins import groupnorm_silu_kernel as gk, groupnorm_silu_nhwc_kernel as nk
    # Small tiles, so these small tensors still take every path of the large ones: several
    # stats programs per group, full tiles and a tail, several apply tiles per program.
    gk._STATS_BLOCK, gk._APPLY_BLOCK, gk._MIN_TILES_PER_SPLIT = 64, 32, 1
    nk._TILE, nk._MIN_TILES_PER_SPLIT = 64, 1
    TOL = {tol!r}
    torch.manual_seed(0)

    def check(out, ref, dtype, layout=torch.contiguous_format):
        atol, rtol = TOL[str(dtype).removeprefix("torch.")]
        assert out.dtype == dtype and out.is_contiguous(memory_format=layout), (out.dtype, out.stride())
        torch.testing.assert_close(out, ref.to(dtype), atol=atol, rtol=rtol)

    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # channels_last: the NHWC kernels, with channels that are no power of two (24: masked lanes)
        for shape, groups, layout in [((2, 16, 10, 9), 4, torch.contiguous_format), ((1, 12, 7, 5), 3, None),
                                      ((2, 8, 12), 2, None), ((1, 64, 2, 2), 32, None),
                                      ((2, 16, 10, 9), 4, torch.channels_last), ((2, 24, 5, 6), 8, torch.channels_last),
                                      ((1, 64, 3, 2), 32, torch.channels_last)]:
            layout = layout or torch.contiguous_format
            for with_bias in (False, True):
                # an offset mean, so a naive sum of squares would lose digits
                x = (torch.randn(shape, dtype=torch.float64) * 2 + 20).to(dtype).contiguous(memory_format=layout)
                w, b = torch.randn(shape[1]).to(dtype), torch.randn(shape[1]).to(dtype)
                pre = torch.randn(shape[1]).to(dtype) if with_bias else None
                biased = x.float() + pre.view(1, -1, *[1] * (x.dim() - 2)).float() if with_bias else x
                if with_bias and dtype == torch.bfloat16:  # the interpreter's truncation, not rounding
                    biased = (biased.view(torch.int32) & ~0xFFFF).view(torch.float32)
                biased = biased.to(dtype)
                ref = F.silu(F.group_norm(biased.double(), groups, w.double(), b.double(), 1e-5))
                check(plugins.group_norm_silu(x, w, b, groups, 1e-5, pre), ref, dtype, layout)
                h, r = (torch.randn(shape).to(dtype).contiguous(memory_format=layout) for _ in range(2))
                out = plugins.bias_residual(h, b, r, 1.0 if with_bias else 0.5)
                want = (r + (h + b.view(1, -1, *[1] * (h.dim() - 2)))) / (1.0 if with_bias else 0.5)
                assert out.is_contiguous(memory_format=layout), out.stride()
                if dtype != torch.bfloat16:
                    assert torch.equal(out, want), (out - want).abs().max()
                else:  # truncated three times by the interpreter (see INTERPRETER_TOL): 2 ulps
                    torch.testing.assert_close(out, want, atol=0.0625, rtol=2 ** -6)
        x = torch.randn(2, 16, 6, 6).to(dtype)[..., ::2]  # neither layout: made NCHW first
        ref = F.silu(F.group_norm(x.double(), 4, None, None, 1e-5))
        check(plugins.group_norm_silu(x, torch.ones(16, dtype=dtype), torch.zeros(16, dtype=dtype), 4, 1e-5), ref, dtype)
        for shape in [(2, 3, 2 * 40), (5, 2 * 1500), (2, 2 * 2560), (1, 2)]:
            x = (torch.randn(shape) * 3).to(dtype)
            h, g = x.double().chunk(2, dim=-1)
            check(plugins.geglu(x), h * F.gelu(g), dtype)
    print("ok")
"""


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here (its interpreter runs the kernels on CPU)")
def test_triton_kernels_in_interpreter_match_float64_reference():
    proc = _run_python(_INTERPRETER_OPS.format(tol=INTERPRETER_TOL), TRITON_INTERPRET="1")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed here (its interpreter runs the kernels on CPU)")
def test_triton_kernels_in_interpreter_patched_unet():
    """The whole patched UNet through the Triton kernels, fp32. The kernels reduce in another
    order than torch's CPU GroupNorm, so close, not bit-equal: outputs are ~1, measured max
    difference ~1e-6, allowed 1e-5."""
    proc = _run_python("""
        import copy, torch
        import plugins
        from plugins import groupnorm_silu_kernel as gk
        from tests.unit.test_plugins_cpu import _tiny_unet, _unet_inputs
        # Small and few: the interpreter runs every Triton op of every program through Python.
        gk._STATS_BLOCK, gk._APPLY_BLOCK, gk._MIN_TILES_PER_SPLIT = 16, 64, 1
        unet = _tiny_unet()
        ref = copy.deepcopy(unet)
        plugins.use_fused_kernels(unet)
        args, kwargs = _unet_inputs(batch=1, size=8)
        with torch.no_grad():
            out, want = unet(*args, **kwargs).sample, ref(*args, **kwargs).sample
        print("max abs diff", (out - want).abs().max().item())
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
        print("ok")
    """, TRITON_INTERPRET="1")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-4000:]
