"""Decides whether template recordings can stay in host memory and be loaded block by block beside
a step's compute (InstGenIE's Algorithm 1, backends/core/runtime/cache_plan.py), and how many blocks
would then take the cache.

For every transformer block of the UNet, in the order a step runs them: its time on every token
(without cache) and on a centered mask's tokens with the rest from a recording (with cache,
runtime/token_subsets.py), at each mask ratio; and the time to copy its recorded output for one
step from pinned host memory to the device (the load). Then the plan per mask ratio: the blocks
that take the cache, the blocks' predicted time against computing them all whole and against the
recording already on the device (no loads), and the same with the loads issued a step ahead (a
recording streamed from host memory, engine/template_stream.py). GPU times are CUDA events (median of --iters); on the
CPU, clock times of the tiny model (no loads: the recording is where the compute is).
The measurement is `easel profile-template`'s (export/profile_template.py), which writes it into a
repository's denoisers.

    python3 -m bench.micro.template_blocks --work /tmp/easel-tb --out tb.json                 # tiny, CPU
    python3 -m bench.micro.template_blocks --work /tmp/x --model M --device cuda --size 1024
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

from clients.bench.common import bench_parser, start_logging, tiny, write_json
from export.profile_template import RATIOS

log = logging.getLogger("bench.micro.template_blocks")


def main() -> None:
    p = bench_parser(__doc__, size=64, steps=1)
    p.add_argument("--model", type=Path, help="diffusers SDXL folder (default: write a tiny one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=2, help="UNet rows (2: one guided request)")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    start_logging()

    import numpy as np
    import torch
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.cache_plan import BlockCost, plan_cache_use
    from export.profile_template import measure_blocks

    cuda = args.device != "cpu"
    dtype = torch.float16 if cuda else torch.float32
    model = args.model or tiny(args.work)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", torch_dtype=dtype).to(args.device).eval()
    rows_out = measure_blocks(unet, args.size, args.rows, args.iters)

    plans = {}
    for ratio in RATIOS:
        costs = [BlockCost(e["with_ms"][str(ratio)], e["without_ms"], e["load_ms"]) for e in rows_out]
        plan = plan_cache_use(costs)
        on_device = plan_cache_use([dataclasses.replace(c, load_s=0.0) for c in costs])
        ahead = plan_cache_use(costs, lead_s=on_device.latency_s)  # streamed: loads issued a step ahead
        whole = sum(c.without_cache_s for c in costs)
        plans[str(ratio)] = {"use": list(plan.use), "blocks_cached": plan.used, "blocks": len(costs),
                             "planned_ms": plan.latency_s, "whole_ms": whole, "resident_ms": on_device.latency_s,
                             "loads_ms": plan.loaded_s, "ahead_use": list(ahead.use),
                             "ahead_blocks_cached": ahead.used, "ahead_planned_ms": ahead.latency_s}
        log.info("mask %.2f: %d of %d blocks from the cache; blocks %.2f ms planned, %.2f whole, %.2f with the "
                 "recording on the device (loads %.2f ms); loaded a step ahead: %d blocks, %.2f ms", ratio,
                 plan.used, len(costs), plan.latency_s, whole, on_device.latency_s, plan.loaded_s, ahead.used,
                 ahead.latency_s)
    bytes_per_step = sum(e["record_bytes"] for e in rows_out)
    log.info("a step's recording: %.1f MB for %d rows", bytes_per_step / 1e6, args.rows)
    write_json(args.out, {"model": str(model), "device": args.device, "size": args.size, "rows": args.rows,
                          "dtype": str(dtype), "iters": args.iters, "blocks": rows_out, "plans": plans,
                          "record_bytes_per_step": bytes_per_step,
                          "gpu": torch.cuda.get_device_name(args.device) if cuda else None,
                          "mask_ratios": list(RATIOS), "numpy": np.__version__})


if __name__ == "__main__":
    main()
