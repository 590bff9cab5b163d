"""Decides which kernels of a step to fuse or replace next, and inductor's options.

Where a UNet step's GPU time goes, by kind of kernel: matrix products, convolutions, attention,
norms, layout changes, inductor's fused kernels, other element-wise work. SDXL-base shapes with
random fp16 weights, one request with guidance (2 rows) by default, in process (no server).

For each runtime variant (as bench/micro/runtime_micro.py names them: `graphs+fused`, `compiled+cl`, ...)
the step is timed as the runtime replays it (CUDA events, median), and its kernels are profiled
unreplayed (the same modules, or the same compiled functions, called directly) so that each kernel
shows under its own name. Each category's share is printed beside the FLOP floor of the step.

`+reuseR` (graphs or compiled) profiles a template edit's reusing step instead, timed beside the
same runtime's exact step (`exact_step_ms`; the reusing forms are warmed up with the runtime): every
row reuses a recording of the step itself (recorded eagerly first) and computes the tokens of a
centered mask of ratio R (runtime/token_subsets.py), as the runtime replays it (the static token
subsets' CUDA graphs, their buffers filled before each replay) and unreplayed (the functions those
graphs captured, on the same static subsets): what a reusing step costs and where its time goes.
`+boxes` runs the ResNet blocks of the reusing step on the mask's box (RuntimeConfig.conv_subsets).

    python3 -m bench.micro.step_profile --work /tmp/easel-micro --out $OUT/step_profile.json --kinds graphs+fused,compiled
    python3 -m bench.micro.step_profile --kinds compiled,graphs,compiled+reuse0.05,compiled+reuse0.2
    python3 -m bench.micro.step_profile --kinds compiled+cl+reuse0.2,compiled+cl+reuse0.2+boxes
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import defaultdict
from contextlib import nullcontext
from pathlib import Path

from clients.bench.common import bench_parser, random_sdxl_denoiser, random_sdxl_fp8_calibration, run_key, start_logging
from export.profile_template import gpu_ms

log = logging.getLogger("bench.micro.step_profile")

# First match wins: order matters. inductor names its kernels after the ops they fuse
# ("triton_poi_fused_add_convolution_..."), cuDNN's convolutions also say "xmma", GEMMs "cutlass".
CATEGORIES = (
    ("fused (triton)", ("triton_", "_geglu", "_partial_stats", "_stats", "_finalize", "_apply", "_bias_residual")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("layout", ("nchwtonhwc", "nhwctonchw", "transpose", "copy_kernel", "permute")),
    ("conv", ("conv", "fprop", "implicit_gemm", "winograd", "dgrad")),
    ("gemm", ("gemm", "nvjet", "cutlass", "cublas", "splitk", "xmma")),
    ("norm", ("group_norm", "groupnorm", "layer_norm", "layernorm", "gn_silu", "rowwise_moments", "batch_norm")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "cat", "fill", "index")),
)


# Variant options that set one of inductor's knobs (before its compile, back to the default after).
INDUCTOR_OPTIONS = {"aggr": "aggressive_fusion", "combo": "combo_kernels", "mm1x1": "conv_1x1_as_mm",
                    "cdt": "coordinate_descent_tuning", "mmtune": "max_autotune_gemm",
                    "pdl": "triton.enable_pdl"}


def _knob(config, dotted: str):
    """The object that holds an inductor knob (`triton.enable_pdl` lives in `config.triton`) and its name."""
    *parents, name = dotted.split(".")
    for parent in parents:
        config = getattr(config, parent)
    return config, name


def category(kernel: str) -> str:
    name = kernel.lower()
    for cat, keys in CATEGORIES:
        if any(k in name for k in keys):
            return cat
    return "other"


def kernel_profile(fn, iters: int) -> tuple[dict[str, float], list[tuple[str, float]], int]:
    """GPU milliseconds per call of `fn` by category, every kernel (heaviest first), kernels per call."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    by_cat: dict[str, float] = defaultdict(float)
    kernels = []
    launches = 0
    for evt in prof.key_averages():
        if evt.device_type != DeviceType.CUDA:
            continue
        launches += evt.count
        ms = evt.self_device_time_total / 1000 / iters
        by_cat[category(evt.key)] += ms
        kernels.append((evt.key[:160], ms))
    kernels.sort(key=lambda k: -k[1])
    return dict(sorted(by_cat.items(), key=lambda kv: -kv[1])), kernels, launches // iters


def plot(report_path: Path) -> Path:
    """A stacked bar per variant: each category's kernel time, and the gaps between kernels up to
    the replayed step's time. Written beside the JSON as <name>.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(report_path.read_text())
    variants = report["variants"]
    cats = [c for c, _ in CATEGORIES] + ["other"]
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(variants) + 2.6))
    colors = plt.get_cmap("tab10")
    for y, (name, v) in enumerate(variants.items()):
        left = 0.0
        parts = [(c, v["by_category_ms"].get(c, 0.0)) for c in cats]
        parts.append(("between kernels", max(0.0, v["step_ms"] - v["kernel_ms"])))
        for i, (cat, ms) in enumerate(parts):
            ax.barh(y, ms, left=left, color=colors(i) if cat != "between kernels" else "lightgrey",
                    label=cat if y == 0 else None)
            left += ms
        ax.text(left + 0.3, y, f"{v['step_ms']:.1f} ms", va="center")
    ax.set_xlim(0, 1.12 * max(v["step_ms"] for v in variants.values()))
    ax.set_yticks(range(len(variants)), list(variants))
    ax.invert_yaxis()
    ax.set_xlabel("GPU time of one UNet step (ms)")
    ax.set_title(f"Where a step goes: SDXL UNet, {report['size']} px, {report['rows']} rows, fp16, {report['gpu']}")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5, fontsize="small", frameon=False)
    fig.tight_layout()
    png = report_path.with_suffix(".png")
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return png


def reusing_layout(eager, batch, ratio: float):
    """A step's token layout where each row of `batch` reuses a recording of that very step (made
    by `eager`, the ResNet blocks' too where it runs them on boxes) at a centered mask of `ratio`,
    and the share of tokens it computes."""
    import torch

    from backends.core.runtime.conv_subsets import masked_boxes
    from backends.core.runtime.token_subsets import (RECORD, REUSE, TemplateActivations, TokenLayout, TokenRow,
                                                     computed_tokens, token_share)
    from export.profile_template import centered_mask

    record = TemplateActivations(batch.rows, complete=True)
    batch.tokens = TokenLayout(tuple(TokenRow(RECORD, record, 0, r) for r in range(batch.rows)))
    eager.decode(batch, eager.encode(batch), None)
    latent = batch.latent_shape[0]
    mask = torch.from_numpy(centered_mask(latent, ratio) / 255.0)[None, None]
    levels = len(eager.weights_module.config.block_out_channels)
    computed = computed_tokens(mask.to(batch.sample.device), levels)
    boxes = masked_boxes(mask, levels)
    return TokenLayout(tuple(TokenRow(REUSE, record, 0, r, computed, boxes) for r in range(batch.rows))), \
        token_share(computed)


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=0)
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--kinds", default="graphs+fused,compiled",
                   help="eager, graphs or compiled, each optionally +cl (channels_last), +fused, +cudnn (attention), "
                        "+unpacked (no packed attention projections), +lt (cuBLASLt), +bench (cudnn.benchmark: "
                        "convolution algorithms timed, not guessed), +fp8 (RuntimeConfig.fp8: every part), +reuseR "
                        "(a template edit's reusing step at mask ratio R, graphs and compiled), +boxes (with +reuseR: "
                        "the ResNet blocks on the mask's box, RuntimeConfig.conv_subsets), and for "
                        "compiled inductor's "
                        + ", ".join(f"+{k} ({v})" for k, v in INDUCTOR_OPTIONS.items()))
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.engine.builder import template_batch
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.config import FP8_PARTS, RuntimeConfig
    from backends.core.runtime.placement import Placement
    from backends.core.runtime.torch_eager import EagerUNetRuntime
    from backends.core.runtime.torch_fast import FastUNetRuntime, _resized

    folder = random_sdxl_denoiser(args.work)
    calibration = None
    if any("fp8" in name.split("+") for name in args.kinds.split(",")):
        calibration = random_sdxl_fp8_calibration(args.work, args.size)
    where = Placement("cuda:0", "fp16")
    latent = args.size // 8
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size, "rows": args.rows,
              "variants": {}}
    for name in args.kinds.split(","):
        kind, *options = name.split("+")
        reuse = next((float(o[len("reuse"):]) for o in options if o.startswith("reuse")), None)
        # +cudnn: SDPA may not pick flash or memory-efficient attention, so cuDNN's (Hopper) serves it.
        torch.backends.cuda.enable_flash_sdp("cudnn" not in options)
        torch.backends.cuda.enable_mem_efficient_sdp("cudnn" not in options)
        torch.backends.cudnn.benchmark = "bench" in options
        import torch._dynamo
        import torch._inductor.config as inductor

        # Dynamo keeps compiled code per function, not per torch.compile call: without a reset a
        # later variant replays the first one's kernels whatever its inductor knobs say.
        torch._dynamo.reset()

        knobs = [(holder, knob, getattr(holder, knob))  # (where it lives, its name, its default)
                 for holder, knob in (_knob(inductor, INDUCTOR_OPTIONS[o]) for o in options if o in INDUCTOR_OPTIONS)]
        for holder, knob, _ in knobs:
            setattr(holder, knob, True)
        # +lt: cuBLASLt instead of cuBLAS for the products outside inductor's kernels.
        torch.backends.cuda.preferred_blas_library("cublaslt" if "lt" in options else "cublas")
        eager = EagerUNetRuntime(*load_unet_halves(folder, where))
        template = template_batch(eager.weights_module, torch.device("cuda:0"), torch.float16)
        batch = _resized(template, args.rows, latent, latent)
        entry = report["variants"][run_key(report["variants"], name)] = {}
        if kind == "eager":
            runtime, enc_fn, dec_fn = eager, eager.encoder, eager.decoder
            if set(options) - {"cudnn"}:
                raise SystemExit(f"{name}: +cl, +fused and +reuse apply to graphs and compiled only")
        else:
            runtime = FastUNetRuntime(eager, RuntimeConfig(kind=kind, row_buckets=(args.rows,),
                                                           channels_last="cl" in options,
                                                           fused_kernels="fused" in options,
                                                           packed_attention="unpacked" not in options,
                                                           fp8=FP8_PARTS if "fp8" in options else (),
                                                           warmup_template_edits=reuse is not None,
                                                           conv_subsets="boxes" in options),
                                      cache_root=args.work / "cache", fp8_calibration=calibration)
            start = time.perf_counter()
            runtime.warmup(template, [(latent, latent)])
            entry["warmup_s"] = time.perf_counter() - start
            enc_fn, dec_fn = runtime.enc_fn, runtime.dec_fn
            if "cl" in options:
                batch.sample = batch.sample.contiguous(memory_format=torch.channels_last)
        # One request's steps: its text (and so its packed K/V projections) is the same at each.
        batch.text_key = ("one request",)
        with torch.inference_mode():
            if reuse is not None:  # beside the same runtime's exact step (same compile, same run)
                exact = gpu_ms(lambda: runtime.decode(batch, runtime.encode(batch), None), args.iters)
                entry.update(exact_step_ms=statistics.median(exact), exact_step_ms_all=exact)
                batch.tokens, entry["token_share"] = reusing_layout(eager, batch, reuse)
            step = gpu_ms(lambda: runtime.decode(batch, runtime.encode(batch), None), args.iters)
            text = runtime.text_input(batch) if kind != "eager" else batch.text

            if reuse is not None:  # what the reusing graphs captured, on their static token subsets
                bucket = runtime._subset_bucket(batch)
                enc_fn, dec_fn, _ = runtime._halves(bucket)
                batch, text = bucket, bucket.text

            def unreplayed():
                with nullcontext() if reuse is None else runtime._layout(bucket):
                    emb, mid, skips = enc_fn(batch.sample, batch.timestep, text, batch.pooled, batch.time_ids)
                    return dec_fn(emb, mid, skips, text, None, None)

            by_cat, kernels, launches = kernel_profile(unreplayed, 3)
        total = sum(by_cat.values())
        # The replayed step less its kernels' own time: what the GPU spends between kernels.
        gap_us = 1000 * (statistics.median(step) - total) / launches
        entry.update(step_ms=statistics.median(step), step_ms_all=step, kernel_ms=total, by_category_ms=by_cat,
                     kernels=launches, gap_us_per_kernel=gap_us, kernel_ms_by_name=kernels)
        log.info("%s: step %.2f ms (replayed%s), %d kernels %.2f ms (%.2f us between kernels): %s", name,
                 entry["step_ms"], f"; exact {entry['exact_step_ms']:.2f} ms" if "exact_step_ms" in entry else "",
                 launches, total, gap_us,
                 ", ".join(f"{c} {ms:.2f} ({100 * ms / total:.0f}%)" for c, ms in by_cat.items()))
        for k, ms in kernels[:12]:
            log.info("    %.3f ms  %s", ms, k)
        for holder, knob, default in knobs:
            setattr(holder, knob, default)
        del runtime, eager, enc_fn, dec_fn
        torch.cuda.empty_cache()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2))  # after each variant: a later one may not finish
    log.info("wrote %s and %s", args.out, plot(args.out))


if __name__ == "__main__":
    main()
