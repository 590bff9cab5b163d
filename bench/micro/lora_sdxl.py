"""Decides bounded asynchronous LoRA merging against waiting for the LoRAs (exact), end to end.

LoRAs on a GPU: e2e latency of 0C/0L, 0C/1L and 0C/2L through Easel (exact and bounded merge)
against diffusers' load_lora_weights + fuse_lora per request, with random SDXL-size LoRAs
(~340 and ~460 MiB) read cold from local disk, in one run.

    python3 bench/micro/lora_sdxl.py --work /tmp/easel-lora --out $OUT/lora_sdxl.json
    python3 bench/micro/lora_sdxl.py --cpu-smoke --work /tmp/lora-smoke --out /tmp/lora-smoke.json  # tiny, CPU

The UNet is SDXL base's architecture with random weights (no model hub here); the LoRAs are
diffusers/PEFT-layout files on every attention projection (to_q, to_k, to_v, to_out.0) and
feed-forward Linear (ff.net.0.proj, ff.net.2) of all 70 transformer blocks, with one uniform rank
chosen so the fp16 file lands at the requested size. "Cold" means: before every timed request
each LoRA file's pages are dropped from the OS page cache (posix_fadvise DONTNEED, no root
needed for clean pages), so each load reads the file from the disk. The goal: LoRA
overhead below 5% of the 0C/0L latency; KATZ reports ~230 ms of loading and patching.

The lent GPU hosts drift by seconds between requests, so each run sends 0L, 1L and 2L back to
back, in an order rotated from run to run; the report gives medians, medians of each run's difference to its own 0L request, and the
server's own account of the LoRAs' critical path (time held at the bound + GPU time of the merge,
from `info` and the Prometheus counters). A failed request is recorded with the server log's
tail, and the run goes on.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import time
from pathlib import Path

from clients.bench.adapters import drop_cache, write_loras
from clients.clients.bench.common import bench_parser, random_sdxl, start_logging, tiny

log = logging.getLogger("bench.micro.lora_sdxl")

# The Linear layers real SDXL LoRAs train (kohya/diffusers defaults): attention and feed-forward.
LORA_METRICS = ("easel_lora_loads_total", "easel_lora_load_seconds_total", "easel_lora_loaded_bytes_total",
                "easel_lora_merged_requests_total", "easel_lora_merge_step_total", "easel_lora_bound_waits_total",
                "easel_lora_merge_seconds_total", "easel_lora_bound_wait_seconds_total")
LORA_METRICS_SHORT = tuple(k.removeprefix("easel_lora_") for k in LORA_METRICS)
COUNTS = (0, 1, 2)  # LoRAs per request
PROMPT = "a house by a lake"


@dataclasses.dataclass(frozen=True)
class Setup:
    """What differs between the GPU run and the CPU smoke run."""

    device: str
    dtype: str  # "fp16" | "fp32"
    size: int
    steps: int
    runs: int

    @property
    def torch_dtype(self):
        import torch

        return torch.float16 if self.dtype == "fp16" else torch.float32


# --- cold reads ----------------------------------------------------------------------------


def read_speeds(path: str, readers: tuple[int, ...] = (2, 4)) -> dict:
    """Plain read throughput of one file cold (after drop_cache) and warm, in GB/s: shows that
    dropping works on this filesystem and what a cold load costs at the floor. Also cold with
    several threads reading interleaved 16 MiB ranges: whether this disk serves more with more
    requests in flight (the loader reads one range at a time)."""
    nbytes = os.path.getsize(path)
    drop_cache([path])
    cold = parallel_read(path, 1, 64 << 20)
    warm = parallel_read(path, 1, 64 << 20)
    parallel = {}
    for threads in readers:
        drop_cache([path])
        parallel[str(threads)] = nbytes / parallel_read(path, threads) / 1e9
    return {"bytes": nbytes, "cold_s": cold, "warm_s": warm, "cold_gb_s": nbytes / cold / 1e9,
            "warm_gb_s": nbytes / warm / 1e9, "cold_gb_s_by_readers": parallel}


def parallel_read(path: str, threads: int, chunk: int = 16 << 20) -> float:
    """Seconds to read the whole file with `threads` threads, thread j reading ranges j, j + threads, ..."""
    import threading

    size = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)

    def work(j: int) -> None:
        buffer = memoryview(bytearray(chunk))
        for offset in range(j * chunk, size, threads * chunk):
            want = min(chunk, size - offset)
            done = 0
            while done < want:
                n = os.preadv(fd, [buffer[done:want]], offset + done)
                if not n:
                    raise EOFError(f"{path}: ends early")
                done += n

    workers = [threading.Thread(target=work, args=(j,)) for j in range(threads)]
    start = time.perf_counter()
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        os.close(fd)
    return time.perf_counter() - start


# --- the requests --------------------------------------------------------------------------


def run_order(run: int) -> tuple[int, ...]:
    """The LoRA counts of one run, back to back, rotated by run: the host drifts by seconds over
    a run, and a fixed order would charge a steady drift to the counts sent last."""
    shift = run % len(COUNTS)
    return COUNTS[shift:] + COUNTS[:shift]


def lora_set(loras: list[dict], count: int, run: int) -> list[dict]:
    """The LoRAs of request `run` with `count` LoRAs: one request alternates between the two files
    (both sizes are measured), two takes both."""
    if count == 1:
        return [loras[run % len(loras)]]
    return loras[:count]


def time_easel(repo: Path, loras: list[dict], setup: Setup, scale: float) -> dict[str, dict]:
    from clients.client import EaselClient
    from clients.serve import TritonServer, metric_totals

    paths = [x["path"] for x in loras]
    out: dict[str, dict] = {}
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900) as server:
        with EaselClient(server.url_grpc, protocol="grpc") as client:  # the GPU image lacks gevent (HTTP)
            client.generate("warm up", width=setup.size, height=setup.size, steps=2, seed=0)
            # The process's first LoRA request pays one-time costs (imports in the text encoder,
            # first allocations of the merge): measured on its own, untimed in the medians.
            drop_cache(paths)
            start = time.perf_counter()
            info = client.generate(PROMPT, width=setup.size, height=setup.size, steps=setup.steps, seed=99,
                                   loras=[loras[0]["name"]], lora_scales=[scale]).info
            out["first_lora_request"] = {"loras": [loras[0]["name"]], "e2e_s": time.perf_counter() - start,
                                         "lora_merged_at_step": info.get("lora_merged_at_step"),
                                         "queue_s": info.get("queue_s"), "stages_s": info["stages_s"]}
            log.info("first LoRA request (not in the medians): e2e %.3fs, stages %s",
                     out["first_lora_request"]["e2e_s"], {k: round(v, 3) for k, v in info["stages_s"].items()})
            # Counts interleaved within each run, so that the host's drifts (seconds, on the lent
            # machines) fall on all three alike and pair up.
            for run in range(setup.runs):
                for count in run_order(run):
                    names = [x["name"] for x in lora_set(loras, count, run)]
                    extra = dict(loras=names, lora_scales=[scale] * count) if count else {}
                    drop_cache(paths)
                    before = metric_totals(server.metrics_port, LORA_METRICS)
                    start = time.perf_counter()
                    try:
                        info = client.generate(PROMPT, width=setup.size, height=setup.size, steps=setup.steps,
                                               seed=run, **extra).info
                    except Exception as exc:  # reported with the server's log, and the run goes on
                        tail = "\n".join(server.log_text().splitlines()[-40:])
                        log.error("run %d %dL failed after %.3fs: %s\n--- server log ---\n%s", run, count,
                                  time.perf_counter() - start, exc, tail)
                        out.setdefault("failures", []).append({"run": run, "count": count, "error": str(exc),
                                                               "server_log_tail": tail})
                        continue
                    e2e = time.perf_counter() - start
                    # The merge-time counter moves when a request finishes; a restore is timed within the
                    # next request's merge (or with the next request that has none).
                    after = metric_totals(server.metrics_port, LORA_METRICS)
                    delta = {short: after[k] - before[k] for k, short in zip(LORA_METRICS, LORA_METRICS_SHORT)}
                    row = {"run": run, "loras": names, "e2e_s": e2e, "denoise_s": info["stages_s"].get("denoise_s"),
                           "queue_s": info.get("queue_s"), "lora_merged_at_step": info.get("lora_merged_at_step"),
                           "lora_wait_s": info.get("lora_wait_s"), "stages_s": info["stages_s"],
                           "metrics_delta": delta,
                           # what the LoRAs put on the request's critical path, measured by the server:
                           # time held at the bound + GPU time of the merge (and of restoring the last one)
                           "lora_critical_s": (info.get("lora_wait_s") or 0) + delta["merge_seconds_total"]}
                    section = out.setdefault(f"{count}L", {"runs": [], "e2e_s": [], "denoise_s": []})
                    section["runs"].append(row)
                    section["e2e_s"].append(e2e)
                    section["denoise_s"].append(row["denoise_s"])
                    if count and info.get("lora_merged_at_step") is None:
                        log.warning("%dL run %d: the server says its LoRAs were never merged", count, run)
                    log.info("run %d %dL: e2e %.3fs denoise %.3fs queue %.3fs merged at %s, load %.3fs (%d files), "
                             "waited %.3fs, merge+restore %.3fs", run, count, e2e, row["denoise_s"],
                             row["queue_s"] or 0,
                             row["lora_merged_at_step"], delta["load_seconds_total"], delta["loads_total"],
                             row["lora_wait_s"] or 0, delta["merge_seconds_total"])
            for count in COUNTS:
                section = out[f"{count}L"]
                totals = {k: sum(r["metrics_delta"][k] for r in section["runs"]) for k in LORA_METRICS_SHORT}
                loads = totals["loads_total"]
                section["metrics_delta"] = totals
                # seconds per file from submit to tensors on the GPU: cold read, conversion, hand-off
                section["load_s_per_file"] = totals["load_seconds_total"] / loads if loads else None
                # GPU time of merging into the weights (and of restoring the previous request's)
                section["merge_s_per_request"] = totals["merge_seconds_total"] / setup.runs
            # The loader's own line per planned read (size, seconds, GB/s): the disk's share of a load.
            out["server_reads"] = [line.split("LoRA ", 1)[1].rstrip("\" ") for line in server.log_text().splitlines()
                                   if "LoRA " in line and " MiB in " in line]
    return out


def time_diffusers(model: Path, loras: list[dict], setup: Setup, scale: float) -> dict[str, dict]:
    """StableDiffusionXLPipeline per request: load_lora_weights for each file (cold), set_adapters,
    fuse_lora, generate; then unfuse_lora + unload_lora_weights (timed apart, as a server would
    do it after answering)."""
    import warnings

    import torch
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import logging as diffusers_logging

    # Expected here, once per load: the files have no text-encoder layers, and 2L puts a second
    # adapter into the same model.
    diffusers_logging.set_verbosity_error()
    warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")

    def sync() -> None:
        if setup.device == "cuda":
            torch.cuda.synchronize()

    paths = [x["path"] for x in loras]
    pipe = StableDiffusionXLPipeline.from_pretrained(model, dtype=setup.torch_dtype, add_watermarker=False)
    pipe = pipe.to(setup.device)
    pipe.set_progress_bar_config(disable=True)
    pipe("warm up", width=setup.size, height=setup.size, num_inference_steps=2)
    out: dict[str, dict] = {}
    # As for Easel: the first LoRA request (peft's imports, first allocations) on its own, then
    # the counts interleaved within each run.
    plan = [("first_lora_request", [loras[0]], 99)] + [
        (f"{count}L", lora_set(loras, count, run), run) for run in range(setup.runs) for count in run_order(run)]
    for label, chosen, run in plan:  # (the run number seeds its request)
        count, names = len(chosen), [x["name"] for x in chosen]
        drop_cache(paths)
        sync()
        t0 = time.perf_counter()
        for lora in chosen:
            pipe.load_lora_weights(lora["path"], adapter_name=lora["name"])
        sync()
        t1 = time.perf_counter()
        if count:
            pipe.set_adapters(names, adapter_weights=[scale] * count)
            pipe.fuse_lora(adapter_names=names)
        sync()
        t2 = time.perf_counter()
        pipe(PROMPT, width=setup.size, height=setup.size, num_inference_steps=setup.steps,
             generator=torch.Generator("cpu").manual_seed(run))
        sync()
        t3 = time.perf_counter()
        if count:
            pipe.unfuse_lora()
            pipe.unload_lora_weights()
        sync()
        row = {"run": run, "loras": names, "e2e_s": t3 - t0, "load_s": t1 - t0, "fuse_s": t2 - t1,
               "generate_s": t3 - t2, "unfuse_unload_s": time.perf_counter() - t3}
        if label == "first_lora_request":
            out[label] = row
        else:
            out.setdefault(label, {"runs": [], "e2e_s": []})
            out[label]["runs"].append(row)
            out[label]["e2e_s"].append(row["e2e_s"])
        log.info("diffusers %s %s: e2e %.3fs (load %.3fs, set_adapters + fuse %.3fs, unfuse + unload %.3fs)",
                 label, names, row["e2e_s"], row["load_s"], row["fuse_s"], row["unfuse_unload_s"])
    del pipe
    if setup.device == "cuda":
        torch.cuda.empty_cache()
    return out


# --- the report ----------------------------------------------------------------------------


def summarize(report: dict) -> dict[str, dict]:
    """Median e2e per LoRA count and the overhead over 0L, for every section measured so far."""
    med = statistics.median
    summary = {}
    sections = {f"easel_bound{k}": v for k, v in report.get("easel", {}).items()}
    if "diffusers" in report:
        sections["diffusers"] = report["diffusers"]
    for label, rows in sections.items():
        base = med(rows["0L"]["e2e_s"])
        entry = {"0L_s": base}
        for count in COUNTS[1:]:
            value = med(rows[f"{count}L"]["e2e_s"])
            entry[f"{count}L_s"] = value
            entry[f"{count}L_overhead_s"] = value - base
            entry[f"{count}L_overhead_pct"] = 100 * (value - base) / base
            # Each run's request against the 0L request of the same run, sent next to it: less
            # exposed to the host's drifts than the difference of medians.
            base_of = {r["run"]: r["e2e_s"] for r in rows["0L"]["runs"]}
            paired = [r["e2e_s"] - base_of[r["run"]] for r in rows[f"{count}L"]["runs"] if r["run"] in base_of]
            entry[f"{count}L_paired_overhead_s"] = med(paired)
            entry[f"{count}L_paired_overhead_pct"] = 100 * med(paired) / base
            entry[f"{count}L_below_5pct"] = med(paired) < 0.05 * base  # the goal
        entry["first_lora_request_s"] = rows.get("first_lora_request", {}).get("e2e_s")
        if label != "diffusers":
            entry["denoise_median_s"] = {f"{c}L": med(rows[f"{c}L"]["denoise_s"]) for c in COUNTS}
            for count in COUNTS[1:]:  # the server's own account, free of the host's drift between requests
                critical = med(r["lora_critical_s"] for r in rows[f"{count}L"]["runs"])
                entry[f"{count}L_critical_s"] = critical
                entry[f"{count}L_critical_pct"] = 100 * critical / base
        summary[label] = entry
    return summary


def write(report: dict, out: Path) -> None:
    """The report as far as it goes: a time limit still leaves the sections measured."""
    report["summary"] = summarize(report)
    out.write_text(json.dumps(report, indent=2, default=str))


def main() -> None:
    p = bench_parser(__doc__, size=1024, steps=50, work_help="folder for the model, LoRAs and repositories")
    p.add_argument("--runs", type=int, default=3, help="timed requests per LoRA count")
    p.add_argument("--bounds", type=int, nargs="+", default=None,
                   help="lora_bound_steps per exported repository (0: exact, the request waits); default 0 10")
    p.add_argument("--lora-mib", type=float, nargs=2, default=None,
                   help="sizes of the two LoRA files (fp16), a rank is chosen per size; default 340 460")
    p.add_argument("--lora-std", type=float, default=1e-3, help="std of the random A and B entries")
    p.add_argument("--scale", type=float, default=0.8, help="every LoRA's scale")
    p.add_argument("--skip-diffusers", action="store_true", help="no baseline (diagnostic runs only)")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="the whole path on CPU: tiny pipeline, ~0.3 MB LoRAs, 64 px, 4 steps, 1 run, bounds 0 2")
    args = p.parse_args()
    start_logging()

    from export.repository import ExportOptions, export_repository

    if args.cpu_smoke:
        setup = Setup("cpu", "fp32", 64, 4, 1)
        lora_mib = args.lora_mib or [0.25, 0.4]
        bounds = args.bounds or [0, 2]
    else:
        setup = Setup("cuda", "fp16", args.size, args.steps, args.runs)
        lora_mib = args.lora_mib or [340.0, 460.0]
        bounds = args.bounds or [0, 10]

    t0 = time.perf_counter()
    model, store = tiny(args.work) if args.cpu_smoke else random_sdxl(args.work), args.work / "adapters"
    t1 = time.perf_counter()
    loras = write_loras(store, model / "unet", lora_mib, args.lora_std, setup.device)
    t2 = time.perf_counter()
    log.info("model ready in %.1fs, LoRAs in %.1fs", t1 - t0, t2 - t1)
    speeds = read_speeds(loras[-1]["path"])
    log.info("cold means: before each timed request every LoRA file's pages are dropped from the page cache "
             "(posix_fadvise DONTNEED); plain read of %s: cold %.2f GB/s, warm %.2f GB/s; cold by reader threads %s",
             loras[-1]["name"], speeds["cold_gb_s"], speeds["warm_gb_s"],
             {k: round(v, 2) for k, v in speeds["cold_gb_s_by_readers"].items()})

    report = {"device": setup.device, "dtype": setup.dtype, "size": setup.size, "steps": setup.steps,
              "runs": setup.runs, "scale": args.scale, "bounds": bounds, "loras": loras,
              "cold": "posix_fadvise(POSIX_FADV_DONTNEED) on every LoRA file before each timed request",
              "read_speeds": speeds, "easel": {}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write(report, args.out)

    for bound in bounds:
        start = time.perf_counter()
        repo = args.work / f"repo-bound{bound}"
        # One ControlNet instance: the store has none, and each instance costs startup time.
        export_repository(model, repo, ExportOptions(
            device=setup.device, dtype=setup.dtype, gpus=(0,), max_size=setup.size, adapters=str(store),
            lora_bound_steps=bound, controlnet_instances=1))
        log.info("bound %d: exported in %.1fs", bound, time.perf_counter() - start)
        report["easel"][bound] = time_easel(repo, loras, setup, args.scale)
        write(report, args.out)
        log.info("bound %d: done in %.1fs", bound, time.perf_counter() - start)

    if not args.skip_diffusers:
        start = time.perf_counter()
        report["diffusers"] = time_diffusers(model, loras, setup, args.scale)
        write(report, args.out)
        log.info("diffusers: done in %.1fs", time.perf_counter() - start)

    report["total_s"] = time.perf_counter() - t0
    write(report, args.out)
    log.info("LoRAs: %s", ", ".join(f"{x['name']} {x['mib']:.1f} MiB" for x in loras))
    for label, s in report["summary"].items():
        log.info("%-13s e2e median 0L %.3fs  1L %.3fs (%+.3fs, %+.1f%%; paired %+.3fs, %+.1f%%)  "
                 "2L %.3fs (%+.3fs, %+.1f%%; paired %+.3fs, %+.1f%%)  first LoRA request %.3fs", label, s["0L_s"],
                 s["1L_s"], s["1L_overhead_s"], s["1L_overhead_pct"], s["1L_paired_overhead_s"],
                 s["1L_paired_overhead_pct"], s["2L_s"], s["2L_overhead_s"], s["2L_overhead_pct"],
                 s["2L_paired_overhead_s"], s["2L_paired_overhead_pct"], s["first_lora_request_s"])
        if "1L_critical_s" in s:
            log.info("%-13s on the critical path by the server's account (wait at the bound + merge): "
                     "1L %.3fs (%.1f%%)  2L %.3fs (%.1f%%)", label, s["1L_critical_s"], s["1L_critical_pct"],
                     s["2L_critical_s"], s["2L_critical_pct"])
    log.info("goal: LoRA overhead below 5%% of 0L; total %.1fs; report %s", report["total_s"], args.out)


if __name__ == "__main__":
    main()
