"""Does FP8 pay for the UNet, and what does it cost the image? The transformer blocks' linear
layers as e4m3 products with static scales (backends/core/runtime/fp8.py: per-tensor, the inputs'
calibrated on another request's eager trajectory) under the compiled runtime, against the same
runtime in fp16, in one process on one GPU. SDXL-base shapes, random weights.

Reports each variant's replayed step (GPU time), its noise prediction's error on one batch, and
a whole request (Euler, guidance 5) from one seed through it and the VAE: the PSNR of its image
against the fp16 one. Variants: `fp16`; `fp8` (attention, feed-forward and the blocks'
projections); `fp8-ff` (feed-forward only: its products are the largest).

The first probe (session 7) scaled each call's activations row by row: 36.2 against 32.5 ms, a
reduction pass per product that cost more than FP8 saved.

    python3 -m bench.fp8_probe --work /tmp/easel-micro --out $OUT/fp8_probe.json
"""

from __future__ import annotations

import json
import logging
import statistics
import time

import torch

from bench.common import bench_parser, random_sdxl, random_sdxl_denoiser, start_logging
from bench.runtime_micro import gpu_ms

log = logging.getLogger("bench.fp8_probe")
VARIANTS = {"fp16": None, "fp8": ("attention", "feed_forward", "projections"), "fp8-ff": ("feed_forward",)}


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="fp16,fp8,fp8-ff", help=f"from {list(VARIANTS)}; fp16 first")
    p.add_argument("--calibration-steps", type=int, default=20)
    args = p.parse_args()
    start_logging()
    variants = args.variants.split(",")
    if variants[0] != "fp16" or set(variants) - set(VARIANTS):
        p.error(f"--variants: fp16 first, then any of {list(VARIANTS)}")

    from backends.core.engine.builder import template_batch
    from backends.core.engine.denoiser import DenoiseJob, TorchDenoiser
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.fp8 import calibrating, use_fp8
    from backends.core.runtime.placement import Placement
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.torch_fast import FastUNetRuntime, _resized
    from backends.core.stages.image_metrics import psnr
    from backends.core.stages.vae_decoding import LatentDecoder

    model, folder = random_sdxl(args.work), random_sdxl_denoiser(args.work)
    where = Placement("cuda:0", "fp16")
    latent = args.size // 8
    vae = LatentDecoder(model, where, graphs=True, fused_kernels=True)

    def request(seed: int, steps: int):
        g = torch.Generator().manual_seed(seed)
        params = validate({"prompt": "x", "steps": steps, "width": args.size, "height": args.size, "seed": seed,
                           "scheduler": "euler"}, Limits(max_steps=1000))
        return DenoiseJob(f"r{seed}", params, torch.randn(2, 77, 2048, generator=g).numpy(),
                          torch.randn(2, 1280, generator=g).numpy())

    def denoise(runtime, job):
        engine = TorchDenoiser(folder, where, runtime=runtime)
        with engine.on_stream(), torch.inference_mode():
            state = engine.start(job)
            while state.index < len(state.timesteps):
                engine.step([state])
        return engine.result(state)

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
              "steps": args.steps, "calibration_steps": args.calibration_steps, "variants": {}}
    outputs = {}
    for name in variants:
        eager = EagerUNetRuntime(*load_unet_halves(folder, where))
        runtime = FastUNetRuntime(eager, RuntimeConfig(kind="compiled", row_buckets=(2,)),
                                  cache_root=args.work / "cache")
        entry = report["variants"][name] = {}
        if VARIANTS[name] is not None:
            layers = use_fp8(eager.weights_module, VARIANTS[name])
            start = time.perf_counter()
            with calibrating(layers):  # another request than the one measured: seed 7, eager
                denoise(eager, request(7, args.calibration_steps))
            entry.update(fp8_linears=len(layers), calibration_s=time.perf_counter() - start,
                         input_amax={"min": min(float(x.x_amax) for x in layers),
                                     "max": max(float(x.x_amax) for x in layers)})
        template = template_batch(eager.weights_module, torch.device("cuda:0"), torch.float16)
        start = time.perf_counter()
        runtime.warmup(template, [(latent, latent)])
        entry["warmup_s"] = time.perf_counter() - start
        torch.manual_seed(0)
        batch = _resized(template, 2, latent, latent)
        batch.text.normal_()
        with torch.inference_mode():
            step = gpu_ms(lambda: runtime.decode(batch, runtime.encode(batch), None), args.iters)
            noise = runtime.decode(batch, runtime.encode(batch), None).float()
        image = vae.decode(denoise(runtime, request(1, args.steps)))
        entry.update(step_ms=statistics.median(step), step_ms_all=step)
        outputs[name] = (noise, image)
        log.info("%s: step %.2f ms (replayed), warm-up %.0f s", name, entry["step_ms"], entry["warmup_s"])
        if name != "fp16":
            noise16, image16 = outputs["fp16"]
            entry.update(
                step_ratio_over_fp16=entry["step_ms"] / report["variants"]["fp16"]["step_ms"],
                noise_max_rel_error=float((noise - noise16).abs().max() / noise16.abs().max()),
                noise_rms_rel_error=float((noise - noise16).pow(2).mean().sqrt() / noise16.pow(2).mean().sqrt()),
                image_psnr_db=psnr(image, image16))
            log.info("%s / fp16 step: %.3f; noise error max %.3g rms %.3g; image PSNR %.1f dB", name,
                     entry["step_ratio_over_fp16"], entry["noise_max_rel_error"], entry["noise_rms_rel_error"],
                     entry["image_psnr_db"])
        runtime = eager = None  # before the next variant's UNet is loaded
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after each variant: a later one may not finish


if __name__ == "__main__":
    main()
