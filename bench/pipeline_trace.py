"""Where a request's time goes between the models of the `easel` pipeline, for a few single
requests through gRPC: what each model reports of its own work (`info`: the denoiser's queue, each
stage's seconds), what Triton counts for each model (its per-model statistics: queue, and compute
from the inputs' copy in to the outputs' copy out, per request), and what is left of the server's
total (from preprocess's receipt to postprocess's end): the hand-offs between the models (BLS
calls, tensor copies through shared memory, the stubs' message queues) and the adapters' Python.

Why statistics and not Triton's request traces: `easel` calls the models by BLS from a worker
thread, after its `execute` returned, and those calls cannot be traced under the client's request
in Triton 2.51 (backends/bls_pipeline.py says why), so a trace holds the `easel` request alone.
The statistics count every request a model ran, BLS ones included; the server runs only these
requests while they are taken. The denoiser is decoupled: its statistics cover `execute` (the
enqueue) only, hence its own account.

    python3 -m bench.pipeline_trace --work /tmp/easel-trace --out $OUT/pipeline_trace.json [--runtime graphs]
    python3 -m bench.pipeline_trace --work /tmp/easel-trace --out /tmp/t.json --cpu --steps 4  # the tiny model
"""

from __future__ import annotations

import json
import logging
import statistics
import time

from bench.common import bench_parser, random_sdxl, start_logging, tiny

log = logging.getLogger("bench.pipeline_trace")
# The models `easel` calls one after the other, but the denoiser (see above).
STAGES = ("preprocess", "text_encoder", "vae_decoder", "postprocess")
PARTS = ("queue", "compute_input", "compute_infer", "compute_output")


def model_totals(client) -> dict[str, dict[str, int]]:
    """Per model: requests run and nanoseconds spent in each of PARTS, since the server started."""
    out = {}
    for model in client.get_inference_statistics(as_json=True).get("model_stats", ()):
        stats = model.get("inference_stats", {})
        row = {"count": int(stats.get("success", {}).get("count", 0))}
        row.update({part: int(stats.get(part, {}).get("ns", 0)) for part in PARTS})
        totals = out.setdefault(model["name"], dict.fromkeys(row, 0))
        for key, value in row.items():
            totals[key] += value  # summed over versions
    return out


def per_request(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Seconds per request in each model, between two model_totals."""
    out = {}
    for name, end in after.items():
        start = before.get(name, dict.fromkeys(end, 0))
        count = end["count"] - start["count"]
        if count:
            row = {part: (end[part] - start[part]) / count / 1e9 for part in PARTS}
            out[name] = {"requests": count, "queue_s": row["queue"],
                         "compute_s": row["compute_input"] + row["compute_infer"] + row["compute_output"]}
    return out


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--runtime", default="graphs", choices=("eager", "graphs", "compiled"))
    p.add_argument("--cpu", action="store_true", help="the tiny model on CPU (a smoke run of this script)")
    args = p.parse_args()
    start_logging()

    import tritonclient.grpc as grpcclient

    from clients.client import EaselClient
    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository

    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        model, size = tiny(args.work), args.size
        options = ExportOptions(device="cpu", max_size=max(size, 256))
    else:
        model, size = random_sdxl(args.work), args.size
        options = ExportOptions(device="cuda", dtype="fp16", gpus=(0,), runtime=args.runtime, max_size=size,
                                warmup_sizes=(size,))
    repo = args.work / f"repo-{'cpu' if args.cpu else args.runtime}"
    export_repository(model, repo, options)
    latencies, infos = [], []
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900) as server:
        stats = grpcclient.InferenceServerClient(server.url_grpc)
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            client.generate("warm up", steps=2, seed=0, width=size, height=size)
            before = model_totals(stats)
            for seed in range(args.runs):
                start = time.perf_counter()
                result = client.generate("a yellow car", steps=args.steps, seed=seed, width=size, height=size)
                latencies.append(time.perf_counter() - start)
                infos.append(result.info)
            models = per_request(before, model_totals(stats))
    stages = {stage: statistics.median(i["stages_s"][stage] for i in infos) for stage in infos[0]["stages_s"]}
    median = {"client_s": statistics.median(latencies), "total_s": statistics.median(i["total_s"] for i in infos),
              "denoiser_queue_s": statistics.median(i["queue_s"] for i in infos), "stages_s": stages,
              "between_models_s": statistics.median(
                  i["total_s"] - i["queue_s"] - sum(i["stages_s"].values()) for i in infos)}
    for name in STAGES:
        if name in models:
            log.info("%-13s queue %.4f s, compute %.4f s a request (Triton's count)", name, models[name]["queue_s"],
                     models[name]["compute_s"])
    log.info("their own accounts: denoiser queue %.4f s, %s", median["denoiser_queue_s"],
             ", ".join(f"{stage} {seconds:.4f}" for stage, seconds in stages.items()))
    log.info("server total %.4f s, of which between the models %.4f s; client %.4f s", median["total_s"],
             median["between_models_s"], median["client_s"])
    report = {"size": size, "steps": args.steps, "runtime": "eager" if args.cpu else args.runtime,
              "client_s": latencies, "infos": infos, "models": models, "median": median}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
