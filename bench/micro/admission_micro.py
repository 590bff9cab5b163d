"""Decides whether a request's admission (noise, sampler, copies) runs on the loop's thread beside running requests.

A request's admission on the denoise loop's thread, in one process (no Triton): what
`TorchDenoiser.start` costs and where its time goes (cProfile), and the queue before a request's
first step through the real DenoiseLoop. In the server the same figures are `admit_s` and
`queue_s` of a response's info; this tells whether their size there is the work itself or the
stub around it.

    python3 -m bench.micro.admission_micro --work /tmp/am --out $OUT/admission_micro.json
    python3 -m bench.micro.admission_micro --work /tmp/am --out /tmp/am.json --cpu --size 256  # tiny model
"""

from __future__ import annotations

import cProfile
import logging
import pstats
import statistics
import threading
import time
from pathlib import Path

from clients.bench.common import bench_parser, random_sdxl_denoiser, start_logging, tiny, write_json

log = logging.getLogger("bench.micro.admission_micro")


def _top(profiler: cProfile.Profile, calls: int, lines: int = 25) -> str:
    """The functions with the most cumulative time, in microseconds per start (pstats prints
    seconds to three decimals, too coarse for a start of a millisecond)."""
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda kv: -kv[1][3])[:lines]
    return "\n".join(f"{1e6 * cumulative / calls:9.1f} us {1e6 * own / calls:9.1f} us own  {n:5d}  "
                     f"{Path(where).name}:{line}({name})"
                     for (where, line, name), (_, n, own, cumulative, _) in rows)


def _times(fn, runs: int) -> list[float]:
    """Wall seconds of `runs` calls of `fn`, after one untimed call."""
    fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def _profiled(profiler: cProfile.Profile, fn):
    """`fn` profiled on whichever thread calls it (cProfile only sees the thread that enables it),
    and nothing around it."""
    def call(*args):
        profiler.enable()
        try:
            return fn(*args)
        finally:
            profiler.disable()
    return call


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--loop-runs", type=int, default=10, help="requests of 2 steps through the loop")
    p.add_argument("--cpu", action="store_true", help="the tiny model on CPU")
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.engine import noise
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from backends.core.engine.loop import DenoiseLoop
    from backends.core.engine.step_batcher import BatcherConfig
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.placement import Placement

    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        from export.repository import ExportOptions, export_repository

        repo = args.work / "repo-cpu"
        if not (repo / "denoiser").exists():
            export_repository(tiny(args.work), repo, ExportOptions(device="cpu", max_size=max(args.size, 256)))
        folder, placement = repo / "denoiser" / "1", Placement()
    else:
        folder, placement = random_sdxl_denoiser(args.work), Placement(device="cuda:0", dtype="fp16")
    engine = TorchDenoiser(folder, placement)
    cfg = engine.unet.config
    pooled_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
    embeds = torch.randn(2, 77, cfg.cross_attention_dim).half().numpy()
    pooled = torch.randn(2, pooled_dim).half().numpy()

    def job(rid: str, steps: int, seed: int) -> DenoiseJob:
        params = validate({"prompt": "a yellow car", "steps": steps, "width": args.size, "height": args.size,
                           "seed": seed, "guidance_scale": 5.0}, Limits())
        return DenoiseJob(request_id=rid, params=params, prompt_embeds=embeds, pooled_embeds=pooled)

    recipe = noise.choose(placement.torch_dtype)
    latent = (1, cfg.in_channels, args.size // engine.workflows["txt2img"].model.vae_scale_factor, args.size // engine.workflows["txt2img"].model.vae_scale_factor)
    generator = torch.Generator("cpu").manual_seed(0)
    draws = {"torch_randn": _times(lambda: torch.randn(latent, generator=generator, dtype=placement.torch_dtype),
                                   args.runs),
             "cpu_randn": _times(lambda: noise.cpu_randn(latent, generator, placement.torch_dtype), args.runs)}

    sync = torch.cuda.synchronize if not args.cpu else (lambda: None)
    jobs = iter([job(f"s{i}", args.steps, i) for i in range(2 * args.runs + 1)])
    starts = []  # start() alone, of the same calls as synced_s (the first is the warm-up's)

    def start_then_sync():
        began = time.perf_counter()
        engine.start(next(jobs))
        starts.append(time.perf_counter() - began)
        sync()

    profiler = cProfile.Profile()
    with engine.on_stream():
        synced_s = _times(start_then_sync, args.runs)
        start_s = starts[1:]
        profiled_start = _profiled(profiler, engine.start)
        for _ in range(args.runs):
            profiled_start(next(jobs))
        sync()
    text = _top(profiler, args.runs)

    def through_loop(first: int, count: int, profiler: cProfile.Profile | None = None) -> list:
        """`count` requests of 2 steps through a DenoiseLoop, one at a time; with `profiler`, each
        start() as the loop thread runs it."""
        done, results = threading.Event(), []
        direct = engine.start
        if profiler is not None:
            engine.start = _profiled(profiler, direct)
        loop = DenoiseLoop(engine, lambda r: (results.append(r), done.set()),
                           BatcherConfig(max_running=1, max_batch_rows=2))
        loop.start()
        try:
            for i in range(first, first + count):
                done.clear()
                loop.submit(job(f"l{i}", 2, i))
                done.wait(600)
        finally:
            loop.shutdown()
            engine.start = direct
        return results

    through_loop(0, 1)  # warms the eager UNet and the (sampler, 2 steps) prototype up
    measured = through_loop(1, args.loop_runs)
    in_loop = cProfile.Profile()  # separately: profiling slows what it profiles
    through_loop(1 + args.loop_runs, args.loop_runs, in_loop)
    loop_text = _top(in_loop, args.loop_runs)

    def summary(values: list[float]) -> dict:
        return {"median_ms": 1e3 * statistics.median(values), "min_ms": 1e3 * min(values),
                "max_ms": 1e3 * max(values)}

    report = {"device": "cpu" if args.cpu else torch.cuda.get_device_name(0), "torch": torch.__version__,
              "size": args.size, "steps": args.steps, "runs": args.runs,
              "noise_recipe": recipe, "noise_shape": latent,
              "noise_torch_randn": summary(draws["torch_randn"]), "noise_cpu_randn": summary(draws["cpu_randn"]),
              "start": summary(start_s), "start_then_synchronize": summary(synced_s),
              "loop_queue": summary([r.queue_s for r in measured]),
              "loop_admit": summary([r.admit_s for r in measured]),
              "loop_queue_less_admit": summary([r.queue_s - r.admit_s for r in measured]),
              "cprofile_cumulative": text, "cprofile_in_loop_cumulative": loop_text}
    log.info("seeded noise recipe: %s", recipe)
    for key in ("noise_torch_randn", "noise_cpu_randn", "start", "start_then_synchronize", "loop_queue", "loop_admit",
                "loop_queue_less_admit"):
        log.info("%-24s median %.3f ms (%.3f-%.3f)", key, report[key]["median_ms"], report[key]["min_ms"],
                 report[key]["max_ms"])
    log.info("cProfile of %d starts, by cumulative time:\n%s", args.runs, text)
    log.info("cProfile of the loop's %d starts:\n%s", args.loop_runs, loop_text)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
