"""What a ResNet block's box costs against the block run whole, and where the box's time goes.

A reusing template edit runs each ResNet block on its mask's box (runtime/conv_subsets.py's static
form, easel::resnet_box, which the reusing steps' CUDA graphs capture). At SDXL's shapes on an
H200 (1024 px, 2 rows, a 20% mask) the boxes' torch operators took about as long as the whole
blocks they stand in for, run as written or compiled with every size dynamic; their Triton kernels
(plugins/resnet_box_kernel.py) less (bench/results/2026-12-02d-h200). This times one block at a time,
SDXL-base's shapes with random fp16 weights, channels_last, each variant as a CUDA graph replayed
(median of `--iters`), and profiles its kernels unreplayed:

- `whole_eager`, `whole_compiled`: the block on every token (diffusers' module; compiled by
  inductor with static shapes, about what the exact compiled step runs);
- `box_eager`: conv_subsets.resnet_box_body, the box's torch form;
- `box_triton`: easel::resnet_box, which the reusing graphs run: on CUDA, plugins/resnet_box_kernel.py;
- `box_dynamic`, `box_static`: that body compiled by inductor alone, every size dynamic (one
  compile for every box) or every size static (a compile per block and box).

The box is a centered mask's of ratio `--ratio` on the block's grid, widened as the static form
widens it (the smallest of BOX_SIDES that holds it).

`--count` runs nowhere (the meta device): per block, the operators that move memory in the box's
body as written and in the block run whole, and the bytes each reads and writes (views aside): a
device-free check of a change to the body before a GPU times it.

    python3 -m bench.micro.box_kernels --work /tmp/bk --out $OUT/box_kernels.json
    python3 -m bench.micro.box_kernels --work /tmp/bk --out bk.json --count --blocks 320:320:128,960:640:64
    python3 -m bench.micro.box_kernels --work /tmp/bk --out bk.json --blocks 320:320:128,960:640:64 --ratio 0.35
"""

from __future__ import annotations

import logging
import statistics

from clients.bench.common import bench_parser, start_logging, write_json

log = logging.getLogger("bench.micro.box_kernels")

LATENT = 128  # 1024 px
TEMB = 1280  # SDXL's time embedding
# in channels : out channels : grid side, SDXL base's at 1024 px (one of each level's widths, and one
# of the up blocks' with a shortcut)
BLOCKS = "320:320:128,1280:1280:32"
VARIANTS = ("whole_eager", "whole_compiled", "box_eager", "box_triton", "box_dynamic", "box_static")


def box_fraction(ratio: float, side: int) -> tuple[float, object]:
    """The static form's box fraction (both sides: the mask is a centered square) on a grid of
    `side` tokens for a centered mask of `ratio`, and the mask's computed tokens there [n]."""
    import torch

    from backends.core.runtime.conv_subsets import BOX_SIDES, box_side, masked_boxes, widened
    from backends.core.runtime.token_subsets import computed_tokens
    from export.profile_template import centered_mask

    mask = torch.from_numpy(centered_mask(LATENT, ratio) / 255.0)[None, None]
    levels = (LATENT // side).bit_length()
    top, bottom, left, right = widened([masked_boxes(mask, levels)[side * side]], side, side)
    extent = max(bottom - top, right - left)
    fraction = next(f for f in BOX_SIDES if box_side(f, side) >= extent)
    return fraction, computed_tokens(mask, levels)[side * side]


# Operators that return a view or an uninitialized tensor (no kernel, no bytes moved)
_VIEWS = frozenset({"alias", "as_strided", "detach", "empty", "empty_like", "expand", "lift_fresh", "movedim",
                    "permute", "select", "slice", "split", "squeeze", "t", "transpose", "unbind", "unflatten",
                    "unsqueeze", "view", "_unsafe_view"})


def block_inputs(c_in: int, c_out: int, side: int, ratio: float, rows: int, device):
    """One random SDXL ResNet block (fp16, channels_last) on `device`, its input and time embedding,
    a recording of it at another input, and the arguments of its box's body for an input x
    (resnet_box_body's, the box placed once as a step places it): (block, x, temb, body_args, report)."""
    import torch
    import torch.nn.functional as F
    from diffusers.models.resnet import ResnetBlock2D

    from backends.core.runtime import conv_subsets

    cl = torch.channels_last
    torch.manual_seed(0)
    fraction, tokens = box_fraction(ratio, side)
    bside = conv_subsets.box_side(fraction, side)
    with torch.device(device):
        block = ResnetBlock2D(in_channels=c_in, out_channels=c_out, temb_channels=TEMB, groups=32, eps=1e-5)
        block = block.half().eval().to(memory_format=cl)
        x = torch.randn(rows, c_in, side, side, dtype=torch.float16).contiguous(memory_format=cl)
        temb = torch.randn(rows, TEMB, dtype=torch.float16)
        recorded, stats, maps = conv_subsets.whole(block, x + 0.1 * torch.randn_like(x), temb, stats=True)
        geometry = conv_subsets.resnet_geometry(tokens.to(device)[None].expand(rows, -1).contiguous(), side, side,
                                                bside, bside)
        temb_proj = block.time_emb_proj(F.silu(temb))
    shortcut = block.conv_shortcut

    def body_args(x):
        return (x, temb_proj, geometry, recorded, stats, maps, block.norm1.weight, block.norm1.bias,
                block.conv1.weight, block.conv1.bias, block.norm2.weight, block.norm2.bias, block.conv2.weight,
                block.conv2.bias, None if shortcut is None else shortcut.weight,
                None if shortcut is None else shortcut.bias, 32, 32, 1e-5, 1e-5, float(block.output_scale_factor))

    report = {"in_channels": c_in, "out_channels": c_out, "grid": side, "box_fraction": fraction, "box_side": bside,
              "computed_tokens": int(tokens.numel())}
    return block, x, temb, body_args, report


def traffic(c_in: int, c_out: int, side: int, ratio: float, rows: int) -> dict:
    """On the meta device: the box body's and the whole block's operators that move memory, and the
    bytes they read and write (each operator's tensors in and out: an upper bound where it reads a
    part of an input)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from backends.core.runtime import conv_subsets

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.bytes = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ not in _VIEWS:
                tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                           if isinstance(t, torch.Tensor)]
                self.ops += 1
                self.bytes += sum(t.numel() * t.element_size() for t in tensors)
            return out

    with torch.inference_mode():
        block, x, temb, body_args, report = block_inputs(c_in, c_out, side, ratio, rows, "meta")
        report["counts"] = {}
        for name, run in (("box_eager", lambda: conv_subsets.resnet_box_body(*body_args(x))),
                          ("whole_eager", lambda: block(x, temb))):
            with Count() as count:
                run()
            report["counts"][name] = {"ops": count.ops, "bytes": count.bytes}
            log.info("%d->%d @%d^2, box %d^2: %s %d operators, %.1f MB", c_in, c_out, side, report["box_side"], name,
                     count.ops, count.bytes / 1e6)
    return report


def measure(c_in: int, c_out: int, side: int, ratio: float, rows: int, iters: int) -> dict:
    import torch

    from backends.core.runtime import conv_subsets
    from backends.core.runtime.cuda_graphs import capture
    from bench.micro.step_profile import kernel_profile
    from export.profile_template import gpu_ms

    with torch.inference_mode():
        block, x, temb, args, report = block_inputs(c_in, c_out, side, ratio, rows, "cuda")
        body = conv_subsets.resnet_box_body
        dynamic, static, whole = (torch.compile(body, dynamic=True), torch.compile(body, dynamic=False),
                                  torch.compile(block))
        fns = {"whole_eager": lambda x: block(x, temb), "whole_compiled": lambda x: whole(x, temb),
               "box_eager": lambda x: body(*args(x)), "box_triton": lambda x: torch.ops.easel.resnet_box(*args(x)),
               "box_dynamic": lambda x: dynamic(*args(x)),
               "box_static": lambda x: static(*args(x))}
        report["variants"] = {}
        want = body(*args(x))
        for name in VARIANTS:
            graph, out = capture(fns[name], (x,), warmup_runs=2)
            times = gpu_ms(graph.replay, iters)
            by_cat, kernels, launches = kernel_profile(lambda: fns[name](x), max(1, iters // 4))
            entry = {"replay_ms": statistics.median(times), "spread_ms": [min(times), max(times)],
                     "kernels": launches, "kernel_ms": sum(by_cat.values()), "by_category_ms": by_cat,
                     "top_kernels": kernels[:8]}
            if name.startswith("box"):
                entry["max_abs_err_vs_box_eager"] = float((out.float() - want.float()).abs().max())
            report["variants"][name] = entry
            log.info("%d->%d @%d^2, box %d^2: %s %.3f ms replayed (%.3f-%.3f), %d kernels %.3f ms", c_in, c_out,
                     side, report["box_side"], name, entry["replay_ms"], *entry["spread_ms"], launches,
                     entry["kernel_ms"])
            for kernel, ms in kernels[:4]:
                log.info("    %.3f ms  %s", ms, kernel)
            del graph
    return report


def main(argv=None) -> int:
    p = bench_parser(__doc__, size=1024, steps=0, work_help="unused (random weights, made on the device)")
    p.add_argument("--blocks", default=BLOCKS, help="in:out:grid, comma-separated (SDXL base's at 1024 px)")
    p.add_argument("--ratio", type=float, default=0.2, help="the centered mask's share of the latent")
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--iters", type=int, default=40)
    p.add_argument("--count", action="store_true", help="count operators and bytes on the meta device instead")
    args = p.parse_args(argv)
    start_logging()
    import torch

    blocks = [tuple(int(v) for v in spec.split(":")) for spec in args.blocks.split(",")]
    if args.count:
        write_json(args.out, {"ratio": args.ratio, "rows": args.rows,
                              "blocks": [traffic(*b, args.ratio, args.rows) for b in blocks]})
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("bench.micro.box_kernels: the blocks run on a CUDA device")
    if args.size != 1024:
        raise SystemExit("bench.micro.box_kernels: --size: the blocks' grids are SDXL's at 1024 px only")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "ratio": args.ratio,
              "rows": args.rows, "blocks": [measure(*b, args.ratio, args.rows, args.iters) for b in blocks]}
    write_json(args.out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
