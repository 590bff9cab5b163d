"""Decides whether LoRAs load in processes of their own, and at which priority.

How much LoRA loads slow the denoiser's step loop while they run beside it: a request without
LoRAs, alone and with files loading in the loader processes (for another request), alternated.
For each request: the mean step time over its first --window steps (where the loads run) less
the mean over its steps after 2 x --window (the same request's own pace); the interference is
the median of that excess with loads less its median alone.

    python3 bench/micro/lora_interference.py --work /tmp/easel-lora --out $OUT/lora_interference.json
    python3 bench/micro/lora_interference.py --cpu-smoke --work /tmp/li-smoke --out /tmp/li-smoke.json  # tiny, CPU

In process, wired as the denoiser backend wires it (TorchDenoiser, DenoiseLoop, LoraLoaderPool),
without Triton, so the figure is the loop's own. The server's account of a LoRA's critical path
(`bench/micro/lora_sdxl.py`: time held at the bound + merge) leaves this part out. The files are the
LoRAs of `bench/micro/lora_sdxl.py`, page cache dropped before each request.
"""

from __future__ import annotations

import json
import logging
import queue
import statistics
import time

import numpy as np

from clients.bench.common import bench_parser, random_sdxl, start_logging, tiny
from bench.micro.lora_sdxl import drop_cache, write_loras

log = logging.getLogger("bench.micro.lora_interference")


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--reps", type=int, default=10, help="alternations of alone / with loads")
    p.add_argument("--window", type=int, default=10, help="steps the loads are expected to span")
    p.add_argument("--lora-mib", type=float, nargs="+", default=[340.0, 460.0], help="files loading at once")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny pipeline on CPU, 64 px, 30 steps, 2 reps")
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from backends.core.engine.loop import DenoiseLoop
    from backends.core.adapters.lora_loader import LoraLoaderPool
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.placement import Placement
    from export.repository import ExportOptions, export_repository

    if args.cpu_smoke:
        args.size, args.steps, args.reps, args.window, args.lora_mib = 64, 30, 2, 5, [0.25, 0.4]
        device, dtype = "cpu", "fp32"
        model = tiny(args.work)
    else:
        device, dtype = "cuda", "fp16"
        model = random_sdxl(args.work)
    loras = write_loras(args.work / "adapters", model / "unet", args.lora_mib, 1e-3, device)
    repo = args.work / f"repo-interference-{device}"
    gpu = device == "cuda"
    if not repo.exists():
        export_repository(model, repo, ExportOptions(device="cuda", dtype="fp16", gpus=(0,), max_size=args.size)
                          if gpu else ExportOptions())
    folder = repo / ("denoiser_gpu0" if gpu else "denoiser") / "1"

    class StepTimedDenoiser(TorchDenoiser):
        """Notes when each step has finished (on a GPU the loop waits for every step anyway:
        the scheduler's step compares a device sigma with Python floats)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.ends: list[float] = []

        def step(self, states):
            failed = super().step(states)
            if gpu:
                torch.cuda.synchronize()
            self.ends.append(time.perf_counter())
            return failed

    engine = StepTimedDenoiser(folder, Placement("cuda:0" if gpu else "cpu", dtype))
    done: queue.Queue = queue.Queue()
    loop = DenoiseLoop(engine, done.put)
    loop.start()
    pool = LoraLoaderPool(2, device="cuda:0" if gpu else "cpu")
    pool.wait_started(300)
    params = validate({"prompt": "x", "seed": 1, "steps": args.steps, "width": args.size, "height": args.size},
                      Limits())
    # Random text embeddings of the UNet's widths: the text encoder is not what is measured.
    config, rng = engine.unet.config, np.random.default_rng(0)
    embeds = rng.standard_normal((2, 77, config.cross_attention_dim)).astype(np.float32)
    pooled_width = config.projection_class_embeddings_input_dim - 6 * config.addition_time_embed_dim
    pooled = rng.standard_normal((2, pooled_width)).astype(np.float32)
    files = [(x["name"], x["path"], 1.0) for x in loras]

    def one(label: str, load: bool) -> dict:
        engine.ends.clear()
        drop_cache([x["path"] for x in loras])
        start = time.perf_counter()
        future, loaded = (pool.submit(files) if load else None), []
        if future is not None:
            future.add_done_callback(lambda _: loaded.append(time.perf_counter() - start))
        loop.submit(DenoiseJob(label, params, embeds, pooled))
        result = done.get(timeout=600)
        if future is not None:
            future.result(timeout=600)
        if result.error:
            raise RuntimeError(result.error)
        steps = [1000 * (b - a) for a, b in zip(engine.ends, engine.ends[1:])]
        window, after = statistics.mean(steps[:args.window]), statistics.mean(steps[2 * args.window:])
        row = {"with_loads": load, "denoise_s": result.denoise_s, "window_ms": window, "after_ms": after,
               "excess_ms": window - after, "loads_done_s": loaded[0] if loaded else None}
        log.info("%-10s denoise %.3fs  steps 1-%d %.1f ms, after %d %.1f ms, excess %+.1f ms%s", label,
                 result.denoise_s, args.window, window, 2 * args.window, after, window - after,
                 f"  (loads done after {loaded[0]:.3f}s)" if loaded else "")
        return row

    one("warm", False)
    one("warm", True)
    rows = []
    for rep in range(args.reps):  # alternated: the host's drift falls on both alike
        rows.append(one(f"alone {rep}", False))
        rows.append(one(f"loads {rep}", True))
    pool.shutdown()
    loop.shutdown()

    med = statistics.median
    alone = [r for r in rows if not r["with_loads"]]
    loaded = [r for r in rows if r["with_loads"]]
    alone_excess, loads_excess = med(r["excess_ms"] for r in alone), med(r["excess_ms"] for r in loaded)
    excess = loads_excess - alone_excess
    summary = {"alone_excess_ms": alone_excess, "loads_excess_ms": loads_excess,
               "interference_ms_per_step": excess, "interference_s": excess * args.window / 1000,
               "step_ms_alone": med(r["after_ms"] for r in alone),
               "denoise_s": {"alone": med(r["denoise_s"] for r in alone), "loads": med(r["denoise_s"] for r in loaded)}}
    log.info("loads of %s beside the loop: %+.1f ms per step over %d steps (%+.3f s; a step alone %.1f ms)",
             [x["name"] for x in loras], excess, args.window, summary["interference_s"], summary["step_ms_alone"])
    args.out.write_text(json.dumps({"device": device, "dtype": dtype, "size": args.size, "steps": args.steps,
                                    "window": args.window, "loras": loras, "rows": rows, "summary": summary},
                                   indent=2))


if __name__ == "__main__":
    main()
