"""Decides whether template recordings can stay in host memory and be loaded block by block beside
a step's compute (InstGenIE's Algorithm 1, backends/core/runtime/cache_plan.py), and how many blocks
would then take the cache.

For every transformer block of the UNet, in the order a step runs them: its time on every token
(without cache) and on a centered mask's tokens with the rest from a recording (with cache,
runtime/token_subsets.py), at each mask ratio; and the time to copy its recorded output for one
step from pinned host memory to the device (the load). Then the plan per mask ratio: the blocks
that take the cache, the blocks' predicted time against computing them all whole and against the
recording already on the device (no loads). GPU times are CUDA events (median of --iters); on the
CPU, clock times of the tiny model (no loads: the recording is where the compute is).
`--write-profile` puts the times (per row) where a denoiser reads them (runtime/cache_plan.py).

    python3 -m bench.micro.template_blocks --work /tmp/easel-tb --out tb.json                 # tiny, CPU
    python3 -m bench.micro.template_blocks --work /tmp/x --model M --device cuda --size 1024
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

from clients.bench.common import bench_parser, start_logging, tiny, write_json
from clients.bench.edits import RATIOS, centered_mask

log = logging.getLogger("bench.micro.template_blocks")


def ordered_blocks(unet) -> list[tuple[object, int]]:
    """(transformer block, its level) in the order a step runs them: down, mid, up."""
    from diffusers.models.attention import BasicTransformerBlock

    levels = len(unet.down_blocks)
    parts = [(b, i) for i, b in enumerate(unet.down_blocks)] + [(unet.mid_block, levels - 1)] + \
        [(b, levels - 1 - i) for i, b in enumerate(unet.up_blocks)]
    return [(m, level) for part, level in parts for m in part.modules() if isinstance(m, BasicTransformerBlock)]


def main() -> None:
    p = bench_parser(__doc__, size=64, steps=1)
    p.add_argument("--model", type=Path, help="diffusers SDXL folder (default: write a tiny one)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=2, help="UNet rows (2: one guided request)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--write-profile", type=Path, metavar="FOLDER",
                   help="also write the times as a denoiser's template_blocks.json into FOLDER (<repo>/<denoiser>/1): "
                        "its reusing edits at --size then take only the blocks where that pays")
    args = p.parse_args()
    start_logging()

    import numpy as np
    import torch
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention import BasicTransformerBlock

    from backends.core.runtime.cache_plan import BlockCost, BlockProfile, ProfiledBlock, plan_cache_use
    from backends.core.runtime.token_subsets import (REUSE, TemplateActivations, TokenRow, _masked, computed_tokens,
                                                     install)
    from bench.micro.runtime_micro import gpu_ms

    cuda = args.device != "cpu"
    dtype = torch.float16 if cuda else torch.float32
    model = args.model or tiny(args.work)
    unet = UNet2DConditionModel.from_pretrained(model, subfolder="unet", torch_dtype=dtype).to(args.device).eval()
    install(unet)
    blocks = ordered_blocks(unet)
    latent = args.size // 8
    g = torch.Generator(args.device).manual_seed(0)
    text = torch.randn(args.rows, 77, unet.config.cross_attention_dim, generator=g, device=args.device, dtype=dtype)

    def timed_ms(fn) -> float:
        if cuda:
            return statistics.median(gpu_ms(fn, args.iters))
        fn()
        times = []
        for _ in range(args.iters):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    stream = torch.cuda.Stream(args.device) if cuda else None
    rows_out = []
    with torch.inference_mode():
        for block, level in blocks:
            side = latent >> level
            tokens, width = side * side, block.norm1.normalized_shape[0]
            x = torch.randn(args.rows, tokens, width, generator=g, device=args.device, dtype=dtype)
            record = TemplateActivations(args.rows)
            for r in range(args.rows):
                record.put(0, block._subset_index, r, x[r])
            whole = timed_ms(lambda: BasicTransformerBlock.forward(block, x, encoder_hidden_states=text))
            entry = {"index": block._subset_index, "level": level, "tokens": tokens, "width": width,
                     "without_ms": whole, "with_ms": {}, "record_bytes": record.nbytes}
            for ratio in RATIOS:
                mask = torch.from_numpy(centered_mask(latent, ratio) / 255.0).to(args.device)[None, None]
                computed = computed_tokens(mask, len(unet.config.block_out_channels))
                layout = [TokenRow(REUSE, record, 0, r, computed) for r in range(args.rows)]
                entry["with_ms"][str(ratio)] = timed_ms(lambda: _masked(block, layout, x, text))
            if cuda:  # one step's recorded output of the block, pinned host -> device on a load stream
                host = record.get(0, block._subset_index, 0).new_empty((args.rows, tokens, width),
                                                                       device="cpu").pin_memory()
                target = torch.empty_like(host, device=args.device)

                def load():
                    with torch.cuda.stream(stream):
                        target.copy_(host, non_blocking=True)
                    torch.cuda.current_stream().wait_stream(stream)
                entry["load_ms"] = timed_ms(load)
            else:
                entry["load_ms"] = 0.0
            rows_out.append(entry)

    plans = {}
    for ratio in RATIOS:
        costs = [BlockCost(e["with_ms"][str(ratio)], e["without_ms"], e["load_ms"]) for e in rows_out]
        plan = plan_cache_use(costs)
        whole = sum(c.without_cache_s for c in costs)
        resident = sum(c.with_cache_s for c in costs)
        plans[str(ratio)] = {"use": list(plan.use), "blocks_cached": plan.used, "blocks": len(costs),
                             "planned_ms": plan.latency_s, "whole_ms": whole, "resident_ms": resident,
                             "loads_ms": plan.loaded_s}
        log.info("mask %.2f: %d of %d blocks from the cache; blocks %.2f ms planned, %.2f whole, %.2f with the "
                 "recording on the device (loads %.2f ms)", ratio, plan.used, len(costs), plan.latency_s, whole,
                 resident, plan.loaded_s)
    if args.write_profile:
        def per_row_s(ms: float) -> float:
            return ms / 1e3 / args.rows

        per_row = [ProfiledBlock(e["index"], per_row_s(e["without_ms"]),
                                 tuple(per_row_s(e["with_ms"][str(r)]) for r in RATIOS), per_row_s(e["load_ms"]))
                   for e in rows_out]
        log.info("wrote %s", BlockProfile(args.size, RATIOS, tuple(per_row)).write(args.write_profile))
    bytes_per_step = sum(e["record_bytes"] for e in rows_out)
    log.info("a step's recording: %.1f MB for %d rows", bytes_per_step / 1e6, args.rows)
    write_json(args.out, {"model": str(model), "device": args.device, "size": args.size, "rows": args.rows,
                          "dtype": str(dtype), "iters": args.iters, "blocks": rows_out, "plans": plans,
                          "record_bytes_per_step": bytes_per_step,
                          "gpu": torch.cuda.get_device_name(args.device) if cuda else None,
                          "mask_ratios": list(RATIOS), "numpy": np.__version__})


if __name__ == "__main__":
    main()
