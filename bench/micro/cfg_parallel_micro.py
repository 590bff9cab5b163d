"""Decides whether latent parallelism (the two halves of guidance on two GPUs) pays for its copies.

Latent parallelism in process (no server): one GPU against a GPU pair, SDXL-base shapes with
random fp16 weights, same run.

For each setup (the one-GPU runtime with guidance's two rows on it; the pair, one row on each
GPU): steady-state engine step time (TorchDenoiser.step issued back to back) at 1 and 4 requests
with guidance, and whole requests (start, every step, latents on the host) timed one after the
other. The pair's final latents are decoded and compared with the one-GPU image (PSNR): both are
the exact method, so only fp16 rounding of other row counts separates them.

    python3 -m bench.micro.cfg_parallel_micro --work /tmp/easel-micro --out $OUT/cfg_parallel_micro.json
"""

from __future__ import annotations

import logging
import statistics
import time

from clients.bench.common import bench_parser, random_sdxl_denoiser, start_logging, write_json

log = logging.getLogger("bench.micro.cfg_parallel_micro")


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--runtime", choices=("graphs", "compiled"), default="compiled")
    p.add_argument("--runs", type=int, default=5, help="whole requests per setup")
    p.add_argument("--iters", type=int, default=20, help="steps timed back to back per batch size")
    p.add_argument("--pair", default="0:1", help="the GPU pair")
    args = p.parse_args()
    start_logging()

    import numpy as np
    import torch

    from backends.core.engine.builder import build_runtime, template_batch
    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.requests import DenoiseJob
    from backends.core.request.params import Limits, validate
    from backends.core.runtime.config import RuntimeConfig
    from backends.core.runtime.placement import Placement
    from clients.bench.image_metrics import psnr
    from backends.core.stages.vae_decoding import LatentDecoder

    first, second = (int(g) for g in args.pair.split(":"))
    folder = random_sdxl_denoiser(args.work)
    where = Placement(f"cuda:{first}", "fp16")
    latent = args.size // 8
    limits = Limits(max_steps=1000, max_width=args.size, max_height=args.size)
    report = {"gpu": torch.cuda.get_device_name(first), "gpus": [first, second], "torch": torch.__version__,
              "size": args.size, "steps": args.steps, "runtime": args.runtime, "setups": {}}
    cross = None
    images = {}
    for name, buckets, other in (("one_gpu", (2, 8), None), ("gpu_pair", (1, 4), f"cuda:{second}")):
        start = time.perf_counter()
        runtime = build_runtime(folder, where, RuntimeConfig(kind=args.runtime, row_buckets=buckets), other)
        engine = TorchDenoiser(folder, where, runtime=runtime)
        with engine.on_stream():
            warm_s = runtime.warmup(template_batch(engine.unet, engine.device, engine.dtype), [(latent, latent)])
        log.info("%s: loaded and warmed up in %.1f s (capture/compile %.1f s)", name, time.perf_counter() - start,
                 warm_s)
        cross = cross or engine.unet.config.cross_attention_dim
        entry = report["setups"][name] = {"warmup_s": warm_s, "row_buckets": list(buckets)}

        def job(i, steps):
            params = validate({"prompt": "x", "steps": steps, "width": args.size, "height": args.size, "seed": i,
                               "scheduler": "euler", "guidance_scale": 5.0}, limits)
            g = torch.Generator().manual_seed(i)
            return DenoiseJob(f"r{i}", params, torch.randn(2, 77, cross, generator=g).half().numpy(),
                              torch.randn(2, 1280, generator=g).half().numpy())

        with engine.on_stream(), torch.inference_mode():
            for requests in (1, 4):
                states = [engine.start(job(i, 1000)) for i in range(requests)]
                for _ in range(3):
                    engine.step(states)
                torch.cuda.synchronize(engine.device)
                begin = time.perf_counter()
                for _ in range(args.iters):
                    engine.step(states)
                engine.result(states[0])  # waits for the loop's stream
                ms = (time.perf_counter() - begin) * 1000 / args.iters
                entry[f"step_ms_{requests}_requests"] = ms
                log.info("%s: %d request(s) with guidance: %.2f ms a step", name, requests, ms)
            seconds = []
            for run in range(args.runs):
                begin = time.perf_counter()
                state = engine.start(job(7, args.steps))
                while state.index < len(state.timesteps):
                    engine.step([state])
                latents = engine.result(state)
                seconds.append(time.perf_counter() - begin)
            entry["request_s"] = seconds
            entry["request_p50_s"] = statistics.median(seconds)
            log.info("%s: %d-step request %.3f s (p50 of %d: %s)", name, args.steps, entry["request_p50_s"],
                     args.runs, ", ".join(f"{s:.3f}" for s in seconds))
        images[name] = latents
        del engine, runtime
        torch.cuda.empty_cache()
        write_json(args.out, report)  # after each setup: the next may not finish

    vae = LatentDecoder(folder.parent.parent / "vae_decoder" / "1", where)
    one, two = (vae.decode(images[n]) for n in ("one_gpu", "gpu_pair"))
    a, b = report["setups"]["one_gpu"], report["setups"]["gpu_pair"]
    report["latents_max_rel_error"] = float(np.abs(images["gpu_pair"] - images["one_gpu"]).max()
                                            / np.abs(images["one_gpu"]).max())
    report["psnr_db_pair_vs_one_gpu"] = psnr(two, one)
    report["speedup_request"] = a["request_p50_s"] / b["request_p50_s"]
    for requests in (1, 4):
        report[f"speedup_step_{requests}_requests"] = a[f"step_ms_{requests}_requests"] / b[f"step_ms_{requests}_requests"]
    log.info("pair vs one GPU: request %.2fx, step %.2fx (1 request) / %.2fx (4); PSNR %.1f dB",
             report["speedup_request"], report["speedup_step_1_requests"], report["speedup_step_4_requests"],
             report["psnr_db_pair_vs_one_gpu"])
    write_json(args.out, report)


if __name__ == "__main__":
    main()
