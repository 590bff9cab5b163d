"""GEGLU with its projection on SDXL's shapes: the unfused path (eager; compiled, as the runtime's
inductor builds it), the projection + plugins' GEGLU kernel, and plugins/geglu_linear_kernel.py
(the projection's product with GEGLU as its epilogue) for a sweep of tile shapes.

    python3 bench/geglu_linear_micro.py --out $OUT/geglu_linear_micro.json

Timings are medians of do_bench_cudagraph (calls replayed back to back in a CUDA graph, as the
fast runtime runs them). Each fused variant's largest difference from the compiled unfused path
is recorded.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
from pathlib import Path

from bench.common import start_logging, write_json

log = logging.getLogger("bench.geglu_linear_micro")

# (rows of a step, tokens, K = channels, D = inner dim): FeedForward(640) at 64x64 tokens and
# FeedForward(1280) at 32x32 tokens, one request with guidance (2 rows) and eight (16 rows).
SHAPES = [(2, 4096, 640, 2560), (2, 1024, 1280, 5120), (16, 4096, 640, 2560), (16, 1024, 1280, 5120)]
SWEEP = dict(block_m=(128,), block_n=(64, 128), block_k=(64, 128), group_m=(8,), num_warps=(4, 8),
             num_stages=(2, 3, 4))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/geglu_linear_micro.json"), help="JSON report")
    p.add_argument("--quick", action="store_true", help="only the kernel's default tile shape")
    args = p.parse_args()
    start_logging()

    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        sys.exit("geglu_linear_micro: needs a CUDA GPU; nothing measured")
    import triton
    import triton.testing as testing

    import plugins
    from plugins.geglu_linear_kernel import DEFAULT, TileConfig, geglu_linear

    def unfused(x, w, b):
        hidden, gate = F.linear(x, w, b).chunk(2, dim=-1)
        return hidden * F.gelu(gate)

    def bench(fn) -> float:
        return testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": "fp16", "timing": "median ms of do_bench_cudagraph", "results": []}
    configs = [DEFAULT] if args.quick else [TileConfig(*v) for v in itertools.product(*SWEEP.values())]
    with torch.no_grad():
        for rows, tokens, k, d in SHAPES:
            gen = torch.Generator("cuda").manual_seed(0)
            x = torch.randn(rows, tokens, k, device="cuda", dtype=torch.float16, generator=gen)
            w = (torch.randn(2 * d, k, device="cuda", generator=gen) / k ** 0.5).half()
            b = (0.1 * torch.randn(2 * d, device="cuda", generator=gen)).half()
            torch._dynamo.reset()
            compiled = torch.compile(unfused, dynamic=False)
            want = compiled(x, w, b)
            eager_out = unfused(x, w, b)
            flop = 2 * rows * tokens * k * 2 * d
            ms = {"eager": bench(lambda: unfused(x, w, b)), "compiled": bench(lambda: compiled(x, w, b)),
                  "linear+geglu_kernel": bench(lambda: plugins.geglu(F.linear(x, w, b)))}
            diffs = {"eager": (eager_out.float() - want.float()).abs().max().item()}
            for cfg in configs:
                name = "fused " + ",".join(str(v) for v in vars(cfg).values())
                try:
                    out = geglu_linear(x, w, b, cfg)
                    diffs[name] = (out.float() - want.float()).abs().max().item()
                    ms[name] = bench(lambda cfg=cfg: geglu_linear(x, w, b, cfg))
                except Exception as e:  # a tile shape that does not fit the SM's shared memory
                    log.info("%s: %s", name, str(e).splitlines()[0])
            fused = {n: t for n, t in ms.items() if n.startswith("fused")}
            best = min(fused, key=fused.get)
            row = {"rows": rows, "tokens": tokens, "k": k, "d": d, "gflop": flop / 1e9, "ms": ms,
                   "tflops": {n: flop / (t * 1e-3) / 1e12 for n, t in ms.items()},
                   "max_abs_diff_vs_compiled": diffs, "best": best, "compiled_over_best": ms["compiled"] / ms[best]}
            report["results"].append(row)
            log.info("rows %d tokens %d K %d D %d: eager %.4f compiled %.4f linear+kernel %.4f best %s %.4f "
                     "(%.0f TFLOP/s, %.2fx compiled; diff %.3g)", rows, tokens, k, d, ms["eager"], ms["compiled"],
                     ms["linear+geglu_kernel"], best, ms[best], row["tflops"][best], row["compiled_over_best"],
                     diffs[best])
            del x, w, b, want, eager_out
            torch.cuda.empty_cache()
    write_json(args.out, report)


if __name__ == "__main__":
    main()
