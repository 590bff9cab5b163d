"""Decides where the ControlNet service runs (its own GPU or the UNet's), against the Gustafson ideal.

ControlNet-as-a-Service on GPUs: e2e latency with 0, 1 and 2 ControlNets (SDXL-size UNet and
ControlNets, random weights), with the ControlNet service on its own GPU and on the UNet's GPU,
against diffusers' StableDiffusionXLControlNetPipeline (serial) in the same run.

    python3 bench/micro/controlnet_sdxl.py --work /tmp/easel-cn --out $OUT/controlnet_sdxl.json

Needs two GPUs for the "own GPU" placement. Prints a summary and Gustafson's ideal speedup from
the measured per-step parts (serial: decoder half; parallel: encoder half and ControlNets).
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import statistics
import time
from pathlib import Path


from clients.bench.adapters import control_png
from clients.clients.bench.common import bench_parser, random_sdxl, start_logging, write_controlnets

log = logging.getLogger("bench.micro.controlnet_sdxl")
NAMES = ("canny", "depth")


def time_diffusers(model: Path, store: Path, size: int, steps: int, runs: int) -> dict[int, list[float]]:
    import torch
    from diffusers import (ControlNetModel, MultiControlNetModel, StableDiffusionXLControlNetPipeline,
                           StableDiffusionXLPipeline)
    from PIL import Image

    base = StableDiffusionXLPipeline.from_pretrained(model, dtype=torch.float16, add_watermarker=False).to("cuda")
    nets = [ControlNetModel.from_pretrained(store / "controlnets" / n, dtype=torch.float16).to("cuda") for n in NAMES]
    images = [Image.open(io.BytesIO(control_png(size, i))) for i in range(len(NAMES))]
    out: dict[int, list[float]] = {}
    for count in (0, 1, 2):
        if count == 0:
            pipe, extra = base, {}
        else:
            cn = nets[0] if count == 1 else MultiControlNetModel(nets[:count])
            pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=cn, add_watermarker=False)
            extra = {"image": images[0] if count == 1 else images[:count]}
        pipe.set_progress_bar_config(disable=True)
        pipe("warm up", width=size, height=size, num_inference_steps=2, **extra)
        out[count] = []
        for i in range(runs):
            torch.cuda.synchronize()
            start = time.perf_counter()
            pipe("a house", width=size, height=size, num_inference_steps=steps,
                 generator=torch.Generator("cpu").manual_seed(i), **extra)
            torch.cuda.synchronize()
            out[count].append(time.perf_counter() - start)
    del base, nets, pipe
    torch.cuda.empty_cache()
    return out


CALL_METRICS = ("easel_controlnet_calls_total", "easel_controlnet_call_seconds_total",
                "easel_controlnet_wait_seconds_total", "easel_controlnet_compute_seconds_total")


def time_server(repo: Path, size: int, steps: int, runs: int, extra_args=()) -> dict[int, dict]:
    from clients.client import EaselClient
    from clients.serve import TritonServer, metric_totals

    images = tuple(control_png(size, i) for i in range(len(NAMES)))
    out: dict[int, dict] = {}
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900,
                      extra_args=tuple(extra_args)) as server:
        with EaselClient(server.url_grpc, protocol="grpc") as client:  # the GPU image lacks gevent (HTTP)
            for count in (0, 1, 2):
                controls = dict(controlnets=NAMES[:count], control_images=images[:count]) if count else {}
                client.generate("warm up", width=size, height=size, steps=2, seed=0, **controls)
                latencies, infos = [], []
                before = metric_totals(server.metrics_port, CALL_METRICS)
                for i in range(runs):
                    start = time.perf_counter()
                    infos.append(client.generate("a house", width=size, height=size, steps=steps, seed=i,
                                                 **controls).info)
                    latencies.append(time.perf_counter() - start)
                after = metric_totals(server.metrics_port, CALL_METRICS)
                delta = {k.removeprefix("easel_controlnet_"): after[k] - before[k] for k in CALL_METRICS}
                calls = delta.pop("calls_total")
                out[count] = {"e2e_s": latencies, "denoise_s": [i["stages_s"]["denoise_s"] for i in infos],
                              # per ControlNet call: BLS wall time, the service's own time, and the
                              # decoder half's wait (per call of the step that waited)
                              "per_call_s": {k.removesuffix("_total"): v / calls for k, v in delta.items()}
                              if calls else {}}
                log.info("%dC: e2e %s per call %s", count, [round(x, 3) for x in latencies],
                         {k: round(v * 1e3, 1) for k, v in out[count]["per_call_s"].items()})
    return out


def step_parts(model: Path, store: Path, size: int) -> dict[str, float]:
    """Per-step times of the parts (CUDA events, batch 2 = one CFG step): for Gustafson's law."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from backends.core.runtime.unet_split import split_unet

    unet = UNet2DConditionModel.from_pretrained(model / "unet", dtype=torch.float16).to("cuda").eval()
    cn = ControlNetModel.from_pretrained(store / "controlnets" / NAMES[0], dtype=torch.float16).to("cuda").eval()
    enc, dec = split_unet(unet)
    h = size // 8
    x = torch.randn(2, 4, h, h, device="cuda", dtype=torch.float16)
    t = torch.tensor([500.0, 500.0], device="cuda")
    ehs = torch.randn(2, 77, 2048, device="cuda", dtype=torch.float16)
    cond = dict(text_embeds=torch.randn(2, 1280, device="cuda", dtype=torch.float16),
                time_ids=torch.randn(2, 6, device="cuda", dtype=torch.float16))
    img = torch.rand(2, 3, size, size, device="cuda", dtype=torch.float16)

    def timed(fn, reps=10):
        with torch.inference_mode():
            for _ in range(3):
                fn()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            end.record()
            torch.cuda.synchronize()
            return start.elapsed_time(end) / reps / 1000

    with torch.inference_mode():
        emb, mid, skips = enc(x, t, ehs, cond["text_embeds"], cond["time_ids"])
    parts = {
        "encoder_s": timed(lambda: enc(x, t, ehs, cond["text_embeds"], cond["time_ids"])),
        "decoder_s": timed(lambda: dec(emb, mid, skips, ehs)),
        "controlnet_s": timed(lambda: cn(x, t, encoder_hidden_states=ehs, controlnet_cond=img,
                                         added_cond_kwargs=cond, return_dict=False)),
    }
    del unet, cn
    torch.cuda.empty_cache()
    return parts


def gustafson(parts: dict[str, float], count: int) -> float:
    """Ideal speedup of running encoder + `count` ControlNets in parallel (one GPU each) over serial."""
    serial = parts["encoder_s"] + count * parts["controlnet_s"] + parts["decoder_s"]
    parallel = max(parts["encoder_s"], parts["controlnet_s"] if count else 0.0) + parts["decoder_s"]
    return serial / parallel


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--gpus", type=int, default=2, help="2: ControlNets on their own GPU as well")
    p.add_argument("--skip-diffusers", action="store_true", help="no baseline (diagnostic runs only)")
    p.add_argument("--cuda-pool-gib", type=int, default=0,
                   help="Triton's CUDA memory pool per GPU; BLS tensors larger than the pool go through host memory")
    args = p.parse_args()
    start_logging()

    from export.repository import ExportOptions, export_repository

    model, store = random_sdxl(args.work), args.work / "adapters"
    write_controlnets(model, store, NAMES)

    report = {"size": args.size, "steps": args.steps, "runs": args.runs, "dtype": "fp16",
              "cuda_pool_gib": args.cuda_pool_gib}
    report["step_parts_s"] = parts = step_parts(model, store, args.size)
    report["gustafson_ideal"] = {c: gustafson(parts, c) for c in (1, 2)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if not args.skip_diffusers:
        report["diffusers"] = time_diffusers(model, store, args.size, args.steps, args.runs)
        args.out.write_text(json.dumps(report, indent=2, default=str))
    base = ExportOptions(device="cuda", dtype="fp16", gpus=(0,), max_size=args.size, adapters=str(store),
                         controlnet_instances=2, controlnet_cache_gib=32)
    # label: (the service's GPUs, mode); pipelined is approximate (step t uses step t-1's residuals)
    placements = {"same_gpu": ((0,), "sync")} | (
        {"own_gpu": ((1,), "sync"), "own_gpu_pipelined": ((1,), "pipelined")} if args.gpus > 1 else {})
    for label, (cn_gpus, mode) in placements.items():
        repo = args.work / f"repo-{label}"
        export_repository(model, repo, dataclasses.replace(base, controlnet_gpus=cn_gpus, controlnet_mode=mode))
        pool = [f"--cuda-memory-pool-byte-size={g}:{args.cuda_pool_gib * 2**30}" for g in range(args.gpus)]
        report[label] = time_server(repo, args.size, args.steps, args.runs, pool if args.cuda_pool_gib else ())
        args.out.write_text(json.dumps(report, indent=2, default=str))  # what a time limit leaves

    med = statistics.median
    for label in (() if args.skip_diffusers else ("diffusers",)) + tuple(placements):
        rows = report[label]
        e2e = {c: med(rows[c] if label == "diffusers" else rows[c]["e2e_s"]) for c in (0, 1, 2)}
        report.setdefault("summary", {})[label] = e2e
        log.info("%-9s e2e median 0C %.3fs  1C %.3fs  2C %.3fs", label, e2e[0], e2e[1], e2e[2])
    args.out.write_text(json.dumps(report, indent=2, default=str))
    log.info("per step: %s; Gustafson ideal 1C %.2fx, 2C %.2fx", {k: round(v * 1000, 1) for k, v in parts.items()},
             report["gustafson_ideal"][1], report["gustafson_ideal"][2])


if __name__ == "__main__":
    main()
