"""Decides whether the approximate pipelined ControlNet mode is offered, and with what stated deviation.

How far the pipelined ControlNet mode (step t uses residuals of step t-1's latents) lands from
the exact sync mode: PSNR and SSIM of the decoded images over several seeds.

    python3 bench/micro/controlnet_pipelined_quality.py --work /tmp/easel-pq --out pq.json            # tiny, CPU
    python3 bench/micro/controlnet_pipelined_quality.py --work /tmp/x --model M --adapters A --device cuda --size 1024

Random weights (tiny by default): the figures say how much the method moves an image, not how
good a trained model's pictures look.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import numpy as np

from clients.bench.common import bench_parser, start_logging, tiny

log = logging.getLogger("bench.micro.controlnet_pipelined_quality")


def main() -> None:
    p = bench_parser(__doc__, size=64, steps=20)
    p.add_argument("--model", type=Path, help="diffusers SDXL folder (default: write a tiny one)")
    p.add_argument("--adapters", type=Path, help="adapter store (default: the tiny one's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seeds", type=int, default=4)
    args = p.parse_args()
    start_logging()

    from PIL import Image

    from backends.core.adapters.store import AdapterStore
    from backends.core.adapters.controlnet import ControlInput, LocalControlNets
    from backends.core.adapters.controlnet_cache import ControlNetCache
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from clients.bench.image_metrics import psnr, ssim
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.placement import Placement
    from backends.core.stages.text_encoding import PromptEncoder
    from backends.core.stages.vae_decoding import LatentDecoder
    from export.repository import ExportOptions, export_repository

    model = args.model or tiny(args.work, adapters=True)
    store = AdapterStore(args.adapters or model / "adapters")
    dtype = "fp32" if args.device == "cpu" else "fp16"
    repo = export_repository(model, args.work / "repo", ExportOptions(
        device="cpu" if args.device == "cpu" else "cuda", dtype=dtype, max_size=max(args.size, 64)))
    where = Placement(args.device if args.device == "cpu" else "cuda:0", dtype)
    first = "denoiser" if args.device == "cpu" else "denoiser_gpu0"
    engine = TorchDenoiser(repo / first / "1", where, LocalControlNets(ControlNetCache(store, where, 2**40)))
    encoder = PromptEncoder(repo / "text_encoder" / "1", where)
    decoder = LatentDecoder(repo / "vae_decoder" / "1", where)
    names = sorted(store.controlnets)[:2]

    def image(seed: int, mode: str) -> np.ndarray:
        engine.controls.mode = mode
        params = validate({"prompt": "a house by a lake", "seed": seed, "steps": args.steps,
                           "width": args.size, "height": args.size}, Limits(max_width=4096, max_height=4096))
        embeds, pooled = encoder.encode(params)
        hints = [Image.fromarray(np.random.default_rng(seed + i).integers(0, 256, (args.size, args.size, 3),
                                                                          dtype=np.uint8)) for i in range(len(names))]
        controls = [ControlInput(n, h, 0.8) for n, h in zip(names, hints)]
        state = engine.start(DenoiseJob(str(seed), params, embeds, pooled, controls=controls))
        while state.index < len(state.timesteps):
            engine.step([state])
        return decoder.decode(engine.result(state))

    rows = []
    for seed in range(args.seeds):
        exact, approx = image(seed, "sync"), image(seed, "pipelined")
        rows.append({"seed": seed, "psnr_db": psnr(exact, approx), "ssim": ssim(exact, approx)})
        log.info("seed %d: PSNR %.2f dB, SSIM %.4f", seed, rows[-1]["psnr_db"], rows[-1]["ssim"])
    report = {"device": args.device, "size": args.size, "steps": args.steps, "controlnets": names, "rows": rows,
              "psnr_db_median": statistics.median(r["psnr_db"] for r in rows),
              "ssim_median": statistics.median(r["ssim"] for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("pipelined vs sync over %d seeds: PSNR median %.2f dB, SSIM median %.4f", args.seeds,
             report["psnr_db_median"], report["ssim_median"])


if __name__ == "__main__":
    main()
