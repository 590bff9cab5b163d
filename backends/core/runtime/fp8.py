"""FP8 (e4m3) matrix products for the UNet's transformer blocks, with static, calibrated scales.

An approximate mode: the image moves away from the fp16 one, so it is opt-in and its PSNR against
the exact path is measured (bench/micro/fp8_probe.py), never assumed.

Why static scales: a scale computed from each call's activations (the first probe, row-wise amax)
needs a reduction over the activation before the cast, a pass of its own that cost more than FP8
saved (36.2 against 32.5 ms a step on an H200). With a scale fixed at calibration the cast is a
pointwise epilogue that inductor fuses into whatever kernel wrote the activation (a LayerNorm, the
GEGLU, a residual add), so the product's input is written once, in one byte instead of two.

Weights stay in fp16 beside their e4m3 copy: the fp16 weight is what a LoRA merge or `refit`
writes in place; `requantize()` then rewrites the copy in place, so captured graphs see it.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import torch.nn.functional as F
from torch import nn

from backends.core.runtime.config import FP8_PARTS, check_fp8_parts

log = logging.getLogger(__name__)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3fn value
# The calibrated range is stretched this much: an input past it saturates, and text unlike the
# calibration prompts' (longer, rarer tokens) can reach further. e4m3 is a floating-point format,
# so the stretch costs no precision, only the bottom two binades (below 1/10,000 of the range).
HEADROOM = 4.0


def fits_e4m3(weight: torch.Tensor) -> bool:
    """Whether an e4m3 product (torch._scaled_mm) takes a weight of this shape."""
    return weight.shape[0] % 16 == 0 and weight.shape[1] % 16 == 0


class Fp8Linear(nn.Module):
    """y = x W^T + b as one e4m3 product with per-tensor scales: W's from its own amax, x's from
    the amax seen while calibrating (times HEADROOM). A value past that range saturates (the cast
    to e4m3fn itself does not: a value rounded past 448 would become NaN, hence the clamp).
    `exact(x)`: the layer's product without FP8, in x's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if not fits_e4m3(weight):
            raise ValueError(f"an FP8 product needs dimensions that are multiples of 16, not {tuple(weight.shape)}")
        self.weight = weight  # the fp16 weight (a Parameter or a view of a packed one): refit writes it
        self.bias = bias
        self.register_buffer("w8", torch.empty(weight.shape, dtype=E4M3, device=weight.device))
        self.register_buffer("w_scale", torch.ones((), dtype=torch.float32, device=weight.device))
        self.register_buffer("x_scale", torch.ones((), dtype=torch.float32, device=weight.device))
        # fp32: as an fp16 multiplier, 448 / (HEADROOM * amax) overflows for ranges under 0.0017.
        self.register_buffer("x_inverse", torch.ones((), dtype=torch.float32, device=weight.device))
        self.register_buffer("x_amax", torch.zeros((), dtype=torch.float32, device=weight.device))
        self.calibrating = False
        # cuBLAS's fast accumulation (RuntimeConfig.fp8_fast_accum); set before the runtime
        # compiles or captures the layer.
        self.fast_accum = False
        self.requantize()

    @torch.no_grad()
    def requantize(self) -> None:
        """The e4m3 copy from the fp16 weight, in place."""
        w = self.weight.detach().float()
        self.w_scale.copy_(w.abs().amax().clamp(min=1e-12) / E4M3_MAX)
        self.w8.copy_((w / self.w_scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3))

    @torch.no_grad()
    def set_input_range(self, amax: float, headroom: float = HEADROOM) -> None:
        scale = max(amax, 1e-12) * headroom / E4M3_MAX
        self.x_scale.fill_(scale)
        self.x_inverse.fill_(1.0 / scale)

    def note_range(self, x: torch.Tensor) -> None:
        self.x_amax.copy_(torch.maximum(self.x_amax, x.detach().abs().amax().float()))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """`x` in e4m3, by the calibrated scale. In fp32, fused under compile into the kernel that
        wrote `x` (eager: one fp32 temporary)."""
        return (x.float() * self.x_inverse).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)

    def product(self, x8: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """[rows, in] e4m3 -> [rows, out]. The bias in the product's epilogue, not in the kernel
        that reads the product: a step 0.33-0.40 ms faster on an H200 (bench/micro/fp8_probe.py,
        results/2026-11-24b-h200)."""
        return torch._scaled_mm(x8, self.w8.t(), bias=self.bias, scale_a=self.x_scale, scale_b=self.w_scale,
                                out_dtype=out_dtype, use_fast_accum=self.fast_accum)

    def exact(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.calibrating:  # the exact product, noting the input's range
            self.note_range(x)
            return self.exact(x)
        y = self.product(self.quantize(x.reshape(-1, x.shape[-1])), x.dtype)
        return y.reshape(*x.shape[:-1], self.weight.shape[0])

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bias={self.bias is not None}"


def use_fp8(unet: nn.Module, parts: tuple[str, ...] = FP8_PARTS) -> list[Fp8Linear]:
    """Swap the transformer blocks' linear layers for Fp8Linear, in place; returns them (to
    calibrate and requantize). `parts`: the attention's input projections (self-attention's packed
    QKV included; cross-attention's text K/V are computed once per request and stay fp16), the
    feed-forward's two products, the Transformer2D blocks' proj_in/proj_out.

    Attention's output projections stay fp16: their input comes straight from the attention
    kernel, so in e4m3 each needed a cast kernel of its own (140 a step, 0.55 ms), and theirs were
    the largest errors of any product. Kept in fp16, a step was as fast or faster (26.39 against
    26.55 ms, H200) and its noise 2.8% from fp16's instead of 3.1% (bench/micro/fp8_probe.py,
    results/2026-11-24b-h200)."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    from backends.core.runtime.packed_attention import PackedCrossAttnProcessor, PackedSelfAttnProcessor

    parts = check_fp8_parts(parts, "fp8 parts")
    swapped: list[Fp8Linear] = []
    kept = 0  # linear layers of a shape no e4m3 product takes

    def fits(weight: torch.Tensor) -> bool:
        nonlocal kept
        kept += not fits_e4m3(weight)
        return fits_e4m3(weight)

    def swap(owner: nn.Module, attr: str) -> None:
        # getattr/setattr by name also reach a ModuleList's or Sequential's items ("0", "2").
        linear = getattr(owner, attr)
        if type(linear) is nn.Linear and fits(linear.weight):
            setattr(owner, attr, Fp8Linear(linear.weight, linear.bias))
            swapped.append(getattr(owner, attr))

    for module in list(unet.modules()):  # (the walk swaps children as it goes)
        if isinstance(module, Transformer2DModel) and "projections" in parts:
            swap(module, "proj_in")
            swap(module, "proj_out")
        if not isinstance(module, BasicTransformerBlock):
            continue
        if "attention" in parts:
            for attn in (module.attn1, module.attn2):
                if attn is None:
                    continue
                processor = attn.processor
                if isinstance(processor, PackedSelfAttnProcessor):
                    if fits(processor.qkv):
                        processor.qkv_product = Fp8Linear(processor.qkv, None)
                        swapped.append(processor.qkv_product)
                    names = ()
                elif isinstance(processor, PackedCrossAttnProcessor):
                    names = ("to_q",)
                else:
                    names = ("to_q", "to_k", "to_v")
                for name in names:
                    swap(attn, name)
        if "feed_forward" in parts:
            swap(module.ff.net[0], "proj")
            swap(module.ff.net, "2")
    log.info("FP8 products: %d linear layers (%s); %d kept in their dtype (a dimension not a multiple of 16)",
             len(swapped), ", ".join(parts), kept)
    return swapped


@contextlib.contextmanager
def calibrating(layers: list[Fp8Linear]):
    """Run the exact fp16 products while noting each layer's input range; on exit, each layer's
    input scale is set from the largest value it saw."""
    for layer in layers:
        layer.x_amax.zero_()
        layer.calibrating = True
    try:
        yield
    finally:
        for layer in layers:
            layer.calibrating = False
    unseen = 0
    for layer in layers:
        amax = float(layer.x_amax)
        unseen += amax == 0.0
        layer.set_input_range(amax)
    if unseen:
        log.warning("FP8 calibration: %d of %d layers saw no input", unseen, len(layers))


# --- calibration data: written at export, read by the runtime at load ---

CALIBRATION_FILE = "fp8_calibration.safetensors"  # in the UNet's artifacts folder
# Prompts of the kinds people send (photo, painting, portrait, night scene): their text through
# the model's own encoders is what the calibration's cross-attention sees.
CALIBRATION_PROMPTS = (
    "a photograph of a red fox in the snow at golden hour",
    "an oil painting of a harbour town at dusk, thick brush strokes",
    "a watercolor portrait of an old woman by a window, soft light",
    "a city street at night in the rain, neon signs, cinematic",
)
# Spread over the training schedule: a request's steps visit all of it.
CALIBRATION_TIMESTEPS = (999, 850, 700, 550, 400, 250, 100, 1)


@torch.no_grad()
def write_calibration(pipe, path, size: int) -> None:
    """The calibration prompts through `pipe`'s text encoders, each beside its negative (the
    empty prompt, as a request without one gets), with the time ids of a `size` px image."""
    from safetensors.torch import save_file

    embeds, negative, pooled, negative_pooled = pipe.encode_prompt(
        list(CALIBRATION_PROMPTS), device=pipe.device, do_classifier_free_guidance=True)
    scale = pipe.vae_scale_factor
    save_file({"text": torch.cat([negative, embeds]).contiguous(),
               "pooled": torch.cat([negative_pooled, pooled]).contiguous(),
               "time_ids": torch.tensor([[size, size, 0, 0, size, size]], dtype=torch.float32),
               "latent_hw": torch.tensor([size // scale, size // scale])}, str(path))


@torch.no_grad()
def calibrate_from_file(layers: list[Fp8Linear], unet: nn.Module, encoder, decoder, path) -> None:
    """Set the layers' input scales from the exact (fp16) halves run on the calibration file's
    text, at CALIBRATION_TIMESTEPS, on unit-variance latents (what a sampler hands the UNet after
    scaling: noise early, a clean latent late)."""
    import time
    from pathlib import Path

    from safetensors.torch import load_file

    from backends.core.runtime.unet_split import split_forward

    if not Path(path).is_file():
        raise ValueError(f"runtime.fp8: no calibration data at {path} (easel export --fp8 writes it)")
    weight = next(unet.parameters())
    data = load_file(str(path), device=str(weight.device))
    text, pooled = data["text"].to(weight.dtype), data["pooled"].to(weight.dtype)
    rows = text.shape[0]
    time_ids = data["time_ids"].to(weight.dtype).expand(rows, -1)
    h, w = (int(v) for v in data["latent_hw"])
    generator = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    with calibrating(layers):
        for t in CALIBRATION_TIMESTEPS:
            sample = torch.randn(rows, unet.config.in_channels, h, w, generator=generator)
            split_forward(encoder, decoder, sample.to(weight.device, weight.dtype),
                          torch.full((rows,), float(t), device=weight.device), text, pooled, time_ids)
    log.info("FP8 calibration: %d layers, %d rows at %dx%d latents x %d timesteps, %.1f s",
             len(layers), rows, h, w, len(CALIBRATION_TIMESTEPS), time.perf_counter() - start)

