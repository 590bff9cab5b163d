"""The UNet runtime contract (backends/core/runtime/base.py) on CPU, and the builder that wires a
denoiser from its typed config (backends/core/engine/builder.py).

Tolerance: none. The eager runtime runs the split UNet's own modules on the same weights, so its
encode+decode is compared with torch.equal to the halves called directly.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch

from backends.core.engine.builder import build_denoiser, template_batch
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.artifacts import load_unet_halves
from backends.core.runtime.base import PatchLayout, StepBatch
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.runtime.torch_eager import EagerUNetRuntime
from backends.core.runtime.unet_split import split_forward
from backends.core.stages.text_encoding import PromptEncoder
from export.repository import ExportOptions, export_repository


@pytest.fixture(scope="module")
def repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("contract") / "repo", ExportOptions())


@pytest.fixture(scope="module")
def runtime(repo):
    return EagerUNetRuntime(*load_unet_halves(repo / "denoiser" / "1", Placement()))


def random_batch(runtime, rows=3, seed=0) -> StepBatch:
    t = template_batch(runtime.weights_module, torch.device("cpu"), torch.float32)
    g = torch.Generator().manual_seed(seed)
    return StepBatch(torch.randn(rows, *t.sample.shape[1:], generator=g), torch.linspace(900, 20, rows),
                     torch.randn(rows, *t.text.shape[1:], generator=g), torch.randn(rows, *t.pooled.shape[1:], generator=g),
                     t.time_ids.repeat(rows, 1))


def test_eager_runtime_is_the_split_unet(runtime):
    b = random_batch(runtime)
    enc = runtime.encode(b)
    got = runtime.decode(b, enc, None)
    want = split_forward(runtime.encoder, runtime.decoder, b.sample, b.timestep, b.text, b.pooled, b.time_ids)
    assert torch.equal(got, want)
    residuals = ([torch.ones_like(s) for s in enc.skips], torch.ones_like(enc.mid))
    with_res = runtime.decode(b, runtime.encode(b), residuals)
    assert torch.equal(with_res, split_forward(runtime.encoder, runtime.decoder, b.sample, b.timestep, b.text,
                                               b.pooled, b.time_ids, *residuals))
    assert not torch.equal(with_res, got)


def test_modes_a_runtime_lacks_are_refused(runtime):
    from backends.core.runtime.base import RuntimeCaps, check_batch
    from backends.core.runtime.token_subsets import FULL, TokenLayout, TokenRow

    b = random_batch(runtime, rows=1)
    masked = StepBatch(**{**b.__dict__, "tokens": TokenLayout((TokenRow(FULL),))})
    with pytest.raises(NotImplementedError, match="graphs runtime cannot serve token subsets"):
        check_batch(RuntimeCaps(name="graphs", graphs=True), masked)
    # the eager runtime serves them (tests/export/test_template_cache.py): rows run whole are the same
    assert torch.equal(runtime.decode(masked, runtime.encode(masked), None), runtime.decode(b, runtime.encode(b), None))
    patched = StepBatch(**{**b.__dict__, "patches": PatchLayout((0,), ((0, 0),), ((8, 8),))})
    with pytest.raises(NotImplementedError, match="cannot serve patch batches"):
        runtime.encode(patched)


def test_refit_writes_in_place_and_checks_first(repo):
    runtime = EagerUNetRuntime(*load_unet_halves(repo / "denoiser" / "1", Placement()))
    name, param = next(iter(runtime.weights_module.named_parameters()))
    ptr = param.data_ptr()
    runtime.refit({name: torch.full_like(param, 0.5)})
    assert param.data_ptr() == ptr and bool((param == 0.5).all())
    with pytest.raises(ValueError, match=f"refit: {name} is"):
        runtime.refit({name: torch.zeros(3)})
    with pytest.raises(KeyError, match="no weight 'missing'"):
        runtime.refit({"missing": torch.zeros(1), name: torch.zeros_like(param)})
    assert bool((param == 0.5).all())  # nothing was written: names are checked before any copy


def test_fast_runtimes_need_a_gpu(repo):
    from backends.core.runtime.torch_fast import FastUNetRuntime

    runtime = EagerUNetRuntime(*load_unet_halves(repo / "denoiser" / "1", Placement()))
    with pytest.raises(ValueError, match="runtime.kind='graphs' needs a CUDA device"):
        FastUNetRuntime(runtime, RuntimeConfig(kind="graphs"))


def test_runtime_config_rejects_bad_values():
    with pytest.raises(ValueError, match="row_buckets"):
        RuntimeConfig(row_buckets=(0, 2))
    with pytest.raises(ValueError, match="warmup_sizes"):
        RuntimeConfig(warmup_sizes=((64,),))
    assert RuntimeConfig(row_buckets=(8, 2)).row_buckets == (2, 8)
    assert RuntimeConfig(kind="graphs").miss_captures and not RuntimeConfig(kind="compiled").miss_captures
    for bad in (0, 2.5, "8"):
        with pytest.raises(ValueError, match="runtime.subset_graph_limit"):
            RuntimeConfig.from_dict({"subset_graph_limit": bad})
    # easel export --subset-graph-limit reaches the denoiser's runtime config
    from export.cli import parser

    args = parser().parse_args(["export", "--model", "m", "--out", "o", "--subset-graph-limit", "12"])
    assert ExportOptions(subset_graph_limit=args.subset_graph_limit).runtime_config(8, 64).subset_graph_limit == 12


def test_builder_wires_a_working_denoiser(repo):
    """The wiring the Triton adapter runs, on CPU: config -> runtime -> engine -> loop."""
    config = DenoiserConfig(limits=Limits(), max_running=4, max_batch_rows=4)
    assert DenoiserConfig.from_json(config.to_json()) == config
    done, event = [], threading.Event()

    def on_done(result):
        done.append(result)
        event.set()

    denoiser = build_denoiser(config, repo / "denoiser" / "1", Placement(), on_done)
    assert denoiser.engine.runtime.caps.name == "eager" and denoiser.lora_loader is None
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    params = validate({"prompt": "a boat", "steps": 3, "width": 64, "height": 64, "seed": 2}, Limits())
    embeds, pooled = encoder.encode(params)
    denoiser.loop.start()
    try:
        denoiser.loop.submit(DenoiseJob("r1", params, embeds, pooled))
        assert event.wait(120)
    finally:
        denoiser.shutdown()
    (result,) = done
    assert result.error is None and result.steps == 3 and result.latents.shape == (1, 4, 8, 8)
    assert json.loads(config.to_json())["runtime"]["kind"] == "eager"


def test_vae_options_keep_the_pixels(repo):
    """The VAE's fast-path options on CPU: fused kernels run plugins' torch reference (the same ops
    in the same order) and channels_last the same convolutions in another layout: pixels within
    1/255 of the plain decoder (rounding to uint8 can flip on a last-bit difference)."""
    import numpy as np

    from backends.core.stages.vae_decoding import LatentDecoder

    folder = repo / "vae_decoder" / "1"
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    want = LatentDecoder(folder, Placement()).decode(latents)
    # Laid out as [H, W, 3]: the Triton tensor takes it without a strided copy on the host.
    assert want.shape == (64, 64, 3) and want.dtype == np.uint8 and want.flags.c_contiguous
    for options in ({"fused_kernels": True}, {"channels_last": True}, {"graphs": True}):  # graphs: GPU only
        got = LatentDecoder(folder, Placement(), **options).decode(latents)
        assert got.shape == want.shape and np.abs(got.astype(int) - want.astype(int)).max() <= 1, options
        assert got.flags.c_contiguous, options


def test_vae_half_precision_attention_follows_diffusers_processor(repo):
    """HalfPrecisionAttention is AttnProcessor2_0 step for step: in fp32 it gives the stock
    processor's output bit for bit; in bf16 (the attention product only) it stays within 1/255
    of the fp32 pixels on the tiny VAE (the GPU tier and bench/micro/vae_micro.py measure SDXL's)."""
    import numpy as np

    from backends.core.stages.vae_decoding import HalfPrecisionAttention, LatentDecoder

    folder = repo / "vae_decoder" / "1"
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    plain = LatentDecoder(folder, Placement())
    want = plain.decode(latents)
    same = LatentDecoder(folder, Placement())
    (attn,) = same.vae.decoder.mid_block.attentions
    assert HalfPrecisionAttention.supports(attn)
    attn.set_processor(HalfPrecisionAttention(torch.float32))
    assert np.array_equal(same.decode(latents), want)
    half = LatentDecoder(folder, Placement(), attention_dtype=torch.bfloat16)
    assert isinstance(half.vae.decoder.mid_block.attentions[0].processor, HalfPrecisionAttention)
    assert np.abs(half.decode(latents).astype(int) - want.astype(int)).max() <= 1


def test_vae_in_bf16_stays_close_to_fp32(repo):
    """export --vae-dtype bf16: the whole VAE in bf16 (fp32's range, 8 bits of mantissa), an
    approximate fast path; on the tiny VAE its pixels stay >= 40 dB from fp32's, none more than 8/255 off
    (bench/micro/vae_micro.py measures SDXL's on the GPU: 49.7 dB)."""
    import numpy as np

    from clients.bench.image_metrics import psnr
    from backends.core.stages.vae_decoding import LatentDecoder

    folder = repo / "vae_decoder" / "1"
    latents = np.random.default_rng(0).standard_normal((1, 4, 8, 8)).astype(np.float32)
    want = LatentDecoder(folder, Placement()).decode(latents)
    half = LatentDecoder(folder, Placement(), dtype=torch.bfloat16)
    assert {p.dtype for p in half.vae.parameters()} == {torch.bfloat16}
    got = half.decode(latents)
    assert got.shape == want.shape and np.abs(got.astype(int) - want.astype(int)).max() <= 8
    assert psnr(got, want) >= 40, psnr(got, want)
