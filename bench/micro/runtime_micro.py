"""Decides which UNet runtime (eager, graphs, compiled) is the default.

Where a denoising step's time goes, per UNet runtime, in process (no server): SDXL-base shapes
with random fp16 weights on one GPU.

For each runtime (eager, graphs, compiled) and row count: the encoder half, the decoder half and
both, as GPU time (CUDA events, medians). Then a whole engine step (TorchDenoiser.step: vectorized
sampler, guidance, batch assembly, the runtime) against the runtime's halves alone: the
difference is the step's orchestration (everything in a step that is not a UNet kernel), and a
profile of one step is written beside the JSON.

    python3 bench/micro/runtime_micro.py --work /tmp/easel-micro --out $OUT/runtime_micro.json
"""

from __future__ import annotations

import json
import logging
import statistics
import time

from clients.bench.common import bench_parser, random_sdxl_denoiser, start_logging
from export.profile_template import gpu_ms

log = logging.getLogger("bench.micro.runtime_micro")


def wall_ms_per_step(fn, steps: int) -> float:
    """Wall time of `steps` calls issued back to back, one sync at the end: what a step loop sees."""
    import torch

    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1000 / steps


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=20)
    p.add_argument("--rows", default="2,4,8", help="UNet row counts (2 = one request with guidance)")
    p.add_argument("--kinds", default="eager,graphs,compiled",
                   help="runtimes, each optionally with +cl (channels_last) and/or +fused (plugins' kernels), "
                        "e.g. graphs,graphs+cl,graphs+fused")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.engine.builder import template_batch
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.base import StepBatch
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.placement import Placement
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.torch_fast import FastUNetRuntime

    rows_list = [int(r) for r in args.rows.split(",")]
    kinds = args.kinds.split(",")
    folder = random_sdxl_denoiser(args.work)
    where = Placement("cuda:0", "fp16")
    latent = args.size // 8
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size,
              "rows": rows_list, "runtimes": {}}

    def batch_of(unet, rows):
        t = template_batch(unet, torch.device("cuda:0"), torch.float16)
        g = torch.Generator("cuda").manual_seed(0)
        return StepBatch(torch.randn(rows, t.sample.shape[1], latent, latent, device="cuda", dtype=torch.float16,
                                     generator=g),
                         torch.full((rows,), 500.0, device="cuda"), t.text.repeat(rows, 1, 1).normal_(generator=g),
                         t.pooled.repeat(rows, 1).normal_(generator=g), t.time_ids.repeat(rows, 1))

    references = {}  # rows -> the first runtime's noise prediction
    for name in kinds:
        kind, *options = name.split("+")
        # Each variant on freshly loaded weights: channels_last and the fused kernels change the modules.
        eager = EagerUNetRuntime(*load_unet_halves(folder, where))
        if kind == "eager":
            runtime = eager
        else:
            buckets = tuple(rows_list) if kind == "graphs" else (rows_list[0],)
            runtime = FastUNetRuntime(eager, RuntimeConfig(kind=kind, row_buckets=buckets,
                                                           channels_last="cl" in options,
                                                           fused_kernels="fused" in options),
                                      cache_root=args.work / "cache")
            start = time.perf_counter()
            runtime.warmup(template_batch(eager.weights_module, torch.device("cuda:0"), torch.float16),
                           [(latent, latent)])
            log.info("%s: warm-up (capture%s) %.1f s", name, " + compile" if kind == "compiled" else "",
                     time.perf_counter() - start)
        entry = report["runtimes"][name] = {"warmup_s": getattr(getattr(runtime, "stats", None), "warmup_s", 0.0)}
        for rows in rows_list if kind != "compiled" else rows_list[:1]:
            b = batch_of(eager.weights_module, rows)
            with torch.inference_mode():
                enc = runtime.encode(b)
                both = gpu_ms(lambda: runtime.decode(b, runtime.encode(b), None), args.iters)
                encode = gpu_ms(lambda: runtime.encode(b), args.iters)
                decode = gpu_ms(lambda: runtime.decode(b, enc, None), args.iters)
                wall = wall_ms_per_step(lambda: runtime.decode(b, runtime.encode(b), None), args.iters)
                noise = runtime.decode(b, runtime.encode(b), None).float()
            # How far this runtime's noise prediction lands from the first runtime's, same inputs.
            reference = references.setdefault(rows, noise)
            error = float((noise - reference).abs().max() / reference.abs().max())
            entry[str(rows)] = {"unet_ms": statistics.median(both), "encoder_ms": statistics.median(encode),
                                "max_rel_error_vs_first": error,
                                "decoder_ms": statistics.median(decode), "unet_wall_ms": wall,
                                "unet_ms_all": both}
            log.info("%s rows %d: unet %.1f ms (encoder %.1f, decoder %.1f), back-to-back wall %.1f ms, "
                     "max error vs %s %.2g", name, rows,
                     *(entry[str(rows)][k] for k in ("unet_ms", "encoder_ms", "decoder_ms", "unet_wall_ms")),
                     kinds[0], error)

        # A whole engine step (one request with guidance = 2 rows) against the halves alone.
        engine = TorchDenoiser(folder, where, runtime=runtime)
        params = validate({"prompt": "x", "steps": 1000, "width": args.size, "height": args.size, "seed": 1,
                           "scheduler": "euler"}, Limits(max_steps=1000))
        embeds = torch.randn(2, 77, eager.weights_module.config.cross_attention_dim).numpy()
        pooled = torch.randn(2, 1280).numpy()
        state = engine.start(DenoiseJob("r", params, embeds, pooled))
        with engine.on_stream(), torch.inference_mode():
            step_wall = wall_ms_per_step(lambda: engine.step([state]), args.steps)
            b2 = batch_of(eager.weights_module, 2)
            unet_wall = wall_ms_per_step(lambda: runtime.decode(b2, runtime.encode(b2), None), args.steps)
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    engine.step([state])
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        (args.out.parent / f"step_profile_{name.replace('+', '_')}.txt").write_text(table)
        entry["engine_step_wall_ms"] = step_wall
        entry["unet_only_wall_ms"] = unet_wall
        entry["orchestration_fraction"] = max(0.0, (step_wall - unet_wall) / step_wall)
        log.info("%s: engine step %.1f ms wall, UNet halves alone %.1f ms: orchestration %.1f%% of a step", name,
                 step_wall, unet_wall, 100 * entry["orchestration_fraction"])
        del engine, state, runtime, eager
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(report, indent=2))  # after each runtime: a later one may not finish
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
