"""Decides whether template edits (reused activations, approximate) are offered, and with what stated
deviation.

For each mask ratio and seed: an edit of a template with one prompt records the template's
activations; an edit with another prompt reuses them (backends/core/runtime/token_subsets.py);
its image is compared with the same edit computed exactly: PSNR and SSIM of the whole image and
of the masked region apart, and the share of the transformer blocks' tokens it computed.

    python3 -m bench.micro.template_quality --work /tmp/easel-tq --out tq.json                # tiny, CPU
    python3 -m bench.micro.template_quality --work /tmp/x --model M --device cuda --size 1024 --seeds 8

Random weights (tiny by default): the figures say how much the method moves an image, not how
good a trained model's pictures look.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path

import numpy as np

from clients.bench.common import bench_parser, random_sdxl, start_logging, tiny, write_json
from clients.bench.edits import RATIOS, centered_mask

log = logging.getLogger("bench.micro.template_quality")


def main() -> None:
    p = bench_parser(__doc__, size=64, steps=20)
    p.add_argument("--model", type=Path, help="diffusers SDXL folder (default: write a tiny one; see --random-sdxl)")
    p.add_argument("--random-sdxl", action="store_true", help="write SDXL base's shapes with random fp16 weights")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="mask ratios, comma-separated")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--runtime", default="eager",
                   help="the UNet runtime (export --runtime). Eager (the default) leaves the method's own "
                        "deviation alone in the figures; on a fast runtime each edit's seconds say what reuse "
                        "saves (a share's first reusing edit includes its graphs' capture)")
    p.add_argument("--conv-subsets", action="store_true",
                   help="reusing edits also run the ResNet blocks on their mask's box (RuntimeConfig.conv_subsets)")
    p.add_argument("--cache-gib", type=int, default=64,
                   help="device memory for one recording (SDXL at 1024 px: 0.42 GB a step with guidance)")
    args = p.parse_args()
    start_logging()

    import torch

    from backends.core.engine.builder import build_runtime, warm_up
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.template_cache import TemplateCache
    from backends.core.engine.requests import DenoiseJob, EditInputs
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.placement import Placement
    from backends.core.stages.text_encoding import PromptEncoder
    from backends.core.stages.vae_decoding import LatentDecoder
    from backends.core.stages.vae_encoding import EditEncoder
    from clients.bench.image_metrics import psnr, ssim
    from export.repository import ExportOptions, export_repository

    model = args.model or (random_sdxl(args.work, args.device) if args.random_sdxl else tiny(args.work))
    ratios = [float(r) for r in args.ratios.split(",")]
    dtype = "fp32" if args.device == "cpu" else "fp16"
    repo = export_repository(model, args.work / "repo", ExportOptions(
        device="cpu" if args.device == "cpu" else "cuda", dtype=dtype, max_size=max(args.size, 64),
        runtime=args.runtime))
    where = Placement(args.device if args.device == "cpu" else "cuda:0", dtype)
    first = "denoiser" if args.device == "cpu" else "denoiser_gpu0"
    folder = repo / first / "1"
    vae = EditEncoder(repo / "vae_decoder" / "1", where)
    latent = args.size // vae.vae_scale_factor
    # Warmed as a server warms its size (compiled: its exact and reusing halves compile here, not in the timings)
    config = RuntimeConfig(kind=args.runtime, conv_subsets=args.conv_subsets,
                           warmup_sizes=((latent, latent),) if args.runtime != "eager" else (),
                           warmup_template_edits=True)
    engine = TorchDenoiser(folder, where, runtime=build_runtime(folder, where, config),
                           templates=TemplateCache(where.device, args.cache_gib << 30))
    warm_up(engine, config)
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    decoder = LatentDecoder(repo / "vae_decoder" / "1", where)
    limits = Limits(max_width=4096, max_height=4096)
    template = np.random.default_rng(1234).integers(0, 256, (args.size, args.size, 3), dtype=np.uint8)

    def edit(prompt: str, seed: int, mask: np.ndarray, name: str | None) -> tuple[np.ndarray, str | None, float]:
        params = validate({"prompt": prompt, "seed": seed, "steps": args.steps, "width": args.size,
                           "height": args.size, "strength": 1.0}, limits)
        embeds, pooled = encoder.encode(params)
        inputs = EditInputs(**vae.encode(template, mask), scaling_factor=vae.scaling_factor, strength=1.0,
                            template=name)
        start = time.perf_counter()
        with engine.on_stream():
            state = engine.start(DenoiseJob(f"{name}-{seed}", params, embeds, pooled, workflow="inpaint", edit=inputs))
            while state.index < len(state.timesteps):
                engine.step([state])
        latents = engine.result(state)  # (waits for the device)
        return decoder.decode(latents), state.template_use, time.perf_counter() - start

    rows = []
    for ratio in ratios:
        mask = centered_mask(args.size, ratio)
        region = mask > 0
        for seed in range(args.seeds):
            name = f"t{ratio}"
            edit("a wooden door in a brick wall", seed, mask, name)  # records
            subsets = engine.runtime.subsets
            before = (subsets.computed_tokens, subsets.all_tokens, subsets.conv_computed, subsets.conv_all) \
                if subsets is not None else (0, 0, 0, 0)
            reused, use, reused_s = edit("a red door with a brass knocker", seed, mask, name)
            subsets = engine.runtime.subsets
            exact, _, exact_s = edit("a red door with a brass knocker", seed, mask, None)
            computed = subsets.computed_tokens - before[0]
            row = {"mask_ratio": float(region.mean()), "seed": seed, "use": use,
                   "psnr_db": psnr(exact, reused), "ssim": ssim(exact, reused),
                   "psnr_masked_db": psnr(exact[region], reused[region]),
                   "psnr_unmasked_db": psnr(exact[~region], reused[~region]),
                   "token_share": computed / max(1, subsets.all_tokens - before[1]),
                   "conv_share": (subsets.conv_computed - before[2]) / max(1, subsets.conv_all - before[3]),
                   "reused_s": reused_s, "exact_s": exact_s}
            rows.append(row)
            log.info("mask %.2f seed %d (%s): PSNR %.2f dB (masked %.2f, unmasked %.2f), SSIM %.4f, tokens %.0f%%, "
                     "ResNet positions %.0f%%; %.3f s reused, %.3f s exact", row["mask_ratio"], seed, use,
                     row["psnr_db"], row["psnr_masked_db"], row["psnr_unmasked_db"], row["ssim"],
                     100 * row["token_share"], 100 * row["conv_share"], reused_s, exact_s)
    summary = {}
    for ratio in ratios:
        mine = [r for r in rows if r["mask_ratio"] == float((centered_mask(args.size, ratio) > 0).mean())]
        summary[str(ratio)] = {k: statistics.median(r[k] for r in mine)
                               for k in ("mask_ratio", "psnr_db", "psnr_masked_db", "psnr_unmasked_db", "ssim",
                                         "token_share", "conv_share", "reused_s", "exact_s")}
        log.info("mask %s: median %s", ratio, {k: round(v, 4) for k, v in summary[str(ratio)].items()})
    # (PSNR of identical images is infinite: null in the JSON)
    finite = [{k: (None if isinstance(v, float) and np.isinf(v) else v) for k, v in r.items()} for r in rows]
    summary = {ratio: {k: (None if np.isinf(v) else v) for k, v in s.items()} for ratio, s in summary.items()}
    write_json(args.out, {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device != "cpu" else None,
                          "size": args.size, "steps": args.steps, "seeds": args.seeds, "model": str(model),
                          "runtime": args.runtime, "conv_subsets": args.conv_subsets, "ratios": ratios,
                          "rows": finite, "median_by_ratio": summary})


if __name__ == "__main__":
    main()
