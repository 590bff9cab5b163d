"""Decides whether the FP8 runtime mode pays for what it costs the image.

Does FP8 pay for the UNet, and what does it cost the image? The runtime's FP8 mode
(RuntimeConfig.fp8, backends/core/runtime/fp8.py: the transformer blocks' products in e4m3 with
per-tensor scales, the inputs' calibrated at load on the calibration data export writes) under the
compiled runtime, against the same runtime in fp16, in one process on one GPU. SDXL-base shapes,
random weights.

Reports each variant's replayed step (GPU time); its noise prediction on two batches (seeded
latents, timestep 500; a prompt's text through the model's encoders, and random N(0, 1) text)
against fp16's, beside fp16 eager's against fp16's (the error of an exact path: the floor), and
FP8's own products diagnosed one by one (clients/bench/fp8_diagnosis.py); and a whole
request (Euler, guidance 5, another prompt) through it: its denoised latents' error and its
image's PSNR against fp16's (the image says less: a random VAE saturates much of it). Variants:
`fp16`; `fp8` (attention's input projections, feed-forward and the blocks' projections);
`fp8-ff` (feed-forward only: its products are the largest); `fp8-fast` (`fp8` with cuBLAS's fast
accumulation).

The 2026-11-24b run's variants, since made the runtime's FP8 (results/2026-11-24b-h200, four
runs on H200s, each in one process): the bias in the product's epilogue took a step from 26.88 to
26.55 ms and from 27.10 to 26.70 (fast accumulation, attention's output projections in e4m3), and
with those projections in fp16 from 27.88 to 26.54; the projections in fp16 gave 26.39 against
26.55 ms with the bias in the epilogue (27.60 against 27.31 without), and moved the noise 2.8%
from fp16's instead of 3.1%.

fp16 runs compiled by default (`--fp16-kind graphs` skips the compile). Before the
engine's stream waited for its caller's (TorchDenoiser.on_stream), the probe's last noise
prediction and the engine's first step of the request ran concurrently on the same graphs' buffers:
every FP8 variant's noise then measured 127-131% away, while FP8's own error is 3.0-3.3%
(bench/results/2026-11-23i-h200/notes.md).

An earlier probe scaled each call's activations row by row: 36.2 against 32.5 ms, a
reduction pass per product that cost more than FP8 saved.

    python3 -m bench.micro.fp8_probe --work /tmp/easel-micro --out $OUT/fp8_probe.json
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from backends.core.runtime.config import FP8_PARTS
from clients.bench.common import (bench_parser, random_sdxl, random_sdxl_denoiser, random_sdxl_fp8_calibration, rel_rms,
                          start_logging, write_json)
from clients.bench.fp8_diagnosis import diagnose
from export.profile_template import gpu_ms

log = logging.getLogger("bench.micro.fp8_probe")
PROMPTS = ("a lighthouse on a cliff in a storm, dramatic clouds", "a bowl of ramen on a wooden table, top view")
VARIANTS = {"fp16": None, "fp8": FP8_PARTS, "fp8-ff": ("feed_forward",), "fp8-fast": FP8_PARTS}
FAST_ACCUM = {"fp8-fast"}


def noise(runtime, batch) -> torch.Tensor:
    """One step's noise prediction (both halves, no residuals), in fp32."""
    with torch.inference_mode():
        return runtime.decode(batch, runtime.encode(batch), None).float()


def compile_counters() -> dict:
    """Dynamo's and inductor's counters (frames compiled, FX graph and AOT cache hits and misses)."""
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items()}


def counters_since(before: dict) -> dict:
    return {group: {k: n - before.get(group, {}).get(k, 0) for k, n in values.items()
                    if n != before.get(group, {}).get(k, 0)}
            for group, values in compile_counters().items()}


def probe_batches(size: int, texts: dict) -> dict:
    """The probes' batches of two rows at timestep 500, on cuda:0: the same seeded latents with each
    of `texts` (name -> (text, pooled) from an encoder) and with random N(0, 1) text ("random_text":
    nothing an encoder makes, how FP8 fares far from its calibration). Drawn on the CPU, so every
    run and variant gets the same."""
    from backends.core.runtime.base import StepBatch

    g = torch.Generator().manual_seed(3)
    dev = torch.device("cuda:0")
    latent = size // 8
    sample = torch.randn(2, 4, latent, latent, generator=g).to(dev, torch.float16)
    random_text = (torch.randn(2, 77, 2048, generator=g).to(dev, torch.float16),
                   torch.randn(2, 1280, generator=g).to(dev, torch.float16))
    t = torch.full((2,), 500.0, device=dev)
    ids = torch.tensor([[size, size, 0, 0, size, size]] * 2, device=dev, dtype=torch.float16)
    return {name: StepBatch(sample, t, text, pooled, ids)
            for name, (text, pooled) in {**texts, "random_text": random_text}.items()}


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--variants", default="fp16,fp8,fp8-ff", help=f"from {list(VARIANTS)}; fp16 first")
    p.add_argument("--fp16-kind", choices=("compiled", "graphs"), default="compiled",
                   help="fp16's runtime: compiled (gives the step ratio) or graphs (no compile)")
    args = p.parse_args()
    start_logging()
    variants = args.variants.split(",")
    if variants[0] != "fp16" or set(variants) - set(VARIANTS):
        p.error(f"--variants: fp16 first, then any of {list(VARIANTS)}")

    from diffusers import StableDiffusionXLPipeline

    from backends.core.engine.builder import template_batch
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.placement import Placement
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.torch_fast import FastUNetRuntime
    from clients.bench.image_metrics import psnr
    from backends.core.stages.vae_decoding import LatentDecoder

    model, folder = random_sdxl(args.work), random_sdxl_denoiser(args.work)
    pipe = StableDiffusionXLPipeline.from_pretrained(model, dtype=torch.float16).to("cuda")
    calibration = random_sdxl_fp8_calibration(args.work, args.size, pipe)
    # The measured text comes from the model's own encoders too, for prompts that are not the
    # calibration's.
    with torch.no_grad():
        text, negative, pooled, negative_pooled = pipe.encode_prompt(list(PROMPTS), device="cuda")
    texts = [torch.cat([negative[i:i + 1], text[i:i + 1]]) for i in range(len(PROMPTS))]
    pooleds = [torch.cat([negative_pooled[i:i + 1], pooled[i:i + 1]]) for i in range(len(PROMPTS))]
    pipe = None
    where = Placement("cuda:0", "fp16")
    latent = args.size // 8
    vae = LatentDecoder(model, where, graphs=True, fused_kernels=True)

    def request(seed: int, steps: int, prompt: int):
        params = validate({"prompt": PROMPTS[prompt], "steps": steps, "width": args.size, "height": args.size,
                           "seed": seed, "scheduler": "euler"}, Limits(max_steps=1000))
        return DenoiseJob(f"r{seed}", params, texts[prompt].float().cpu().numpy(),
                          pooleds[prompt].float().cpu().numpy())

    def denoise(runtime, job):
        engine = TorchDenoiser(folder, where, runtime=runtime)
        with engine.on_stream(), torch.inference_mode():
            state = engine.start(job)
            while state.index < len(state.timesteps):
                engine.step([state])
        return engine.result(state)

    dev = torch.device("cuda:0")
    batches = probe_batches(args.size, {"encoder_text": (texts[0], pooleds[0])})
    batch = batches["encoder_text"]
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
              "steps": args.steps, "variants": {}}
    outputs = {}
    for name in variants:
        counted = compile_counters()
        eager = EagerUNetRuntime(*load_unet_halves(folder, where))
        start = time.perf_counter()
        kind = args.fp16_kind if name == "fp16" else "compiled"
        config = RuntimeConfig(kind=kind, row_buckets=(2,), fp8=VARIANTS[name] or (), fp8_fast_accum=name in FAST_ACCUM)
        runtime = FastUNetRuntime(eager, config, cache_root=args.work / "cache", fp8_calibration=calibration)
        entry = report["variants"][name] = {"kind": kind, "load_s": time.perf_counter() - start}
        if runtime.fp8_layers:
            layers = runtime.fp8_layers
            entry.update(fp8_linears=len(layers), input_amax={"min": min(float(x.x_amax) for x in layers),
                                                             "max": max(float(x.x_amax) for x in layers)})
        template = template_batch(eager.weights_module, dev, torch.float16)
        start = time.perf_counter()
        runtime.warmup(template, [(latent, latent)])
        entry["warmup_s"] = time.perf_counter() - start
        step = gpu_ms(lambda: runtime.decode(batch, runtime.encode(batch), None), args.iters)
        predicted = {which: noise(runtime, b) for which, b in batches.items()}
        latents = denoise(runtime, request(1, args.steps, 1))
        image = vae.decode(latents)
        entry.update(step_ms=statistics.median(step), step_ms_all=step, compile_counters=counters_since(counted))
        latents = torch.as_tensor(latents).float()
        outputs[name] = (predicted, image, latents)
        log.info("%s: step %.2f ms (replayed), warm-up %.0f s", name, entry["step_ms"], entry["warmup_s"])
        eager_noise = {which: noise(eager, b) for which, b in batches.items()}
        if name == "fp16":
            outputs["fp16_eager"] = eager_noise
            entry["eager_noise_rms_rel_error"] = {w: rel_rms(eager_noise[w], predicted[w]) for w in batches}
            log.info("fp16 eager against %s: noise error rms %s", kind, entry["eager_noise_rms_rel_error"])
        else:
            noise16, image16, latents16 = outputs["fp16"]
            # The same FP8 modules run eager: tells the quantization's error from the compiler's.
            entry["noise_rms_rel_error_of_fp8_eager"] = {w: rel_rms(eager_noise[w], noise16[w]) for w in batches}
            log.info("%s eager against fp16: noise error rms %s", name, entry["noise_rms_rel_error_of_fp8_eager"])
            # Where the eager FP8 error comes from, product by product, on each batch.
            entry["diagnosis"] = {w: diagnose(runtime.fp8_layers, eager.weights_module,
                                              lambda b=b: noise(eager, b), outputs["fp16_eager"][w])
                                  for w, b in batches.items()}
            entry.update(
                step_ratio_over_fp16=(entry["step_ms"] / report["variants"]["fp16"]["step_ms"]
                                      if args.fp16_kind == "compiled" else None),
                noise_max_rel_error={w: float((predicted[w] - noise16[w]).abs().max() / noise16[w].abs().max())
                                     for w in batches},
                noise_rms_rel_error={w: rel_rms(predicted[w], noise16[w]) for w in batches},
                # The denoised latents say more than the image: a random VAE saturates much of it.
                latents_rms_rel_error=rel_rms(latents, latents16),
                image_psnr_db=psnr(image, image16))
            log.info("%s / fp16 step: %s; noise error max %s rms %s; latents rms %.3g; image PSNR %.1f dB",
                     name, entry["step_ratio_over_fp16"], entry["noise_max_rel_error"], entry["noise_rms_rel_error"],
                     entry["latents_rms_rel_error"], entry["image_psnr_db"])
        runtime = eager = None  # before the next variant's UNet is loaded
        torch.cuda.empty_cache()
        write_json(args.out, report)  # after each variant: a later one may not finish


if __name__ == "__main__":
    main()
