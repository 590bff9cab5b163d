"""Decides which model of the pipeline to make faster next.

Where a request's time goes between the models of the `easel` pipeline, for a few single
requests through gRPC: what each model reports of its own work (`info`: the denoiser's queue, each
stage's seconds), what Triton counts for each model (its per-model statistics: queue, and compute
from the inputs' copy in to the outputs' copy out, per request), and what is left of the server's
total (from preprocess's receipt to the image encoded): the hand-offs between the models (BLS
calls, tensor copies through shared memory, the stubs' message queues) and the adapters' Python.

Why statistics and not Triton's request traces: `easel` calls the models by BLS from a worker
thread, after its `execute` returned, and those calls cannot be traced under the client's request
in Triton 2.51 (backends/triton/bls_pipeline.py says why), so a trace holds the `easel` request alone.
The statistics count every request a model ran, BLS ones included; the server runs only these
requests while they are taken. The denoiser is decoupled: its statistics cover `execute` (the
enqueue) only, hence its own account.

Triton's compute splits into copying the inputs in, the stub's infer (the adapter's Python and
the stub's message round trip; the model's own stage is inside it) and copying the outputs out.
`--py-spy` also samples every stub while the timed requests run (py-spy's folded stacks, idle
frames included, in one file beside --out, each stack under its stub's `<model>.<pid>` as its root
frame): where the adapters' time outside their stages goes; `--native` adds their C frames.
`--repo` traces an existing repository (e.g. `easel bench`'s, whose compile cache is warm).

    python3 -m bench.micro.pipeline_trace --work /tmp/easel-trace --out $OUT/pipeline_trace.json [--runtime graphs]
    python3 -m bench.micro.pipeline_trace --work /tmp/easel-trace --out /tmp/t.json --cpu --steps 4  # the tiny model
    python3 -m bench.micro.pipeline_trace --work /tmp/eb --repo /tmp/eb/repo-0C-0L --out $OUT/trace.json --py-spy py-spy
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import time
from pathlib import Path

from clients.bench.common import bench_parser, random_sdxl, start_logging, tiny

log = logging.getLogger("bench.micro.pipeline_trace")
# The models `easel` calls one after the other, but the denoiser (see above).
STAGES = ("preprocess", "text_encoder", "vae_decoder")
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
    """Seconds per request in each model and part (`<part>_s`, and `compute_s` their sum but the
    queue's), between two model_totals."""
    out = {}
    for name, end in after.items():
        start = before.get(name, dict.fromkeys(end, 0))
        count = end["count"] - start["count"]
        if count:
            row = {f"{part}_s": (end[part] - start[part]) / count / 1e9 for part in PARTS}
            row["compute_s"] = row["compute_input_s"] + row["compute_infer_s"] + row["compute_output_s"]
            out[name] = {"requests": count, **row}
    return out


def stub_pids() -> list[tuple[str, int]]:
    """(model name, pid) of every Python stub (every instance), from the stubs' command lines,
    which name the model's `<repository>/<model>/<version>/model.py`."""
    found = []
    for line in subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout.splitlines():
        pid, _, command = line.strip().partition(" ")
        if "triton_python_backend_stub" in command:
            found += [(Path(arg).parent.parent.name, int(pid)) for arg in command.split() if arg.endswith("/model.py")]
    return sorted(found)


def start_sampling(py_spy: str, out: Path, seconds: float, native: bool = False
                   ) -> list[tuple[str, Path, subprocess.Popen]]:
    """py-spy on every stub for `seconds`, each into `<out stem>.<model>.<pid>.txt` (raw folded
    stacks, one root frame per thread) until join_samples gathers them. `native` adds the C/C++
    frames (a wait for the GIL, a CUDA synchronization), which py-spy can only read from a paused
    process: each sample stops the stub for a moment."""
    runs = []
    mode = ["--native"] if native else ["--nonblocking"]
    for model, pid in stub_pids():
        target = out.with_name(f"{out.stem}.{model}.{pid}.txt")
        runs.append((f"{model}.{pid}", target, subprocess.Popen(
            [py_spy, "record", "--pid", str(pid), "--duration", str(int(seconds) + 1), "--rate", "250", "--idle",
             "--threads", "--format", "raw", *mode, "--output", str(target)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)))
    time.sleep(1.0)  # attached before the first timed request
    return runs


def join_samples(runs: list[tuple[str, Path, subprocess.Popen]], out: Path) -> None:
    """Waits for the samplers (py-spy writes its file when its duration ends), then puts every
    stub's stacks into `<out stem>.py-spy.txt` under its stub as the root frame."""
    lines = []
    for stub, target, proc in runs:
        _, err = proc.communicate()
        if proc.returncode or not target.exists():
            log.warning("py-spy on %s: %s", stub, err.decode(errors="replace").strip()[-500:])
            continue
        lines += [f"{stub};{line}" for line in target.read_text().splitlines() if line.strip()]
        target.unlink()
    joined = out.with_name(f"{out.stem}.py-spy.txt")
    joined.write_text("\n".join(lines) + "\n")
    log.info("wrote %s", joined)


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=20)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--runtime", default="graphs", choices=("eager", "graphs", "compiled"))
    p.add_argument("--cpu", action="store_true", help="the tiny model on CPU (a smoke run of this script)")
    p.add_argument("--repo", type=Path, default=None, help="an existing repository to trace (no export)")
    p.add_argument("--py-spy", default=None, metavar="BIN", help="sample the stubs with this py-spy")
    p.add_argument("--native", action="store_true",
                   help="with --py-spy: C/C++ frames too (pauses each stub per sample)")
    p.add_argument("--sample-seconds", type=float, default=None,
                   help="how long py-spy samples (default: long enough for the timed requests, estimated from "
                        "the warm-up request)")
    args = p.parse_args()
    start_logging()

    import tritonclient.grpc as grpcclient

    from clients.client import EaselClient
    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository

    args.work.mkdir(parents=True, exist_ok=True)
    size = args.size
    repo = args.repo
    if repo is None:
        if args.cpu:
            model = tiny(args.work)
            options = ExportOptions(device="cpu", max_size=max(size, 256))
        else:
            model = random_sdxl(args.work)
            options = ExportOptions(device="cuda", dtype="fp16", gpus=(0,), runtime=args.runtime, max_size=size,
                                    warmup_sizes=(size,))
        repo = args.work / f"repo-{'cpu' if args.cpu else args.runtime}"
        export_repository(model, repo, options)
    latencies, infos, samplers = [], [], []
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900) as server:
        stats = grpcclient.InferenceServerClient(server.url_grpc)
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            start = time.perf_counter()
            client.generate("warm up", steps=args.steps, seed=0, width=size, height=size)
            warm_up_s = time.perf_counter() - start
            if args.py_spy:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                samplers = start_sampling(args.py_spy, args.out, args.sample_seconds or 2 + 1.5 * warm_up_s * args.runs,
                                          args.native)
            before = model_totals(stats)
            for seed in range(args.runs):
                start = time.perf_counter()
                result = client.generate("a yellow car", steps=args.steps, seed=seed, width=size, height=size)
                latencies.append(time.perf_counter() - start)
                infos.append(result.info)
            models = per_request(before, model_totals(stats))
            if samplers:
                join_samples(samplers, args.out)
    stages = {stage: statistics.median(i["stages_s"][stage] for i in infos) for stage in infos[0]["stages_s"]}
    median = {"client_s": statistics.median(latencies), "total_s": statistics.median(i["total_s"] for i in infos),
              "denoiser_queue_s": statistics.median(i["queue_s"] for i in infos),
              "denoiser_admit_s": statistics.median(i["admit_s"] for i in infos), "stages_s": stages,
              "between_models_s": statistics.median(
                  i["total_s"] - i["queue_s"] - sum(i["stages_s"].values()) for i in infos),
              # everything that is no model's own work, gRPC and the public model's entry and exit too
              "outside_stages_s": statistics.median(
                  c - i["queue_s"] - sum(i["stages_s"].values()) for c, i in zip(latencies, infos))}
    for name in STAGES:
        if name in models:
            row = models[name]
            log.info("%-13s queue %.4f s, compute %.4f s (input %.4f, infer %.4f, output %.4f) a request (Triton's "
                     "count)", name, row["queue_s"], row["compute_s"], row["compute_input_s"], row["compute_infer_s"],
                     row["compute_output_s"])
    log.info("their own accounts: denoiser queue %.4f s (admission %.4f), %s", median["denoiser_queue_s"],
             median["denoiser_admit_s"],
             ", ".join(f"{stage} {seconds:.4f}" for stage, seconds in stages.items()))
    log.info("server total %.4f s, of which between the models %.4f s; client %.4f s, of which outside the stages "
             "%.4f s", median["total_s"], median["between_models_s"], median["client_s"], median["outside_stages_s"])
    report = {"size": size, "steps": args.steps, "repository": str(repo),
              "runtime": "eager" if args.cpu else (args.runtime if args.repo is None else "the repository's"),
              "client_s": latencies, "infos": infos, "models": models, "median": median}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    log.info("wrote %s", args.out)


if __name__ == "__main__":
    main()
