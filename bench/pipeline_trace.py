"""Where a request's time goes between the models: Triton's own request traces (TIMESTAMPS level)
of the `easel` ensemble and its steps, including the BLS call into the denoiser, for a few
single requests through gRPC.

For every model a request passes through: when Triton received it, when the model's execute
started and ended, and when the response was released; the gaps between one model's end and the
next one's start are the hand-offs (tensor copies through shared memory, the ensemble scheduler,
the stubs' message queues). Medians over the requests.

    python3 -m bench.pipeline_trace --work /tmp/easel-trace --out $OUT/pipeline_trace.json [--runtime graphs]
    python3 -m bench.pipeline_trace --work /tmp/easel-trace --out /tmp/t.json --cpu   # the tiny model
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections import defaultdict
from pathlib import Path

from bench.common import bench_parser, random_sdxl, start_logging, tiny

log = logging.getLogger("bench.pipeline_trace")
# Triton's timestamps per traced request, in the order they happen.
EVENTS = ("REQUEST_START", "QUEUE_START", "COMPUTE_START", "COMPUTE_END", "REQUEST_END")


def read_traces(path: Path) -> list[dict]:
    """Triton's trace file: a JSON list of entries {id, model_name, parent_id?} and {id, timestamps},
    merged per trace id; the file may hold several lists when written in pieces."""
    text = path.read_text().strip()
    chunks = json.loads("[" + text.replace("][", ",").strip("[]") + "]") if text else []
    traces: dict[int, dict] = defaultdict(lambda: {"timestamps": {}})
    for entry in chunks:
        trace = traces[entry["id"]]
        for key in ("model_name", "parent_id"):
            if key in entry:
                trace[key] = entry[key]
        for stamp in entry.get("timestamps", ()):
            trace["timestamps"].setdefault(stamp["name"], int(stamp["ns"]))
    return [dict(t, id=i) for i, t in traces.items()]


def request_timelines(traces: list[dict]) -> list[list[dict]]:
    """One timeline per top-level `easel` request: it and every trace under it, by start time."""
    by_parent = defaultdict(list)
    for t in traces:
        by_parent[t.get("parent_id")].append(t)

    def under(trace):
        out = [trace]
        for child in by_parent.get(trace["id"], ()):
            out += under(child)
        return out

    roots = [t for t in traces if t.get("model_name") == "easel" and not t.get("parent_id")]
    return [sorted(under(r), key=lambda t: t["timestamps"].get("REQUEST_START", 0)) for r in roots]


def summarize(timeline: list[dict]) -> dict:
    """Seconds per model (execute), and the gap before each model's execute since the previous
    model's execute ended (the hand-off), relative to the ensemble's own REQUEST_START."""
    root = timeline[0]["timestamps"]
    t0 = root["REQUEST_START"]
    out = {"total_s": (root["REQUEST_END"] - t0) / 1e9, "models": []}
    previous_end = t0
    for t in timeline[1:]:
        ts = t["timestamps"]
        if "COMPUTE_START" not in ts:
            continue
        out["models"].append({"model": t["model_name"], "start_s": (ts["COMPUTE_START"] - t0) / 1e9,
                              "compute_s": (ts["COMPUTE_END"] - ts["COMPUTE_START"]) / 1e9,
                              "gap_before_s": (ts["COMPUTE_START"] - previous_end) / 1e9})
        previous_end = max(previous_end, ts["COMPUTE_END"])
    out["after_last_s"] = (root["REQUEST_END"] - previous_end) / 1e9
    return out


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--runtime", default="graphs", choices=("eager", "graphs", "compiled"))
    p.add_argument("--cpu", action="store_true", help="the tiny model on CPU (a smoke run of this script)")
    args = p.parse_args()
    start_logging()

    from clients.client import EaselClient
    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository

    args.work.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        model, options = tiny(args.work), ExportOptions(device="cpu")
        size = 64
    else:
        model, size = random_sdxl(args.work), args.size
        options = ExportOptions(device="cuda", dtype="fp16", gpus=(0,), runtime=args.runtime, max_size=size,
                                warmup_sizes=(size,))
    repo = args.work / f"repo-{'cpu' if args.cpu else args.runtime}"
    export_repository(model, repo, options)
    trace_file = args.work / "trace.json"
    trace_file.unlink(missing_ok=True)
    tracing = ("--trace-config=level=TIMESTAMPS", "--trace-config=rate=1", "--trace-config=count=-1",
               "--trace-config=mode=triton", f"--trace-config=triton,file={trace_file}",
               "--trace-config=triton,log-frequency=0")
    server = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900,
                          extra_args=tracing).start()
    latencies, infos = [], []
    try:
        server.wait_ready()
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            client.generate("warm up", steps=2, seed=0, width=size, height=size)
            for seed in range(args.runs):
                start = time.perf_counter()
                result = client.generate("a yellow car", steps=args.steps, seed=seed, width=size, height=size)
                latencies.append(time.perf_counter() - start)
                infos.append(result.info)
    finally:
        server.stop()  # tritonserver writes the trace file as it exits (log-frequency 0)
    timelines = request_timelines(read_traces(trace_file))[1:]  # the warm-up request first
    summaries = [summarize(t) for t in timelines]
    models = [m["model"] for m in summaries[0]["models"]] if summaries else []
    report = {"size": size, "steps": args.steps, "runtime": "eager" if args.cpu else args.runtime,
              "client_s": latencies, "infos": infos, "requests": summaries, "median": {}}
    for i, name in enumerate(models):
        rows = [s["models"][i] for s in summaries if len(s["models"]) > i and s["models"][i]["model"] == name]
        report["median"][f"{i}:{name}"] = {k: statistics.median(r[k] for r in rows)
                                           for k in ("start_s", "compute_s", "gap_before_s")}
        log.info("%-14s starts at %.4f s, computes %.4f s, after a gap of %.4f s", name,
                 *report["median"][f"{i}:{name}"].values())
    if summaries:
        report["median"]["total_s"] = statistics.median(s["total_s"] for s in summaries)
        report["median"]["after_last_s"] = statistics.median(s["after_last_s"] for s in summaries)
        # The denoiser's BLS request is not traced: the models' own account of it instead.
        in_denoiser = statistics.median(i["queue_s"] + i["stages_s"]["denoise_s"] for i in infos)
        report["median"]["in_denoiser_s"] = in_denoiser
        log.info("generate's execute less the denoiser's queue + steps: %.4f s",
                 report["median"].get("2:generate", {}).get("compute_s", float("nan")) - in_denoiser)
        log.info("ensemble total %.4f s (after the last model %.4f s); client %.4f s", report["median"]["total_s"],
                 report["median"]["after_last_s"], statistics.median(latencies))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
