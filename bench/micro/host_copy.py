"""How fast one step of a template recording reaches the device from host memory (the template
cache's host tier, streamed a step ahead by engine/template_stream.py), and what host memory it
pins, three ways:

- `pinned_tensors`: each output its own pinned tensor from torch's caching pinned allocator, copied
  one by one (the host tier before engine/host_block.py);
- `block_tensors`: one block of exactly the recording's bytes, page-locked with cudaHostRegister
  (engine/host_block.pack), its outputs copied one by one (a step under a load plan);
- `block_flat`: the same block, the step's range in one copy (a step that takes every block).

A step's outputs are SDXL's at `--size` for `--rows` rows, as a recording with the ResNet boxes
keeps them (`--conv-subsets`: the ResNet blocks' and upsamplers' parts too;
export/profile_template.recorded_layout, from a meta-device UNet).
GPU times from CUDA events on a load stream (median of `--iters` over `--steps` steps held).

    python3 -m bench.micro.host_copy --work /tmp/hc --out $OUT/host_copy.json --conv-subsets
"""

from __future__ import annotations

import itertools
import logging
import statistics

from clients.bench.common import bench_parser, start_logging, write_json
from export.profile_template import gpu_ms, layout_bytes, recorded_layout

log = logging.getLogger("bench.micro.host_copy")


def measure(layout, steps: int, iters: int) -> dict:
    """GPU ms of a step's copies each way (median), GB/s, and the pinned host memory each held."""
    import torch

    from backends.core.engine import host_block

    device = torch.device("cuda")
    stream = torch.cuda.Stream(device)
    targets = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in layout]
    nbytes = layout_bytes(layout)

    def host_stats() -> int:
        """The bytes torch's pinned allocator holds (rounded block sizes), or -1 where torch does not say."""
        stats = getattr(torch.cuda, "host_memory_stats", lambda: {})()
        return int(stats.get("allocated_bytes.current", stats.get("reserved_bytes.all.current", -1)))

    def run(name: str, step_pairs: list) -> dict:
        turns = itertools.cycle(step_pairs)

        def copy():  # one step's copies on the load stream, the current stream waiting for them
            with torch.cuda.stream(stream):
                for target, source in next(turns):
                    target.copy_(source, non_blocking=True)
            torch.cuda.current_stream(device).wait_stream(stream)

        times = gpu_ms(copy, iters, warmup=1)
        ms = statistics.median(times)
        entry = {"ms": ms, "gb_s": nbytes / ms / 1e6, "spread_ms": [min(times), max(times)]}
        log.info("%s: %.2f ms a step (%.1f GB/s; %.2f-%.2f ms)", name, ms, entry["gb_s"], *entry["spread_ms"])
        return entry

    out = {"step_bytes": nbytes, "outputs": len(layout)}
    before = host_stats()
    pinned = [[torch.empty(shape, dtype=dtype, pin_memory=True) for shape, dtype in layout] for _ in range(steps)]
    out["pinned_tensors"] = run("pinned tensors, one copy each",
                                [list(zip(targets, step)) for step in pinned])
    held = host_stats() - before if before >= 0 else None
    out["pinned_tensors"]["host_reserved_bytes"] = held
    if held is not None:
        log.info("torch's pinned allocator held %.2f GiB for %.2f GiB of outputs (%.2fx)", held / 2**30,
                 steps * nbytes / 2**30, held / (steps * nbytes))
    del pinned
    blocks = []
    for _ in range(steps):
        block, views = host_block.pack({(0, i): torch.empty(shape, dtype=dtype) for i, (shape, dtype)
                                        in enumerate(layout)}, pin=True)
        blocks.append((block, [views[(0, i)] for i in range(len(layout))]))
    out["block_tensors"] = run("one page-locked block, one copy each",
                               [list(zip(targets, views)) for _, views in blocks])
    out["block_tensors"]["host_bytes"] = sum(b.numel() for b, _ in blocks)
    flat_target = torch.empty(blocks[0][0].numel(), dtype=torch.uint8, device=device)
    out["block_flat"] = run("one page-locked block, the step in one copy",
                            [[(flat_target, block)] for block, _ in blocks])
    return out


def main(argv=None) -> int:
    p = bench_parser(__doc__, size=1024, steps=4, work_help="unused (the layout is a meta-device UNet's)")
    p.add_argument("--rows", type=int, default=2, help="UNet rows of the recording (2: one request with guidance)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--conv-subsets", action="store_true", help="the ResNet blocks' and upsamplers' parts too")
    args = p.parse_args(argv)
    start_logging()
    import torch

    from export.tiny import unet_kwargs

    layout = recorded_layout(unet_kwargs("sdxl"), args.size, args.rows, convs=args.conv_subsets)
    nbytes = layout_bytes(layout)
    log.info("a step of the recording: %d outputs, %.1f MB for %d rows", len(layout), nbytes / 1e6, args.rows)
    report = {"size": args.size, "rows": args.rows, "conv_subsets": args.conv_subsets, "step_bytes": nbytes}
    if not torch.cuda.is_available():
        raise SystemExit("bench.micro.host_copy: the copies need a CUDA device")
    report.update(measure(layout, args.steps, args.iters), device=torch.cuda.get_device_name())
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
