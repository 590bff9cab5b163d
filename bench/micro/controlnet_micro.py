"""Decides how the ControlNet service runs its models: as CUDA graphs (of eager or compiled code),
given the control image or its embedding kept per request, with the UNet's fast rewrites or not.

One ControlNet call, eager against CUDA graphs and graphs of compiled code
(backends/core/adapters/controlnet_graphs.py), in process: an SDXL-size ControlNet with random fp16
weights at 1024 px, on one or two rows. `+kept`: given the image's embedding (`embed_image`, as the
service keeps it per session); `+fast`: the cache's `fast` models (channels_last, packed attention
projections). GPU time (CUDA events, median) and back-to-back wall time per call, the largest
difference from eager, and the seconds the first compiled call took. A ControlNet runs beside the
UNet's encoder half: at or under that half's time (`easel bench` reports it) it is off the step's
critical path.

    python3 -m bench.micro.controlnet_micro --work /tmp/easel-micro --out $OUT/controlnet_micro.json
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time

from clients.bench.common import bench_parser, random_sdxl, start_logging, write_controlnets, write_json
from export.cli import int_list
from bench.micro.runtime_micro import wall_ms_per_step
from export.profile_template import gpu_ms

log = logging.getLogger("bench.micro.controlnet_micro")
VARIANTS = ("graphs", "compiled", "compiled+kept", "compiled+kept+fast")


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=20)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rows", type=int_list("--rows", 1), default=[1, 2], help="call rows, e.g. 2 (default: 1,2)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"some of {','.join(VARIANTS)}")
    args = p.parse_args()
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: {', '.join(sorted(unknown))} not among {', '.join(VARIANTS)}")
    start_logging()

    import torch

    from backends.core.adapters.controlnet import ControlCall, embed_image, run_controlnet
    from backends.core.adapters.controlnet_cache import ControlNetCache
    from backends.core.adapters.controlnet_graphs import ControlNetGraphs
    from backends.core.adapters.store import AdapterStore
    from backends.core.runtime.compile_cache import use_compile_cache
    from backends.core.runtime.placement import Placement

    model_dir = random_sdxl(args.work)
    store_dir = args.work / "adapters"
    write_controlnets(model_dir, store_dir, ["canny"])
    where = Placement("cuda:0", "fp16")
    model = ControlNetCache(AdapterStore(store_dir), where, budget_bytes=2**40).acquire("canny")
    fast = ControlNetCache(AdapterStore(store_dir), where, budget_bytes=2**40, fast=True).acquire("canny")
    use_compile_cache(args.work / "compile_cache")
    compiled = ControlNetGraphs(compiled=True)
    every = {"graphs": (ControlNetGraphs(), model, False), "compiled": (compiled, model, False),
             "compiled+kept": (compiled, model, True), "compiled+kept+fast": (compiled, fast, True)}
    variants = {name: every[name] for name in args.variants.split(",")}
    latent = args.size // 8
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size, "rows": {}}
    g = torch.Generator("cuda").manual_seed(0)
    kw = dict(device="cuda", dtype=torch.float16)
    for rows in args.rows:
        call = ControlCall("canny", 0.8, torch.rand(rows, 3, args.size, args.size, generator=g, **kw),
                           torch.randn(rows, 4, latent, latent, generator=g, **kw), torch.full((rows,), 500.0, device="cuda"),
                           torch.randn(rows, 77, 2048, generator=g, **kw), torch.randn(rows, 1280, generator=g, **kw),
                           torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]], **kw).repeat(rows, 1))
        with torch.inference_mode():
            want = run_controlnet(model, call)
            entry = report["rows"][str(rows)] = {
                "eager_gpu_ms": statistics.median(gpu_ms(lambda: run_controlnet(model, call), args.iters)),
                "eager_wall_ms": wall_ms_per_step(lambda: run_controlnet(model, call), args.iters)}
            for name, (graphs, m, kept) in variants.items():
                given = dataclasses.replace(call, image=embed_image(m, call.image)) if kept else call
                start = time.perf_counter()
                got = graphs.run(m, given)
                entry[f"{name}_first_call_s"] = time.perf_counter() - start
                entry[f"{name}_max_rel_error"] = max(
                    float((a.float() - b.float()).abs().max() / b.float().abs().max())
                    for a, b in zip([*got[0], got[1]], [*want[0], want[1]]))
                entry[f"{name}_gpu_ms"] = statistics.median(gpu_ms(lambda: graphs.run(m, given), args.iters))
                entry[f"{name}_wall_ms"] = wall_ms_per_step(lambda: graphs.run(m, given), args.iters)
        log.info("%d row(s): %s", rows, {k: round(v, 4) for k, v in entry.items()})
    write_json(args.out, report)


if __name__ == "__main__":
    main()
