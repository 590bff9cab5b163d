"""Decides the VAE decoder's variant (dtype, layout, attention) and the image files' encoder settings.

The VAE decoder and the image encode, per variant, in process (no server): SDXL's VAE with
random weights on one GPU, one 1024x1024 image (a [1, 4, 128, 128] latent).

Variants are a dtype (fp32, SDXL's VAE as diffusers runs it, upcast; bf16, fp32's range at half
the bytes; fp16 for reference only: SDXL's real VAE overflows in it) plus options: `graphs` (one
CUDA graph), `fused` (plugins' GroupNorm+SiLU), `compiled` (torch.compile, default mode), `cl`
(channels_last), `tf32` (fp32 products in TF32), `cudnnbench` (cuDNN times its convolution
algorithms), `attn16`/`attnbf16` (the attention product's dtype). Each reports the wall time of
LatentDecoder.decode (latents in host memory to uint8 pixels in host memory, medians) and the
PSNR of its pixels against fp32 eager's. Then the PNG encode of those pixels (ours, strips on
threads) against PIL's at the same level.

    python3 bench/micro/vae_micro.py --work /tmp/easel-micro --out $OUT/vae_micro.json \
        --variants fp32,fp32+graphs,fp32+graphs+fused,bf16+graphs+fused
"""

from __future__ import annotations

import io
import json
import logging
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from clients.bench.common import bench_parser, random_sdxl, run_key, start_logging
from bench.micro.step_profile import kernel_profile

log = logging.getLogger("bench.micro.vae_micro")
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OPTIONS = {"graphs": "graphs", "fused": "fused_kernels", "compiled": "compiled", "cl": "channels_last"}
# Not a LatentDecoder option but the process-wide torch flag, which the VAE's own stub process could set:
# fp32 matrix products (the mid block's attention) on tensor cores with TF32's 10-bit mantissa.
TF32 = "tf32"
# Also process-wide: cuDNN times its algorithms for each convolution shape (at the first call,
# before the capture) instead of taking its heuristics' pick.
CUDNN_BENCHMARK = "cudnnbench"
# LatentDecoder's attention_dtype
ATTENTION = {"attn16": "float16", "attnbf16": "bfloat16"}
VARIANT_OPTIONS = (*OPTIONS, TF32, CUDNN_BENCHMARK, *ATTENTION)


def wall_s(fn, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()  # ends in a host copy: synchronous
        times.append(time.perf_counter() - start)
    return times


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=0)
    p.add_argument("--variants", default="fp32,fp32+graphs,fp32+graphs+fused,fp32+compiled,"
                                         "bf16+graphs,bf16+graphs+fused,bf16+compiled")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--profile", action="store_true", help="also each variant's GPU time by kernel category")
    args = p.parse_args()
    start_logging()

    import torch
    from PIL import Image

    from backends.core.runtime.placement import Placement
    from backends.core.stages.image_files import PNG_COMPRESS_LEVEL
    from clients.bench.image_metrics import psnr
    from backends.core.stages.png_encoding import encode_png
    from backends.core.stages.vae_decoding import LatentDecoder

    model = random_sdxl(args.work)
    latent = args.size // 8
    latents = torch.randn(1, 4, latent, latent, generator=torch.Generator().manual_seed(0)).numpy()
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size, "variants": {}}
    reference = None
    for name in ["fp32"] + [v for v in args.variants.split(",") if v != "fp32"]:
        dtype, *options = name.split("+")
        unknown = [o for o in options if o not in VARIANT_OPTIONS]
        if dtype not in DTYPES or unknown:
            raise SystemExit(f"--variants: {name!r}: dtype one of {list(DTYPES)}, options of {list(VARIANT_OPTIONS)}")
        torch.backends.cuda.matmul.allow_tf32 = TF32 in options
        torch.backends.cudnn.benchmark = CUDNN_BENCHMARK in options
        start = time.perf_counter()
        decoder = LatentDecoder(model, Placement("cuda:0", "fp16"), dtype=getattr(torch, DTYPES[dtype]),
                                **{OPTIONS[o]: True for o in options if o in OPTIONS},
                                **{"attention_dtype": getattr(torch, ATTENTION[o]) for o in options if o in ATTENTION})
        with torch.inference_mode():
            pixels = decoder.decode(latents)  # first call: capture / compile
            first_s = time.perf_counter() - start
            times = wall_s(lambda: decoder.decode(latents), args.iters)
        if reference is None:
            reference = pixels
        entry = report["variants"][run_key(report["variants"], name)] = {
            "decode_s": statistics.median(times), "decode_s_min": min(times), "decode_s_max": max(times),
            "load_and_first_s": first_s, "psnr_db_vs_fp32": psnr(reference, pixels),
            "max_abs_diff": int(np.abs(reference.astype(np.int16) - pixels.astype(np.int16)).max())}
        log.info("%s: decode %.1f ms (%.1f-%.1f), first %.1f s, PSNR vs fp32 %.1f dB, max diff %d", name,
                 1000 * entry["decode_s"], 1000 * min(times), 1000 * max(times), first_s,
                 entry["psnr_db_vs_fp32"], entry["max_abs_diff"])
        if args.profile:
            with torch.inference_mode():
                by_cat, kernels, launches = kernel_profile(lambda: decoder.decode(latents), 3)
            entry.update(kernel_ms_by_category=by_cat, kernels_per_call=launches, top_kernels=kernels[:15])
            log.info("%s: GPU ms by category %s; heaviest %s", name, {k: round(v, 2) for k, v in by_cat.items()},
                     [(k[:60], round(v, 2)) for k, v in kernels[:5]])
        del decoder
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))

    def pil_png():
        buf = io.BytesIO()
        Image.fromarray(reference).save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
        return buf.getvalue()

    # Our encoder's settings (strip size, threads) against its defaults: the bytes depend on the
    # strip size only.
    pools = {n: ThreadPoolExecutor(n) for n in (2, 4, 8, 16)}
    settings = {f"png_ours_{kib}k_{n}t": (lambda kib=kib, n=n: encode_png(reference, PNG_COMPRESS_LEVEL, kib * 1024,
                                                                        pools[n]))
                for kib in (16, 64, 256) for n in pools}
    # The cores this process may use: a container's CPU quota can be below os.cpu_count().
    report["host"] = {"cpu_count": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                      "cgroup_cpu_max": _read("/sys/fs/cgroup/cpu.max")}
    log.info("host: %s", report["host"])
    for name, fn in (("png_ours", lambda: encode_png(reference, PNG_COMPRESS_LEVEL)), ("png_pil", pil_png),
                     *settings.items()):
        times = wall_s(fn, args.iters)
        report[name] = {"s": statistics.median(times), "s_min": min(times), "s_max": max(times),
                        "bytes": len(fn())}
        log.info("%s: %.1f ms (%.1f-%.1f), %d KiB", name, 1000 * report[name]["s"], 1000 * min(times),
                 1000 * max(times), report[name]["bytes"] // 1024)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
