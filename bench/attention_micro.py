"""Attention on SDXL's shapes: SDPA as the UNet calls it (cuDNN's flash kernel on Hopper; also
PyTorch's own flash kernel, forced) against a flash-attention kernel of ours in Triton's kernel
language, for a sweep of its tiles. An experiment, kept for its answer: on an H200
(bench/results/2026-11-23b-h200/attention_micro.json) cuDNN's kernel ran SDXL's self-attention at
441 TFLOP/s at 4096 tokens and ours at 0.88x of it (1.03x at 1024 tokens and 2 rows, 0.89x at 16;
1.22x on cross-attention's 77 keys, 0.2 ms of a step in all), so the runtime keeps SDPA.

Ours reads q, k and v where the projections wrote them, [B, N, H*D] with any row stride (the
self-attention's packed [B, N, 3 H D] product in place) and writes [B, N, H*D]: no transposes. The
softmax runs online in fp32 (exp2, the scale folded in), the products in fp16 with fp32 sums.

    python3 -m bench.attention_micro --out $OUT/attention_micro.json

Median ms of do_bench_cudagraph (replayed in CUDA graphs, as the runtime runs them); TFLOP/s
count the two products, 4 N_q N_kv D per head. Each variant's largest difference from SDPA's
default is recorded.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from bench.common import start_logging, write_json

log = logging.getLogger("bench.attention_micro")

# (rows, query tokens, key tokens, heads): self-attention at 64x64 and 32x32 latent pixels (SDXL
# at 1024 px), one request with guidance (2 rows) and eight (16); cross-attention over 77 tokens.
SHAPES = [(2, 4096, 4096, 10), (2, 1024, 1024, 20), (16, 4096, 4096, 10), (16, 1024, 1024, 20), (2, 4096, 77, 10)]
HEAD_DIM = 64
SWEEP = dict(block_m=(64, 128), block_n=(32, 64, 128), num_warps=(4, 8), num_stages=(2, 3))


@dataclass(frozen=True)
class AttentionTiles:
    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


@triton.jit
def _attention(q_ptr, k_ptr, v_ptr, o_ptr, N_Q, N_KV, H, qk_scale,
               q_sb, q_sn, k_sb, k_sn, v_sb, v_sn, o_sb, o_sn,
               HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_KV: tl.constexpr):
    start_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < N_Q

    q = tl.load(q_ptr + b * q_sb + rows[:, None].to(tl.int64) * q_sn + h * HEAD_DIM + dims[None, :],
                mask=row_ok[:, None], other=0.0)
    k_base = k_ptr + b * k_sb + h * HEAD_DIM
    v_base = v_ptr + b * v_sb + h * HEAD_DIM

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    for start_n in tl.range(0, N_KV, BLOCK_N):
        kv_rows = start_n + cols
        if EVEN_KV:
            kt = tl.load(k_base + kv_rows[None, :].to(tl.int64) * k_sn + dims[:, None])  # [D, BLOCK_N]
            v = tl.load(v_base + kv_rows[:, None].to(tl.int64) * v_sn + dims[None, :])
        else:
            kv_ok = kv_rows < N_KV
            kt = tl.load(k_base + kv_rows[None, :].to(tl.int64) * k_sn + dims[:, None], mask=kv_ok[None, :],
                         other=0.0)
            v = tl.load(v_base + kv_rows[:, None].to(tl.int64) * v_sn + dims[None, :], mask=kv_ok[:, None],
                        other=0.0)
        qk = tl.dot(q, kt) * qk_scale  # log2 units: the scale carries log2(e)
        if not EVEN_KV:
            qk = tl.where((kv_rows < N_KV)[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.math.exp2(qk - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / l_i[:, None]
    tl.store(o_ptr + b * o_sb + rows[:, None].to(tl.int64) * o_sn + h * HEAD_DIM + dims[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int,
              tiles: AttentionTiles = AttentionTiles()) -> torch.Tensor:
    """q [B, Nq, H*D], k and v [B, Nkv, H*D] (last dim contiguous; rows may be strided, as slices of
    a packed projection are) -> [B, Nq, H*D] contiguous, softmax(q k^T / sqrt(D)) v per head."""
    batch, n_q, width = q.shape
    n_kv = k.shape[1]
    head_dim = width // heads
    if head_dim * heads != width or head_dim not in (16, 32, 64, 128):
        raise ValueError(f"attention: {width} channels in {heads} heads: head size must be 16, 32, 64 or 128")
    for t in (q, k, v):
        if t.stride(-1) != 1:
            raise ValueError("attention: the channels must be contiguous")
    out = q.new_empty((batch, n_q, width))
    grid = (triton.cdiv(n_q, tiles.block_m), batch * heads)
    scale = 1.0 / math.sqrt(head_dim) * 1.4426950408889634
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _attention[grid](q, k, v, out, n_q, n_kv, heads, scale,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         out.stride(0), out.stride(1), HEAD_DIM=head_dim, BLOCK_M=tiles.block_m,
                         BLOCK_N=tiles.block_n, EVEN_KV=n_kv % tiles.block_n == 0,
                         num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench/results/attention_micro.json"), help="JSON report")
    args = p.parse_args()
    start_logging()

    import torch.nn.functional as F
    import triton.testing as testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not torch.cuda.is_available():
        sys.exit("attention_micro: needs a CUDA GPU; nothing measured")

    def sdpa(q, k, v, heads):
        b, n, c = q.shape
        d = c // heads
        out = F.scaled_dot_product_attention(*(t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v)))
        return out.transpose(1, 2).reshape(b, n, c)

    def bench(fn) -> float:
        return testing.do_bench_cudagraph(fn, rep=100, return_mode="median")

    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
              "dtype": "fp16", "head_dim": HEAD_DIM, "timing": "median ms of do_bench_cudagraph", "results": []}
    tiles = [AttentionTiles(*v) for v in itertools.product(*SWEEP.values())]
    with torch.no_grad():
        for rows, n_q, n_kv, heads in SHAPES:
            gen = torch.Generator("cuda").manual_seed(0)
            c = heads * HEAD_DIM
            if n_q == n_kv:  # self-attention: q, k, v are slices of the packed projection
                qkv = torch.randn(rows, n_q, 3 * c, device="cuda", dtype=torch.float16, generator=gen)
                q, k, v = qkv[..., :c], qkv[..., c:2 * c], qkv[..., 2 * c:]
            else:
                q = torch.randn(rows, n_q, c, device="cuda", dtype=torch.float16, generator=gen)
                kv = torch.randn(rows, n_kv, 2 * c, device="cuda", dtype=torch.float16, generator=gen)
                k, v = kv[..., :c], kv[..., c:]
            want = sdpa(q, k, v, heads)
            flop = 4 * rows * heads * n_q * n_kv * HEAD_DIM
            ms = {"sdpa": bench(lambda: sdpa(q, k, v, heads))}
            diffs = {}
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                diffs["sdpa_flash"] = (sdpa(q, k, v, heads).float() - want.float()).abs().max().item()
                ms["sdpa_flash"] = bench(lambda: sdpa(q, k, v, heads))
            for t in tiles:
                name = "triton " + ",".join(str(x) for x in vars(t).values())
                try:
                    diffs[name] = (attention(q, k, v, heads, t).float() - want.float()).abs().max().item()
                    ms[name] = bench(lambda t=t: attention(q, k, v, heads, t))
                except Exception as e:  # tiles that do not fit shared memory or registers
                    log.info("%s: %s", name, str(e).splitlines()[0])
            ours = {n: t for n, t in ms.items() if n.startswith("triton")}
            best = min(ours, key=ours.get)
            row = {"rows": rows, "n_q": n_q, "n_kv": n_kv, "heads": heads, "ms": ms,
                   "tflops": {n: flop / (t * 1e-3) / 1e12 for n, t in ms.items()},
                   "max_abs_diff_vs_sdpa": diffs, "best": best, "sdpa_over_best": ms["sdpa"] / ms[best]}
            report["results"].append(row)
            log.info("rows %d, %d x %d tokens, %d heads: sdpa %.4f ms (%.0f TFLOP/s), sdpa flash %.4f, best %s "
                     "%.4f ms (%.0f TFLOP/s, %.2fx sdpa, diff %.3g)", rows, n_q, n_kv, heads, ms["sdpa"],
                     row["tflops"]["sdpa"], ms["sdpa_flash"], best, ms[best], row["tflops"][best],
                     row["sdpa_over_best"], diffs[best])
            torch.cuda.empty_cache()
    write_json(args.out, report)


if __name__ == "__main__":
    main()
