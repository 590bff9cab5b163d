"""The diffusers side of `easel bench`: what a user runs instead of Easel, on the same weights,
dtype, size, steps, seeds and scheduler. StableDiffusionXLPipeline eager, then with
`torch.compile(unet, mode="reduce-overhead")`: latency over the runs, throughput as one call
batching c prompts, the seed-0 image for the fidelity comparison."""

from __future__ import annotations

import io
import logging
import os
import shutil
import time
from pathlib import Path

from clients.bench.report import GUIDANCE, LABELS, image_path
from clients.bench.models import (LORA_SCALE, PROMPT, SERVER_CACHE_ENV, WARMUP_STEPS, Setup, control_images, free_gpu,
                               now)

log = logging.getLogger("easel.bench")


def diffusers_pipeline(setup: Setup, prep: dict, fuse_loras: bool = True):
    """What a diffusers user runs: the pipeline (with its ControlNets) on the device; with
    `fuse_loras`, the LoRAs loaded, weighted, fused into the weights and unloaded once, before any
    timing (else per call: fuse_from_disk)."""
    import torch
    from diffusers import (ControlNetModel, EulerDiscreteScheduler, MultiControlNetModel,
                           StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline)
    from PIL import Image

    torch_dtype = torch.float16 if setup.dtype == "fp16" else torch.float32
    pipe = StableDiffusionXLPipeline.from_pretrained(prep["model"], dtype=torch_dtype, add_watermarker=False)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)  # the request's `euler`
    extra = {}
    if prep["controlnets"]:
        nets = [ControlNetModel.from_pretrained(prep["store"] / "controlnets" / n, dtype=torch_dtype)
                for n in prep["controlnets"]]
        pipe = StableDiffusionXLControlNetPipeline(**pipe.components, controlnet=nets[0] if len(nets) == 1
                                                   else MultiControlNetModel(nets), add_watermarker=False)
        pictures = [Image.open(io.BytesIO(png)) for png in control_images(setup, len(nets))]
        extra["image"] = pictures[0] if len(nets) == 1 else pictures
    pipe = pipe.to(setup.torch_device)
    pipe.set_progress_bar_config(disable=True)
    if prep["loras"] and fuse_loras:
        fuse(pipe, prep["loras"])
        pipe.unload_lora_weights()
    return pipe, extra


def fuse(pipe, loras: list[dict]) -> None:
    names = [x["name"] for x in loras]
    for lora in loras:
        pipe.load_lora_weights(lora["path"], adapter_name=lora["name"])
    pipe.set_adapters(names, adapter_weights=[LORA_SCALE] * len(names))
    pipe.fuse_lora(adapter_names=names)


def fuse_from_disk(pipe, loras: list[dict]) -> None:
    """A request's LoRAs as a diffusers user serves many: read from disk (page cache dropped
    first, as for one of thousands of files) and fused."""
    from clients.bench.adapters import drop_cache

    drop_cache([x["path"] for x in loras])
    fuse(pipe, loras)


def measure_diffusers(setup: Setup, prep: dict, images: Path, rec: dict, save, compiled: bool) -> None:
    import torch

    system = "diffusers_compiled" if compiled else "diffusers_eager"

    def sync():
        if setup.device == "cuda":
            torch.cuda.synchronize(setup.torch_device)

    # Eager: a request's LoRAs are loaded and fused per call, inside its time (KATZ's serial
    # baseline). Compiled: once before timing, as fusing into a compiled UNet would recompile it.
    per_call = [] if compiled else prep["loras"]

    def call(count: int, steps: int, seeds: list[int]):
        if per_call:
            fuse_from_disk(pipe, per_call)
        return pipe([PROMPT] * count, width=setup.size, height=setup.size, num_inference_steps=steps,
                    guidance_scale=GUIDANCE, generator=[torch.Generator("cpu").manual_seed(s) for s in seeds],
                    **extra).images

    def timed(fn) -> float:
        sync()
        start = time.perf_counter()
        fn()
        sync()
        seconds = time.perf_counter() - start
        if per_call:  # after the clock: a server takes them out after answering
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
        return seconds

    rec.update(date=now(), dtype=setup.dtype, device=setup.torch_device, scheduler="EulerDiscreteScheduler",
               lora=(("loaded, set_adapters, fused and unloaded once before timing" if compiled else
                      "read from disk (page cache dropped), set_adapters and fused per call, inside its time; "
                      "unfused and unloaded after it, outside") if prep["loras"] else None))
    start = time.perf_counter()
    pipe, extra = diffusers_pipeline(setup, prep, fuse_loras=compiled)
    rec["load_s"] = time.perf_counter() - start
    original = saved_env = None
    try:
        if compiled:
            # empty: the compile is cold, as Easel's first start is
            inductor_cache = setup.work / "diffusers-inductor-cache"
            shutil.rmtree(inductor_cache, ignore_errors=True)
            saved_env = {k: os.environ.get(k) for k in SERVER_CACHE_ENV}
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_cache)
            os.environ["TRITON_CACHE_DIR"] = str(inductor_cache / "triton")
            rec["inductor_cache"] = str(inductor_cache)
            original = pipe.unet
            rec["compile_errors"] = []
            for mode in ("reduce-overhead", "default"):
                pipe.unet = torch.compile(original, mode=None if mode == "default" else mode)
                try:
                    rec["compile_s"] = timed(lambda: call(1, WARMUP_STEPS, [0]))
                    rec["mode"] = mode
                    break
                except Exception as exc:
                    log.warning("torch.compile mode %s failed: %s", mode, exc)
                    rec["compile_errors"].append({"mode": mode, "error": f"{type(exc).__name__}: {exc}"[:4000]})
                    pipe.unet = original
                    torch._dynamo.reset()
                    free_gpu(setup)
            else:
                raise RuntimeError("torch.compile failed in every mode: " + "; ".join(
                    e["error"].splitlines()[0] for e in rec["compile_errors"]))
            log.info("diffusers compiled (%s): compile + first call %.1fs", rec["mode"], rec["compile_s"])
        else:
            rec["warmup_s"] = timed(lambda: call(1, WARMUP_STEPS, [0]))
        save()

        rec["latency_s"] = []
        for seed in range(setup.runs):
            box = {}
            rec["latency_s"].append(timed(lambda: box.update(images=call(1, setup.steps, [seed]))))
            if seed == 0:
                # PIL images are diffusers' numpy_to_pil of the output: (x * 255).round().astype(uint8)
                box["images"][0].save(image_path(images, setup.name, system))
            log.info("%s seed %d: %.3fs", LABELS[system], seed, rec["latency_s"][-1])
        save()

        rec["throughput"] = {}
        for c in setup.concurrency:
            warmup = timed(lambda: call(c, WARMUP_STEPS, list(range(c))))
            wall = timed(lambda: call(c, setup.throughput_steps, [1000 + i for i in range(c)]))
            rec["throughput"][str(c)] = {"batch": c, "steps": setup.throughput_steps, "images": c, "wall_s": wall,
                                         "img_s": c / wall, "warmup_s": warmup}
            log.info("%s batch %d: %.3f images/s (%.2fs; warm-up %.1fs)", LABELS[system], c, c / wall, wall, warmup)
            save()
        if setup.device == "cuda":
            rec["max_memory_allocated_bytes"] = torch.cuda.max_memory_allocated(setup.torch_device)
    finally:
        del pipe, extra, original  # every reference to the weights, before emptying the cache
        if saved_env is not None:
            torch._dynamo.reset()  # and the CUDA-graph trees, which hold their memory pool
            for key, value in saved_env.items():  # as they were
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
        free_gpu(setup)
        if setup.device == "cuda":
            torch.cuda.reset_peak_memory_stats(setup.torch_device)
