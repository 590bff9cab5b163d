"""Where does an e4m3 convolution pay? Each distinct convolution of SDXL's UNet at one size (2 rows:
one request with guidance), compiled as the runtime compiles it, fp16 (cuDNN) against
runtime/fp8.Fp8Conv2d (its input cast and laid out as patches in one byte, then one e4m3 product),
both behind the SiLU that precedes them in the ResNet blocks so that the cast fuses as it does in the
UNet. Reports each shape's GPU time both ways, how often a step runs it, its error against the
fp32 convolution, and the step's total both ways: per-shape evidence for which convolutions the
runtime's FP8 should take.

    python3 -m bench.fp8_conv_micro --work /tmp/easel-micro --out $OUT/fp8_conv_micro.json
"""

from __future__ import annotations

import logging
import statistics
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from bench.common import bench_parser, rel_rms, start_logging, write_json
from bench.runtime_micro import gpu_ms

log = logging.getLogger("bench.fp8_conv_micro")


def sdxl_convolutions(size: int) -> Counter:
    """(side, in, out, kernel, stride) -> how many a step runs: the convolutions use_fp8 takes
    (fp8.convolution_slots) of SDXL base at `size` px (side: the input's)."""
    from diffusers import UNet2DConditionModel

    from backends.core.runtime.fp8 import convertible, convolution_slots, fits_e4m3
    from export.tiny import unet_kwargs

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_kwargs("sdxl"))
    found: Counter = Counter()

    def note(module, args):
        x = args[0]
        found[(x.shape[-1], module.in_channels, module.out_channels, module.kernel_size[0], module.stride[0])] += 1

    convs = (getattr(owner, name, None) for owner, name in convolution_slots(unet))
    hooks = [m.register_forward_pre_hook(note) for m in convs
             if type(m) is nn.Conv2d and convertible(m) and fits_e4m3(m.weight)]
    latent = size // 8
    with torch.device("meta"), torch.no_grad():
        unet(torch.empty(2, 4, latent, latent), torch.empty(2), torch.empty(2, 77, 2048),
             added_cond_kwargs={"text_embeds": torch.empty(2, 1280), "time_ids": torch.empty(2, 6)})
    for h in hooks:
        h.remove()
    return found


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=0, work_help="folder for the compile cache")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--fast-accum", action="store_true", help="cuBLAS's fast accumulation (RuntimeConfig.fp8_fast_accum)")
    args = p.parse_args()
    start_logging()

    from backends.core.runtime.compile_cache import use_compile_cache
    from backends.core.runtime.fp8 import Fp8Conv2d, calibrating

    use_compile_cache(args.work / "fp8_conv_micro_cache")
    shapes = sdxl_convolutions(args.size)
    dev = torch.device("cuda:0")
    report = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "size": args.size, "rows": 2,
              "fast_accum": args.fast_accum, "shapes": []}
    g = torch.Generator(device=dev).manual_seed(0)
    for (side, cin, cout, k, stride), count in sorted(shapes.items()):
        conv = nn.Conv2d(cin, cout, k, stride=stride, padding=k // 2).to(dev, torch.float16)
        conv = conv.to(memory_format=torch.channels_last)
        x = torch.randn(2, cin, side, side, device=dev, dtype=torch.float16, generator=g)
        x = x.contiguous(memory_format=torch.channels_last)
        fp8 = Fp8Conv2d(conv)
        fp8.fast_accum = args.fast_accum
        with torch.no_grad(), calibrating([fp8]):
            fp8(F.silu(x))
        fp16_fn = torch.compile(lambda t: conv(F.silu(t)))
        fp8_fn = torch.compile(lambda t: fp8(F.silu(t)))
        with torch.inference_mode():
            ms16 = statistics.median(gpu_ms(lambda: fp16_fn(x), args.iters))
            ms8 = statistics.median(gpu_ms(lambda: fp8_fn(x), args.iters))
            exact = F.conv2d(F.silu(x.float()), conv.weight.float(), conv.bias.float(), stride, k // 2)
            error16, error8 = rel_rms(fp16_fn(x), exact), rel_rms(fp8_fn(x), exact)
        flops = 2 * exact.numel() * cin * k * k
        entry = {"side": side, "in": cin, "out": cout, "kernel": k, "stride": stride, "per_step": count,
                 "fp16_ms": ms16, "fp8_ms": ms8, "ratio": ms8 / ms16, "fp16_tflops": flops / ms16 / 1e9,
                 "fp8_tflops": flops / ms8 / 1e9, "fp16_rel_rms": error16, "fp8_rel_rms": error8}
        report["shapes"].append(entry)
        log.info("%3d px %4d->%4d k%d s%d x%d: fp16 %.3f ms (%.0f TFLOP/s), fp8 %.3f ms (%.0f), %.2fx; error %.4f / %.4f",
                 side, cin, cout, k, stride, count, ms16, entry["fp16_tflops"], ms8, entry["fp8_tflops"],
                 entry["ratio"], error16, error8)
        torch._dynamo.reset()  # each shape's two functions compiled on their own
        write_json(args.out, report)
    total16 = sum(s["fp16_ms"] * s["per_step"] for s in report["shapes"])
    total8 = sum(s["fp8_ms"] * s["per_step"] for s in report["shapes"])
    best = sum(min(s["fp16_ms"], s["fp8_ms"]) * s["per_step"] for s in report["shapes"])
    report.update(step_fp16_ms=total16, step_fp8_ms=total8, step_best_ms=best)
    log.info("a step's convolutions: fp16 %.2f ms, fp8 %.2f ms, each shape's faster %.2f ms", total16, total8, best)
    write_json(args.out, report)


if __name__ == "__main__":
    main()
