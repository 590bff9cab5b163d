"""Would FP8 matrix products pay for the UNet? A probe, not a runtime: the transformer blocks'
linear layers as FP8 (e4m3) products with per-row activation scales and per-output-channel weight
scales (torch._scaled_mm), under the compiled runtime, against the same runtime in fp16, in one
process on one GPU. SDXL-base shapes, random weights.

Reports the replayed step's GPU time of each, the noise prediction's error on one batch, and a
whole request (Euler, guidance 5) from one seed through each and the VAE: the PSNR of the FP8
image against the fp16 one. Matrix products are three quarters of a compiled fp16 step's kernel
time at 1024 px (bench/step_profile.py), so FP8 is the largest lever left; what it costs in
fidelity decides whether it can be more than an opt-in.

    python3 -m bench.fp8_probe --work /tmp/easel-micro --out $OUT/fp8_probe.json
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import torch
from torch import nn

from bench.common import bench_parser, random_sdxl, random_sdxl_denoiser, start_logging
from bench.runtime_micro import gpu_ms

log = logging.getLogger("bench.fp8_probe")
E4M3_MAX = 448.0


class Fp8Linear(nn.Module):
    """y = x W^T + b with x and W in e4m3: W scaled per output channel once, x per row each call."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX  # [N, 1]
        # Clamped: a cast to e4m3fn does not saturate, a value a rounding past 448 becomes NaN.
        self.register_buffer("w8", (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn))  # [N, K]
        self.register_buffer("w_scale", scale.t().contiguous())  # [1, N]
        self.bias = linear.bias
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x_scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX  # [M, 1]
        x8 = (rows.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
        # Row-wise scaled products write bf16 (CUTLASS's kernel); the cast and bias fuse under compile.
        y = torch._scaled_mm(x8, self.w8.t(), scale_a=x_scale, scale_b=self.w_scale, out_dtype=torch.bfloat16)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)


def use_fp8(unet: nn.Module) -> int:
    """Swap every nn.Linear inside the transformer blocks (attention projections, feed-forward) and
    the Transformer2D projections for Fp8Linear; returns how many."""
    from diffusers.models.attention import BasicTransformerBlock
    from diffusers.models.transformers.transformer_2d import Transformer2DModel

    count = 0
    for owner in [m for m in unet.modules() if isinstance(m, (BasicTransformerBlock, Transformer2DModel))]:
        for name, child in list(owner.named_modules()):
            for attr, leaf in list(child.named_children()):
                if type(leaf) is nn.Linear and leaf.in_features % 16 == 0 and leaf.out_features % 16 == 0:
                    setattr(child, attr, Fp8Linear(leaf))
                    count += 1
    return count


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    start_logging()

    from backends.core.engine.builder import template_batch
    from backends.core.engine.denoiser import DenoiseJob, TorchDenoiser
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.placement import Placement
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.torch_fast import FastUNetRuntime, _resized
    from backends.core.stages.image_metrics import psnr
    from backends.core.stages.vae_decoding import LatentDecoder

    model, folder = random_sdxl(args.work), random_sdxl_denoiser(args.work)
    where = Placement("cuda:0", "fp16")
    latent = args.size // 8
    vae = LatentDecoder(model, where, graphs=True, fused_kernels=True)
    params = validate({"prompt": "x", "steps": args.steps, "width": args.size, "height": args.size, "seed": 1,
                       "scheduler": "euler"}, Limits(max_steps=1000))
    g = torch.Generator().manual_seed(0)
    embeds, pooled = torch.randn(2, 77, 2048, generator=g).numpy(), torch.randn(2, 1280, generator=g).numpy()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
              "steps": args.steps, "variants": {}}
    outputs = {}
    for name in ("fp16", "fp8"):
        eager = EagerUNetRuntime(*load_unet_halves(folder, where))
        if name == "fp8":
            report["fp8_linears"] = use_fp8(eager.weights_module)
        runtime = FastUNetRuntime(eager, RuntimeConfig(kind="compiled", row_buckets=(2,)),
                                  cache_root=args.work / "cache")  # bench/step_profile.py's: fp16 compiled once
        template = template_batch(eager.weights_module, torch.device("cuda:0"), torch.float16)
        start = time.perf_counter()
        runtime.warmup(template, [(latent, latent)])
        entry = report["variants"][name] = {"warmup_s": time.perf_counter() - start}
        torch.manual_seed(0)
        batch = _resized(template, 2, latent, latent)
        batch.text.normal_()
        with torch.inference_mode():
            step = gpu_ms(lambda: runtime.decode(batch, runtime.encode(batch), None), args.iters)
            noise = runtime.decode(batch, runtime.encode(batch), None).float()
        engine = TorchDenoiser(folder, where, runtime=runtime)
        with engine.on_stream(), torch.inference_mode():
            state = engine.start(DenoiseJob("r", params, embeds, pooled))
            while state.index < len(state.timesteps):
                engine.step([state])
        image = vae.decode(engine.result(state))
        entry.update(step_ms=statistics.median(step), step_ms_all=step)
        outputs[name] = (noise, image)
        log.info("%s: step %.2f ms (replayed), warm-up %.0f s", name, entry["step_ms"], entry["warmup_s"])
        del engine, state, runtime, eager
        torch.cuda.empty_cache()
    (noise16, image16), (noise8, image8) = outputs["fp16"], outputs["fp8"]
    report["noise_max_rel_error"] = float((noise8 - noise16).abs().max() / noise16.abs().max())
    report["noise_rms_rel_error"] = float((noise8 - noise16).pow(2).mean().sqrt() / noise16.pow(2).mean().sqrt())
    report["image_psnr_db"] = psnr(image8, image16)
    report["step_ratio_fp8_over_fp16"] = report["variants"]["fp8"]["step_ms"] / report["variants"]["fp16"]["step_ms"]
    log.info("fp8 / fp16 step: %.3f; noise error max %.3g rms %.3g; image PSNR %.1f dB",
             report["step_ratio_fp8_over_fp16"], report["noise_max_rel_error"], report["noise_rms_rel_error"],
             report["image_psnr_db"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
