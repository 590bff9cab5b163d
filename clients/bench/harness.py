"""`easel bench`: Easel through tritonserver against what a diffusers user runs, in one run.

One configuration (`--controlnets M --loras N`, default 0C/0L) or several (`--configs`) per run,
SDXL base's architecture with random fp16 weights (no model hub here: the cost is real, the
pictures are noise):

- Easel: write the model, export the repository with the chosen UNet runtime, start tritonserver
  twice (launch -> ready with the compile cache empty, then again on the same repository with it
  warm: cold start), then through gRPC: a warm-up request, `--runs` single requests (p50/p95 and
  the server's stage breakdown), throughput at each `--concurrency` (c clients at once, a few
  rounds), and the server's Prometheus metrics (every easel_* family, Triton's per-model
  inference counters and GPU gauges), as deltas over the configuration's own requests. With both
  diffusers baselines skipped, the run's configurations share one server (clients/bench/servers.py),
  its repository exported for the most ControlNets and LoRAs of any of them: the first one's start
  is the run's cold start.
- diffusers, after the server has stopped (never both on the GPU at once), on the same weights,
  dtype, size, steps, seeds and scheduler (EulerDiscreteScheduler, as the request's `euler`):
  eager StableDiffusionXLPipeline (latency; throughput as one call batching c prompts), then the
  same with `pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead")` (CUDA graphs; default
  mode if that fails, recorded), after a warm-up call per batch size.
- Fidelity: Easel's image of seed 0 against diffusers' eager image of seed 0 (PSNR, SSIM).

Writes `<out>/results.json` (merged with an existing one: another configuration is added, the
phases of the same configuration measured now replace the old ones), `<out>/results.md`,
`<out>/latency.png`, `<out>/throughput.png`, and the seed-0 images under `<out>/images/`.

    python3 -m clients.bench.harness --runs 3 --concurrency 1,4,8 --runtime graphs
    python3 -m clients.bench.harness --cpu-smoke --work /tmp/easel-smoke --out /tmp/easel-smoke/out
    python3 -m clients.bench.harness --replot bench/results/2026-11-22-h200
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import json
import logging
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from clients.bench.models import (CONTROLNET_NAMES, LORA_SCALE, LORA_STD, PROMPT, RESULTS_DIR, SCHEDULER, Setup,
                                control_images, driver_version, free_gpu, gpu_name, gpu_slug, now, parser,
                                resolve_all, shares_server, versions)
from clients.bench.diffusers_baseline import measure_diffusers
from clients.bench.report import (GUIDANCE, LABELS, SYSTEMS, image_path, load_results, markdown, percentile, phase,
                                plot, secs, times, write_report)
from clients.bench.servers import Servers, metrics_snapshot, total

log = logging.getLogger("easel.bench")


def config_entry(results: dict, setup: Setup, skip: set[str] = frozenset()) -> dict:
    """This run's configuration in `results`: the existing entry of the same name, size, steps,
    GPUs and Easel runtime (phases measured now replace its old ones), or a new one. A new one
    takes the diffusers phases it skips from an entry that differs only in Easel's runtime
    (diffusers does not depend on it), so each Easel runtime gets its ratios."""
    placement = setup.placement()

    def key(entry):
        return (entry.get("name"), entry.get("size"), entry.get("steps"), *(repr(entry.get(k) or None) for k in placement))

    mine = key({"name": setup.name, "size": setup.size, "steps": setup.steps, **placement})
    siblings = [e for e in results["configs"] if key(e) == mine]
    for entry in siblings:
        if entry.get("runtime") == setup.resolved_runtime:
            return entry
    entry = {"name": setup.name, "size": setup.size, "steps": setup.steps, **placement,
             "runtime": setup.resolved_runtime}
    for system in ("diffusers_eager", "diffusers_compiled"):
        source = next((e for e in siblings if system in skip and phase(e, system)), None)
        if source is not None:
            entry[system] = {**copy.deepcopy(source[system]), "copied_from_entry_with_runtime": source.get("runtime")}
            log.info("%s: %s taken from the entry with Easel runtime %s", setup.name, LABELS[system],
                     source.get("runtime"))
    results["configs"].append(entry)
    return entry


# --- models and adapters ---------------------------------------------------------------------


def prepare(setup: Setup) -> dict:
    """The model, and the ControlNets and LoRAs its repository serves (Setup.served_*) in
    `<work>/adapters`; own_adapters() picks the configuration's own."""
    from clients.bench.common import random_sdxl, tiny, write_controlnets
    from clients.bench.adapters import write_loras

    start = time.perf_counter()
    model = tiny(setup.work) if setup.smoke else random_sdxl(setup.work)
    out = {"model": model, "store": None, "controlnets": [], "loras": [], "write_model_s": time.perf_counter() - start}
    store = setup.adapter_store
    if store is not None:
        out["store"] = store
        names = [CONTROLNET_NAMES[i] if i < len(CONTROLNET_NAMES) else f"cn{i}"
                 for i in range(setup.served_controlnets)]
        write_controlnets(model, store, names, device=setup.torch_device, dtype=setup.dtype,
                          **({"embedding_channels": (4, 8, 8, 16)} if setup.smoke else {}))
        out["controlnets"] = names
        if setup.served_loras:
            out["loras"] = write_loras(store, model / "unet", [setup.lora_mib] * setup.served_loras, LORA_STD,
                                       setup.torch_device)
    free_gpu(setup)
    out["adapters_s"] = time.perf_counter() - start - out["write_model_s"]
    return out


def own_adapters(setup: Setup, prep: dict) -> dict:
    """`prep` with the first ControlNets and LoRAs, as many as the configuration's requests use."""
    return {**prep, "controlnets": prep["controlnets"][:setup.controlnets], "loras": prep["loras"][:setup.loras]}


def fingerprint(model: Path) -> str:
    """A cheap identity of the UNet weights (1 MiB at a few offsets): results merged from two runs
    compare images of the same weights only."""
    import hashlib

    files = sorted((model / "unet").glob("*.safetensors"))
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        with open(file, "rb") as f:
            for offset in (0, size // 3, 2 * size // 3, max(0, size - (1 << 20))):
                f.seek(offset)
                digest.update(f.read(1 << 20))
    return digest.hexdigest()[:16]


# --- Easel -----------------------------------------------------------------------------------


# Families that must hold every step of the requests answered so far before a snapshot is a
# boundary between phases: on a GPU the denoiser reads a step's times once its events complete
# (at a later step, or when the loop idles) and publishes them every half second, so a snapshot
# taken as a response arrives may lack the last steps of that request and hold none of them yet.
SETTLING = ("easel_denoiser_step_rows_count", "easel_controlnet_calls_total")
SETTLE_QUIET_S = 1.5  # three of the adapter's publishing periods
SETTLE_TIMEOUT_S = 30.0


def settled_snapshot(read, quiet_s: float = SETTLE_QUIET_S, timeout_s: float = SETTLE_TIMEOUT_S,
                     sleep=time.sleep) -> dict[str, dict[str, float]]:
    """`read()` again until SETTLING's totals stay the same over `quiet_s` (or `timeout_s` passes)."""
    def counts(snapshot):
        return tuple(total(snapshot, name) for name in SETTLING)

    snapshot, waited = read(), 0.0
    while waited < timeout_s:
        sleep(quiet_s)
        waited += quiet_s
        again = read()
        if counts(again) == counts(snapshot):
            return again
        snapshot = again
    log.warning("metrics still moving after %.0f s: a phase's figures may take in its neighbour's steps", timeout_s)
    return snapshot


def controlnet_breakdown(before: dict, after: dict) -> dict | None:
    """Where a ControlNet call's time went over the latency requests (one at a time), from the
    metrics' deltas: the denoiser's BLS wall time per call, the service's compute (inputs to
    residuals), the rest (transfers, Triton and the BLS threads), and what the decoder half
    waited for residuals per step. The wall time's parts, where the server reports them: waiting
    for the step's inputs on the GPU (`ready`), the BLS request (`exec`; less the compute, the
    hand-off: Triton and the residuals' transfer) and taking the residuals (`outputs`). None
    without ControlNet calls."""
    def delta(name):
        return (total(after, name) or 0.0) - (total(before, name) or 0.0)

    calls = delta("easel_controlnet_calls_total")
    if not calls:
        return None
    wall, compute = delta("easel_controlnet_call_seconds_total"), delta("easel_controlnet_compute_seconds_total")
    steps = delta("easel_denoiser_step_rows_count")
    out = {"calls": calls, "steps": steps, "bls_wall_ms": 1000 * wall / calls, "compute_ms": 1000 * compute / calls,
           "transfer_and_overhead_ms": 1000 * (wall - compute) / calls,
           "decoder_wait_ms_per_step": 1000 * delta("easel_controlnet_wait_seconds_total") / steps if steps else None,
           "session_misses": delta("easel_controlnet_session_misses_total"),
           "graph_replays": delta("easel_controlnet_graph_replays_total")}
    if total(after, "easel_controlnet_call_exec_seconds_total") is not None:  # a server that reports the parts
        parts = {p: delta(f"easel_controlnet_call_{p}_seconds_total") for p in ("ready", "exec", "outputs")}
        out.update({f"{p}_ms": 1000 * v / calls for p, v in parts.items()},
                   handoff_ms=1000 * (parts["exec"] - compute) / calls)
    return out


def _part_totals(snapshot: dict | None, name: str) -> dict[str, float]:
    """A labelled family's values by its `part` label."""
    return {labels.split('part="')[1].split('"')[0]: value for labels, value in ((snapshot or {}).get(name) or {}).items()
            if 'part="' in labels}


def controlnet_ideal(before: dict, after: dict, controlnets: int, breakdown: dict | None) -> dict | None:
    """Gustafson's ideal for the ControlNets of one request at a time, from the same run's parts
    (the metrics' deltas over the latency requests): each ControlNet on a GPU of its own runs
    beside the encoder half, so the ideal step is max(encoder, ControlNet) + decoder + sampler +
    the step's other orchestration, against a serial step of encoder + k ControlNets + decoder +
    the same rest. The encoder and decoder halves are GPU time; a ControlNet is the service's
    compute per call; the step is the denoiser's wall time, in which waiting for residuals is
    orchestration. `of_ideal` is the ideal step over the actual one (1: at the ideal)."""
    if not controlnets or not breakdown or not breakdown.get("steps"):
        return None
    steps = breakdown["steps"]
    start = _part_totals(before, "easel_denoiser_step_seconds_sum")
    parts = {k: 1000 * (v - start.get(k, 0.0)) / steps
             for k, v in _part_totals(after, "easel_denoiser_step_seconds_sum").items()}
    if not {"encoder", "decoder", "sampler", "orchestration"} <= set(parts):
        return None
    wait = breakdown.get("decoder_wait_ms_per_step") or 0.0
    rest = parts["sampler"] + max(0.0, parts["orchestration"] - wait)
    cn = breakdown["compute_ms"]
    actual = sum(parts.values())
    ideal = max(parts["encoder"], cn) + parts["decoder"] + rest
    serial = parts["encoder"] + controlnets * cn + parts["decoder"] + rest
    return {"encoder_ms": parts["encoder"], "decoder_ms": parts["decoder"], "controlnet_ms": cn, "rest_ms": rest,
            "wait_ms": wait, "step_ms": actual, "ideal_step_ms": ideal, "serial_step_ms": serial,
            "ideal_speedup": serial / ideal, "speedup": serial / actual, "of_ideal": ideal / actual}


def easel_request(setup: Setup, prep: dict) -> dict:
    """The request's fields besides prompt, steps and seed: size, guidance, and its adapters."""
    controls = {}
    if prep["controlnets"]:
        controls.update(controlnets=tuple(prep["controlnets"]),
                        control_images=tuple(control_images(setup, len(prep["controlnets"]))))
    if prep["loras"]:
        controls.update(loras=tuple(x["name"] for x in prep["loras"]), lora_scales=(LORA_SCALE,) * len(prep["loras"]))
    return dict(width=setup.size, height=setup.size, guidance_scale=GUIDANCE, scheduler=SCHEDULER, **controls)


# Counters read as deltas over a configuration's own requests (a shared server's totals hold the
# earlier configurations' too).
COUNTERS = {"graph_steps": "easel_runtime_graph_steps_total", "eager_steps": "easel_runtime_eager_steps_total",
            "captures": "easel_runtime_captures_total", "controlnet_calls": "easel_controlnet_calls_total",
            "steps": "easel_denoiser_step_rows_count"}


def counter_deltas(before: dict, after: dict) -> dict[str, float | None]:
    """COUNTERS from `before` to `after`; None where the server does not report one."""
    return {k: None if total(after, name) is None else total(after, name) - (total(before, name) or 0.0)
            for k, name in COUNTERS.items()}


def measure_easel(setup: Setup, prep: dict, images: Path, rec: dict, save, servers: Servers) -> None:
    """Easel on the server of `setup`'s repository (started now, or by an earlier configuration
    of the run); the counters it reads are deltas over this configuration's own requests."""
    from clients.client import EaselClient

    rec.update(date=now(), runtime=setup.resolved_runtime)
    served = servers.get(setup, prep["model"], rec, save)
    server = served.server
    request = easel_request(setup, prep)

    def snapshot():
        return settled_snapshot(lambda: metrics_snapshot(server.metrics_port))

    try:
        rec["tritonserver"] = server_version(server.url_grpc)
        rec.setdefault("metrics", {})["before"] = snapshot()
        save()

        with EaselClient(server.url_grpc, protocol="grpc") as client:  # the GPU image lacks gevent (HTTP)
            start = time.perf_counter()
            client.generate("warm up", steps=2, seed=0, **request)
            rec["warmup_request_s"] = time.perf_counter() - start
            rec["metrics"]["after_warmup"] = snapshot()
            measure_latency(setup, client, request, images, rec)
        rec["stages_median_s"] = stages_median(rec["infos"])
        rec["metrics"]["after_latency"] = snapshot()
        rec["controlnet_per_call"] = controlnet_breakdown(rec["metrics"]["after_warmup"], rec["metrics"]["after_latency"])
        rec["controlnet_ideal"] = controlnet_ideal(rec["metrics"]["after_warmup"], rec["metrics"]["after_latency"],
                                                   setup.controlnets, rec["controlnet_per_call"])
        save()

        rec["throughput"] = {}
        for c in setup.concurrency:
            rec["throughput"][str(c)] = easel_throughput(server.url_grpc, c, setup, request)
            save()
        rec["metrics"]["after_throughput"] = snapshot()
        rec["counters"] = counter_deltas(rec["metrics"]["before"], rec["metrics"]["after_throughput"])
        rec["runtime_steps"] = {k: rec["counters"][k] for k in ("graph_steps", "eager_steps", "captures")}
    except BaseException:
        # The server's own account of a failure (a stub that died says why only in its log).
        rec["server_log_tail"] = server.log_text()[-20000:]
        raise
    finally:
        servers.release(setup)
    save()


def measure_latency(setup: Setup, client, request: dict, images: Path, rec: dict) -> None:
    rec["latency_s"], rec["infos"] = [], []
    for seed in range(setup.runs):
        start = time.perf_counter()
        result = client.generate(PROMPT, steps=setup.steps, seed=seed, **request)
        rec["latency_s"].append(time.perf_counter() - start)
        rec["infos"].append(result.info)
        if seed == 0:
            result.save(image_path(images, setup.name, "easel", rec["runtime"]))
        log.info("Easel seed %d: %.3fs (denoise %.3fs)", seed, rec["latency_s"][-1],
                 result.info.get("stages_s", {}).get("denoise_s", float("nan")))


def stages_median(infos: list[dict]) -> dict[str, float]:
    """The server's own total (preprocess in to the image encoded) and the denoiser's queue beside the
    stages: the client's time less server_total_s is gRPC and the public model's entry and exit."""
    stages = []
    for i in infos:
        beside = {"queue_s": i.get("queue_s"), "admit_s": i.get("admit_s"), "server_total_s": i.get("total_s")}
        stages.append({**(i.get("stages_s") or {}), **{k: v for k, v in beside.items() if v is not None}})
    return {k: float(np.median([s[k] for s in stages if k in s])) for k in sorted({k for s in stages for k in s})}


def server_version(url: str) -> str | None:
    try:
        import tritonclient.grpc as grpcclient

        with contextlib.closing(grpcclient.InferenceServerClient(url)) as client:
            return client.get_server_metadata().version
    except Exception as exc:  # informative only
        log.warning("no server version: %s", exc)
        return None


def easel_throughput(url: str, c: int, setup: Setup, request: dict) -> dict:
    """c clients (one thread and one gRPC connection each) send at once; rounds back to back."""
    from clients.client import EaselClient

    clients = [EaselClient(url, protocol="grpc") for _ in range(c)]
    try:
        with ThreadPoolExecutor(max_workers=c) as pool:
            def round_(steps: int, seeds: list[int]) -> tuple[float, list[float], list[dict]]:
                barrier = threading.Barrier(c + 1)

                def one(i: int):
                    barrier.wait()
                    start = time.perf_counter()
                    info = clients[i].generate(PROMPT, steps=steps, seed=seeds[i], **request).info
                    return time.perf_counter() - start, info

                futures = [pool.submit(one, i) for i in range(c)]
                barrier.wait()
                start = time.perf_counter()
                done = [f.result() for f in futures]
                return time.perf_counter() - start, [d[0] for d in done], [d[1] for d in done]

            warmup_s, _, _ = round_(2, list(range(c)))
            rounds = setup.easel_rounds(c)
            walls, latencies, infos = [], [], []
            for r in range(rounds):
                wall, lat, info = round_(setup.throughput_steps, [1000 + r * c + i for i in range(c)])
                walls.append(wall)
                latencies += lat
                infos += info
    finally:
        for client in clients:
            client.close()
    images = c * rounds
    out = {"concurrency": c, "steps": setup.throughput_steps, "rounds": rounds, "images": images,
           "round_wall_s": walls, "wall_s": sum(walls), "img_s": images / sum(walls), "latency_s": latencies,
           "max_batch": [i.get("max_batch") for i in infos], "infos": infos, "warmup_round_s": warmup_s}
    log.info("Easel c=%d: %.3f images/s (%d images, %.1fs; request p50 %.3fs)", c, out["img_s"], images,
             out["wall_s"], percentile(latencies, 50))
    return out


# --- diffusers -------------------------------------------------------------------------------


# --- main ------------------------------------------------------------------------------------


def run(setup: Setup, out: Path, skip: set[str], argv: list[str], servers: Servers) -> int:
    started = time.perf_counter()
    gpu = gpu_name(setup)
    images = out / "images"
    images.mkdir(parents=True, exist_ok=True)
    results = load_results(out)
    results.update(gpu=gpu, driver=driver_version() if setup.device == "cuda" else None,
                   versions={**results.get("versions", {}), **versions()}, command=list(sys.argv),
                   args=argv, date=now())
    entry = config_entry(results, setup, skip)
    entry.update(name=setup.name, controlnets=setup.controlnets, loras=setup.loras, **setup.placement(),
                 runtime=setup.resolved_runtime, gpu=gpu, size=setup.size, steps=setup.steps,
                 throughput_steps=setup.throughput_steps,
                 runs=setup.runs, concurrency=list(setup.concurrency), device=setup.device, dtype=setup.dtype,
                 prompt=PROMPT, guidance_scale=GUIDANCE, scheduler=SCHEDULER, command=results["command"], args=argv)

    def save():
        write_report(results, out)

    prep = own_adapters(setup, prepare(setup))
    entry.update(write_model_s=prep["write_model_s"], adapters_s=prep["adapters_s"],
                 model_fingerprint=fingerprint(prep["model"]), lora_files=prep["loras"],
                 controlnet_names=prep["controlnets"])
    log.info("%s: model ready in %.1fs, adapters in %.1fs", setup.name, prep["write_model_s"], prep["adapters_s"])
    failed = 0
    phases = [("easel", lambda rec: measure_easel(setup, prep, images, rec, save, servers)),
              ("diffusers_eager", lambda rec: measure_diffusers(setup, prep, images, rec, save, compiled=False)),
              ("diffusers_compiled", lambda rec: measure_diffusers(setup, prep, images, rec, save, compiled=True))]
    for system, measure in phases:
        if system in skip:
            if system == "diffusers_compiled" and setup.smoke:
                entry[system] = {"skipped": "cpu smoke: no torch.compile on CPU"}
                log.info("%s: skipped (CPU smoke)", LABELS[system])
            else:
                log.info("%s: skipped%s", LABELS[system], " (kept from results.json)" if entry.get(system) else "")
            entry.setdefault(system, None)
            continue
        entry[system] = rec = {"model_fingerprint": entry["model_fingerprint"]}
        start = time.perf_counter()
        try:
            measure(rec)
        except Exception as exc:  # recorded; the other phases still run
            failed += 1
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()
            log.error("%s failed: %s", LABELS[system], rec["traceback"])
        except BaseException as exc:  # Ctrl-C or SIGTERM (a time limit): what was measured stays
            rec["error"] = f"interrupted ({type(exc).__name__}) after {time.perf_counter() - start:.1f}s"
            rec["phase_s"] = time.perf_counter() - start
            save()
            raise
        rec["phase_s"] = time.perf_counter() - start
        save()
        log.info("%s: phase done in %.1fs", LABELS[system], rec["phase_s"])
    prints = {(entry.get(s) or {}).get("model_fingerprint") for s in SYSTEMS} - {None}
    if len(prints) > 1:
        entry["warning"] = f"phases measured different weights (fingerprints {sorted(prints)}): fidelity is void"
        log.warning(entry["warning"])
    if (entry.get("easel") or {}).get("tritonserver"):
        results["versions"]["tritonserver"] = entry["easel"]["tritonserver"]
    entry["total_s"] = time.perf_counter() - started
    write_report(results, out, final=True)
    summarize(entry, gpu)
    return 1 if failed else 0


def summarize(e: dict, gpu: str) -> None:
    log.info("%s on %s, %d px, %d steps: Easel (%s) p50 %s s p95 %s s; diffusers eager p50 %s s; compiled (%s) "
             "p50 %s s; Easel/eager %s, Easel/compiled %s", e["name"], gpu, e["size"], e["steps"],
             e.get("easel_runtime"), secs(e["easel_p50_s"]), secs(e["easel_p95_s"]), secs(e["diffusers_eager_p50_s"]),
             e.get("diffusers_compile_mode") or "n/a", secs(e["diffusers_compiled_p50_s"]),
             times(e["ratio_easel_over_diffusers_eager"]), times(e["ratio_easel_over_diffusers_compiled"]))
    for c, row in e["throughput_img_s"].items():
        log.info("throughput c=%s (%s steps): Easel %s, diffusers eager %s, compiled %s images/s", c,
                 e.get("throughput_steps"), secs(row["easel"]), secs(row["diffusers_eager"]),
                 secs(row["diffusers_compiled"]))
    log.info("Easel stages (median s): %s", {k: round(v, 4) for k, v in (e.get("easel_stages_median_s") or {}).items()})
    ideal = (e.get("easel") or {}).get("controlnet_ideal")
    if ideal:
        log.info("ControlNets, ms a step: encoder %.1f, ControlNet %.1f, decoder %.1f, waited %.1f; step %.1f, "
                 "Gustafson's ideal %.1f, serial %.1f: speed-up %s of the ideal's %s (%.0f%% of the ideal)",
                 ideal["encoder_ms"], ideal["controlnet_ms"], ideal["decoder_ms"], ideal["wait_ms"], ideal["step_ms"],
                 ideal["ideal_step_ms"], ideal["serial_step_ms"], times(ideal["speedup"]),
                 times(ideal["ideal_speedup"]), 100 * ideal["of_ideal"])
    log.info("cold start: first %s s (cache empty), second %s s (cache warm)", secs(e["cold_start_first_s"], 1),
             secs(e["cold_start_second_s"], 1))
    f = e.get("fidelity") or {}
    log.info("fidelity seed 0, Easel vs diffusers eager: %s", "identical" if f.get("identical") else
             f"PSNR {secs(f.get('psnr_db'), 2)} dB, SSIM {secs(f.get('ssim'), 5)}, max diff {f.get('max_abs_diff')}"
             if f else "n/a")


def _terminate(signum, _frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    from clients.bench.common import start_logging

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    start_logging()
    if args.replot is not None:
        written = []
        if (args.replot / "edits.json").is_file():
            from clients.bench.edits import replot

            written += replot(args.replot)
        if (args.replot / "results.json").is_file():
            (args.replot / "results.md").write_text(markdown(json.loads((args.replot / "results.json").read_text())))
            written += plot(args.replot / "results.json")
        for path in written:
            log.info("wrote %s", path)
        return 0
    setups = resolve_all(args)
    setup = setups[0]
    if setup.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("easel bench: no CUDA device (use --cpu-smoke to test the script on CPU)")
    out = args.out or RESULTS_DIR / f"{datetime.date.today().isoformat()}-{gpu_slug(gpu_name(setup), len(setup.denoiser_gpus))}"
    skip = {s for s, flag in (("easel", args.skip_easel), ("diffusers_eager", args.skip_diffusers_eager),
                              ("diffusers_compiled", args.skip_diffusers_compiled or setup.smoke)) if flag}
    setup.work.mkdir(parents=True, exist_ok=True)
    # SIGTERM (`timeout`, a time limit) unwinds like Ctrl-C: servers stop, results are saved.
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _terminate)
    try:
        if args.edit:
            from clients.bench.edits import run_edits

            run_edits(setup, out, skip, args.load_rates, args.load_requests, args.template_cache_gib)
            print(out / "edits.json")
            return 0
        code = 0
        with Servers(keep=shares_server(args)) as servers:
            for each in setups:  # configurations one after another, into the same results
                code |= run(each, out, skip, argv, servers)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    print(out / "results.json")
    return code


if __name__ == "__main__":
    sys.exit(main())
