"""End-to-end latency of SDXL-size requests through the Easel server, against diffusers' own
pipeline on the same weights in the same run (so the ratio, not the absolute, is the figure).

The weights are random (no model hub here) but every shape is SDXL base's: the cost is real.
Writes a JSON report; prints a summary. Meant for a GPU machine:

    python3 bench/e2e_sdxl.py --work /tmp/easel-bench --out $OUT/e2e_sdxl.json
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

from bench.common import bench_parser, random_sdxl, start_logging

log = logging.getLogger("bench.e2e_sdxl")


def time_diffusers(model: Path, size: int, steps: int, runs: int) -> list[float]:
    import torch
    from diffusers import StableDiffusionXLPipeline

    pipe = StableDiffusionXLPipeline.from_pretrained(model, dtype=torch.float16, add_watermarker=False).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    pipe("warm up", width=size, height=size, num_inference_steps=2)
    out = []
    for i in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        pipe("a yellow car", width=size, height=size, num_inference_steps=steps,
             generator=torch.Generator("cpu").manual_seed(i))
        torch.cuda.synchronize()
        out.append(time.perf_counter() - start)
    del pipe
    torch.cuda.empty_cache()
    return out


def time_server(repo: Path, size: int, steps: int, runs: int) -> tuple[list[float], list[dict]]:
    from clients.client import EaselClient
    from clients.serve import TritonServer

    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900) as server:
        # gRPC: the GPU image has grpcio but not gevent, which tritonclient's HTTP client needs.
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            client.generate("warm up", width=size, height=size, steps=2, seed=0)
            latencies, infos = [], []
            for i in range(runs):
                start = time.perf_counter()
                result = client.generate("a yellow car", width=size, height=size, steps=steps, seed=i)
                latencies.append(time.perf_counter() - start)
                infos.append(result.info)
    return latencies, infos


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    start_logging()

    from export.repository import ExportOptions, export_repository

    repo = args.work / "repo"
    t0 = time.perf_counter()
    model = random_sdxl(args.work)
    t1 = time.perf_counter()
    export_repository(model, repo, ExportOptions(device="cuda", dtype="fp16", gpus=(0,), max_size=args.size))
    t2 = time.perf_counter()
    log.info("model written in %.1fs, exported in %.1fs", t1 - t0, t2 - t1)

    baseline = time_diffusers(model, args.size, args.steps, args.runs)
    served, infos = time_server(repo, args.size, args.steps, args.runs)
    stages = {k: statistics.median(i["stages_s"][k] for i in infos) for k in infos[0]["stages_s"]}
    report = {
        "device": "cuda", "dtype": "fp16", "size": args.size, "steps": args.steps, "runs": args.runs,
        "diffusers_e2e_s": baseline, "easel_e2e_s": served,
        "easel_over_diffusers": statistics.median(served) / statistics.median(baseline),
        "easel_stages_median_s": stages, "easel_infos": infos,
        "write_model_s": t1 - t0, "export_s": t2 - t1,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("diffusers e2e median %.3fs, easel e2e median %.3fs (ratio %.3f); easel stages %s",
             statistics.median(baseline), statistics.median(served), report["easel_over_diffusers"],
             {k: round(v, 3) for k, v in stages.items()})


if __name__ == "__main__":
    main()
