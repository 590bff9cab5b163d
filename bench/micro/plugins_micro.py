"""Decides which fused kernels (GroupNorm+SiLU, GEGLU) the runtime uses.

The fused kernels of plugins/ against torch on SDXL's shapes: eager unfused ops, our Triton
op, and torch.compile (default mode) of the unfused function, per shape.

    python3 bench/micro/plugins_micro.py --out $OUT/plugins_micro.json [--dtype fp16]

Two timings each, medians: `cold` from triton.testing.do_bench (CUDA events around one call,
L2 flushed before each; while the flush runs the CPU queues the call, so Python launch cost is
mostly hidden) and `graph` from do_bench_cudagraph (calls replayed back to back in a CUDA
graph, as the fast runtime runs them; tensors that fit in L2 stay warm). Bandwidth is the least
traffic the op needs (read the input once, write the output once) over the cold time; the
speed-ups are time ratios. Each variant's largest difference from eager is recorded too.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from clients.bench.common import start_logging, write_json

log = logging.getLogger("bench.micro.plugins_micro")

# [N, C, H, W]: UNet resnets at 1024 px (latent 128x128, batch 2 for guidance), the VAE decoder's
# widest full-resolution stages.
GN_SHAPES = [(2, 320, 128, 128), (2, 640, 64, 64), (2, 1280, 32, 32), (1, 512, 1024, 1024), (1, 256, 1024, 1024)]
# [batch, tokens, 2*D]: FeedForward(640, mult 4) at 64x64 tokens, FeedForward(1280) at 32x32.
GEGLU_SHAPES = [(2, 4096, 2 * 2560), (2, 1024, 2 * 5120)]
GROUPS, EPS = 32, 1e-5


def _cases(torch, F, plugins, dtype):
    """(op, shape, input bytes + output bytes, inputs, unfused, fused)."""
    size = torch.finfo(dtype).bits // 8
    for shape in GN_SHAPES:
        x = torch.randn(shape, device="cuda", dtype=dtype)
        w = 1 + 0.1 * torch.randn(shape[1], device="cuda", dtype=dtype)
        b = 0.1 * torch.randn(shape[1], device="cuda", dtype=dtype)

        def unfused(x, w, b):
            return F.silu(F.group_norm(x, GROUPS, w, b, EPS))

        def fused(x, w, b):
            return plugins.group_norm_silu(x, w, b, GROUPS, EPS)

        yield "group_norm_silu", shape, 2 * x.numel() * size, (x, w, b), unfused, fused
    for shape in GEGLU_SHAPES:
        x = torch.randn(shape, device="cuda", dtype=dtype)

        def unfused(x):
            hidden, gate = x.chunk(2, dim=-1)
            return hidden * F.gelu(gate)

        yield "geglu", shape, x.numel() * size * 3 // 2, (x,), unfused, plugins.geglu


def _time(testing, fn) -> dict[str, float]:
    return {"cold": testing.do_bench(fn, warmup=50, rep=300, return_mode="median"),
            "graph": testing.do_bench_cudagraph(fn, rep=100, return_mode="median")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/plugins_micro.json"), help="JSON report")
    p.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    args = p.parse_args()
    start_logging()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("plugins_micro: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing measured")
    try:
        import triton
        import triton.testing as testing
    except ImportError:
        sys.exit("plugins_micro: needs the `triton` package; nothing measured")
    import plugins

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": args.dtype, "groups": GROUPS, "timing": "median ms; cold: do_bench with L2 flush, "
              "graph: do_bench_cudagraph", "results": []}
    # speed-ups are the eager (or compiled) time over ours: >1 means the Triton op is faster
    log.info("%-16s %-22s %9s %9s %9s %8s %8s %8s %10s", "op", "shape", "eager ms", "triton ms", "compile ms",
             "vs eager", "vs comp.", "vs eager", "triton GB/s")
    log.info("%-16s %-22s %9s %9s %9s %8s %8s %8s %10s", "", "", "(cold)", "(cold)", "(cold)", "(cold)", "(cold)",
             "(graph)", "(cold)")
    with torch.no_grad():
        for op, shape, nbytes, inputs, unfused, fused in _cases(torch, F, plugins, dtype):
            torch._dynamo.reset()  # a fresh static-shape compile per shape, not a dynamic-shape kernel
            compiled = torch.compile(unfused, dynamic=False)
            variants = {"eager": unfused, "triton": fused, "compiled": compiled}
            want = unfused(*inputs)
            diffs = {k: (f(*inputs).float() - want.float()).abs().max().item() for k, f in variants.items() if k != "eager"}
            ms = {k: _time(testing, lambda f=f: f(*inputs)) for k, f in variants.items()}
            row = {
                "op": op, "shape": list(shape), "bytes": nbytes, "ms": ms,
                "gb_per_s": {k: nbytes / (t["cold"] * 1e-3) / 1e9 for k, t in ms.items()},
                "speedup_cold": {"triton_vs_eager": ms["eager"]["cold"] / ms["triton"]["cold"],
                                 "triton_vs_compiled": ms["compiled"]["cold"] / ms["triton"]["cold"],
                                 "compiled_vs_eager": ms["eager"]["cold"] / ms["compiled"]["cold"]},
                "speedup_graph": {"triton_vs_eager": ms["eager"]["graph"] / ms["triton"]["graph"],
                                  "triton_vs_compiled": ms["compiled"]["graph"] / ms["triton"]["graph"]},
                "max_abs_diff_vs_eager": diffs,
            }
            report["results"].append(row)
            log.info("%-16s %-22s %9.4f %9.4f %9.4f %8.2f %8.2f %8.2f %10.0f", op, str(shape), ms["eager"]["cold"],
                     ms["triton"]["cold"], ms["compiled"]["cold"], row["speedup_cold"]["triton_vs_eager"],
                     row["speedup_cold"]["triton_vs_compiled"], row["speedup_graph"]["triton_vs_eager"],
                     row["gb_per_s"]["triton"])
            del inputs, want
            torch.cuda.empty_cache()

    write_json(args.out, report)


if __name__ == "__main__":
    main()
