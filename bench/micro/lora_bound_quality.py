"""Decides the LoRA bound's default (how many steps a request may run before its LoRAs merge).

How far a LoRA merged late (at step k instead of before step 0, as bounded asynchronous
loading may do) lands from the exact result: PSNR and SSIM of decoded images over seeds.

    python3 bench/micro/lora_bound_quality.py --work /tmp/easel-lq --out lq.json      # tiny, CPU

Tiny random weights by default: the figures say how much the method moves an image.
"""

from __future__ import annotations

import json
import logging
import statistics

from clients.bench.common import bench_parser, start_logging, tiny

log = logging.getLogger("bench.micro.lora_bound_quality")


def main() -> None:
    p = bench_parser(__doc__, size=64, steps=20)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--bounds", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args()
    start_logging()

    from backends.core.adapters.store import AdapterStore
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from clients.bench.image_metrics import psnr, ssim
    from backends.core.adapters.lora import load_lora
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.placement import Placement
    from backends.core.stages.text_encoding import PromptEncoder
    from backends.core.stages.vae_decoding import LatentDecoder
    from export.repository import ExportOptions, export_repository

    model = tiny(args.work, adapters=True)
    store = AdapterStore(model / "adapters")
    repo = export_repository(model, args.work / "repo", ExportOptions())
    engine = TorchDenoiser(repo / "denoiser" / "1", Placement())
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    decoder = LatentDecoder(repo / "vae_decoder" / "1", Placement())
    loras = tuple((load_lora(n, store.lora(n).path), 1.0) for n in sorted(store.loras))

    def image(seed: int, merge_at: int):
        params = validate({"prompt": "a fox in snow", "seed": seed, "steps": args.steps, "width": args.size,
                           "height": args.size}, Limits())
        embeds, pooled = encoder.encode(params)
        state = engine.start(DenoiseJob(str(seed), params, embeds, pooled))
        while state.index < len(state.timesteps):
            if state.index == merge_at:
                state.job.loras = loras
            engine.step([state])
        return decoder.decode(engine.result(state))

    rows = []
    for seed in range(args.seeds):
        exact = image(seed, 0)
        for k in args.bounds:
            late = image(seed, k)
            rows.append({"seed": seed, "merged_at_step": k, "psnr_db": psnr(exact, late), "ssim": ssim(exact, late)})
    summary = {k: {"psnr_db_median": statistics.median(r["psnr_db"] for r in rows if r["merged_at_step"] == k),
                   "ssim_median": statistics.median(r["ssim"] for r in rows if r["merged_at_step"] == k)}
               for k in args.bounds}
    for k, s in summary.items():
        log.info("LoRAs %s merged at step %d of %d: PSNR %.2f dB, SSIM %.4f (median of %d seeds)",
                 [n for n in sorted(store.loras)], k, args.steps, s["psnr_db_median"], s["ssim_median"], args.seeds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": "cpu", "steps": args.steps, "size": args.size, "rows": rows,
                                    "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
