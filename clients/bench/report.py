"""The report of `easel bench` (clients/bench/harness.py): each configuration's summary (medians,
ratios, throughput table, image fidelity), the checks of the JSON's required keys, the Markdown
table and the plots. Reads and writes files only; `--replot DIR` redraws from committed JSON."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np

log = logging.getLogger("easel.bench")

GUIDANCE = 5.0  # every request of the bench, Easel and diffusers
SYSTEMS = ("easel", "diffusers_eager", "diffusers_compiled")
LABELS = {"easel": "Easel", "diffusers_eager": "diffusers eager", "diffusers_compiled": "diffusers compiled"}
REQUIRED_TOP = ("gpu", "driver", "versions", "command", "date", "configs")
REQUIRED_CONFIG = ("name", "gpus", "steps", "size", "easel_p50_s", "easel_p95_s", "diffusers_eager_p50_s",
                   "diffusers_compiled_p50_s", "throughput_img_s")


# --- statistics and the summary of one configuration --------------------------------------------


def percentile(samples, q: float) -> float | None:
    """Linear interpolation between order statistics (numpy's default); None without samples."""
    return float(np.percentile(np.asarray(samples, dtype=float), q)) if samples else None


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def phase(entry: dict, system: str) -> dict:
    """A phase's record when it measured something (not skipped, not failed before its samples)."""
    rec = entry.get(system) or {}
    return rec if rec.get("latency_s") else {}


def finalize(entry: dict, images: Path | None = None) -> dict:
    """Fill the summary fields of one configuration from its raw sections (in place)."""
    for system in SYSTEMS:
        samples = phase(entry, system).get("latency_s") or []
        entry[f"{system}_p50_s"] = percentile(samples, 50)
        entry[f"{system}_p95_s"] = percentile(samples, 95)
    entry["ratio_easel_over_diffusers_eager"] = _ratio(entry["easel_p50_s"], entry["diffusers_eager_p50_s"])
    entry["ratio_easel_over_diffusers_compiled"] = _ratio(entry["easel_p50_s"], entry["diffusers_compiled_p50_s"])
    levels = sorted({int(c) for system in SYSTEMS for c in (entry.get(system) or {}).get("throughput", {})})
    entry["throughput_img_s"] = {
        str(c): {system: ((entry.get(system) or {}).get("throughput", {}).get(str(c)) or {}).get("img_s")
                 for system in SYSTEMS} for c in levels}
    easel = entry.get("easel") or {}
    entry["easel_stages_median_s"] = easel.get("stages_median_s")
    cold = {} if easel.get("shared_compile_cache") else easel.get("cold_start_s") or {}  # a shared cache: not cold
    entry["cold_start_first_s"], entry["cold_start_second_s"] = cold.get("first"), cold.get("second")
    entry["easel_runtime"] = easel.get("runtime") or entry.get("runtime")
    entry["diffusers_compile_mode"] = (entry.get("diffusers_compiled") or {}).get("mode")
    if images is not None:  # a run that skipped a phase keeps the comparison made when its images existed
        for key, found in (("fidelity", compare_images(images, entry["name"], "easel", "diffusers_eager",
                                                       entry["easel_runtime"])),
                           ("fidelity_compiled_vs_eager", compare_images(images, entry["name"], "diffusers_compiled",
                                                                         "diffusers_eager"))):
            if found is not None or entry.get(key) is None:
                entry[key] = found
    entry.setdefault("fidelity", None)
    return entry


def image_path(images: Path, name: str, system: str, runtime: str | None = None) -> Path:
    """The seed-0 image of a configuration's system (Easel's per runtime)."""
    tag = f"{system}-{runtime}" if system == "easel" and runtime else system
    return images / f"{name.replace('/', '-')}-{tag}-seed0.png"


def compare_images(images: Path, name: str, system: str, reference: str, runtime: str | None = None) -> dict | None:
    """PSNR and SSIM of `system`'s seed-0 image against `reference`'s (uint8 RGB), if both exist."""
    from PIL import Image

    from clients.bench import image_metrics

    a_path, b_path = image_path(images, name, system, runtime), image_path(images, name, reference)
    if not (a_path.is_file() and b_path.is_file()):
        return None
    a = np.asarray(Image.open(a_path).convert("RGB"))
    b = np.asarray(Image.open(b_path).convert("RGB"))
    if a.shape != b.shape:
        return {"error": f"shapes differ: {a.shape} vs {b.shape}"}
    diff = np.abs(a.astype(np.int16) - b.astype(np.int16))
    psnr = image_metrics.psnr(a, b)
    out = {"image": a_path.name, "reference": b_path.name, "identical": bool(diff.max() == 0),
           # None when identical (infinite PSNR: JSON has no infinity)
           "psnr_db": None if math.isinf(psnr) else psnr,
           "max_abs_diff": int(diff.max()), "mean_abs_diff": float(diff.mean())}
    if hasattr(image_metrics, "ssim"):
        out["ssim"] = image_metrics.ssim(a, b)
    return out


def validate(results: dict) -> list[str]:
    """The required keys that are missing (empty when the file has the agreed layout)."""
    missing = [k for k in REQUIRED_TOP if k not in results]
    for index, entry in enumerate(results.get("configs", [])):
        missing += [f"configs[{index}].{k}" for k in REQUIRED_CONFIG if k not in entry]
        for c, row in (entry.get("throughput_img_s") or {}).items():
            missing += [f"configs[{index}].throughput_img_s[{c}].{s}" for s in SYSTEMS if s not in row]
    return missing


# --- the report ------------------------------------------------------------------------------


def secs(value, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def times(value) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def markdown(results: dict) -> str:
    """results.json as Markdown tables."""
    configs = results.get("configs", [])
    gpu = results.get("gpu")

    def label(e):  # entries of one configuration differ in Easel's runtime: the tables below name it
        return f"{e['name']} ({e['easel_runtime']})" if e.get("easel_runtime") else e["name"]

    v = results.get("versions") or {}
    lines = [f"# Easel bench: {gpu}, {results.get('date')}", "",
             f"Driver {results.get('driver') or 'n/a'}; "
             + ", ".join(f"{k} {val}" for k, val in v.items() if val) + ".", "",
             "Command: `" + " ".join(results.get("command") or []) + "`", "",
             ("CPU smoke: the tiny random model, fp32; this tests the script, it measures nothing. " if gpu == "cpu"
              else "Random weights, SDXL base's shapes. ")
             + "Latency: one request at a time, seeds 0..runs-1, "
             f"guidance {GUIDANCE}, Euler. Easel's time is the client's (gRPC, PNG encoding included); "
             "diffusers' ends at the PIL images in memory. p95 of a few samples is close to their maximum."
             + (" LoRAs: Easel loads them per request (from the page cache) and merges them; diffusers loads, "
                "fuses and unloads them once before timing (a fixed style)." if any(e.get("loras") for e in configs)
                else ""), "",
             "## Latency", "",
             "| configuration | GPU | size | steps | Easel runtime | Easel p50 / p95 | diffusers eager p50 / p95 "
             "| diffusers compiled p50 / p95 (mode) | Easel / eager | Easel / compiled |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in configs:
        lines.append(
            f"| {e['name']} | {gpu} x{len(e.get('gpus') or [0])} | {e['size']} | {e['steps']} "
            f"| {e.get('easel_runtime') or 'n/a'} "
            f"| {secs(e.get('easel_p50_s'))} / {secs(e.get('easel_p95_s'))} s "
            f"| {secs(e.get('diffusers_eager_p50_s'))} / {secs(e.get('diffusers_eager_p95_s'))} s "
            f"| {secs(e.get('diffusers_compiled_p50_s'))} / {secs(e.get('diffusers_compiled_p95_s'))} s "
            f"({e.get('diffusers_compile_mode') or 'n/a'}) "
            f"| {times(e.get('ratio_easel_over_diffusers_eager'))} | {times(e.get('ratio_easel_over_diffusers_compiled'))} |")
    lines += ["", "## Throughput (images/s)", "",
              "Easel: c clients send at once, a few rounds, images / wall time. "
              "diffusers: one call with c prompts.", "",
              "| configuration | steps | concurrency | Easel | diffusers eager | diffusers compiled | Easel / eager "
              "| Easel / compiled |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e in configs:
        for c, row in (e.get("throughput_img_s") or {}).items():
            lines.append(f"| {label(e)} | {e.get('throughput_steps', 'n/a')} | {c} | {secs(row.get('easel'))} "
                         f"| {secs(row.get('diffusers_eager'))} | {secs(row.get('diffusers_compiled'))} "
                         f"| {times(_ratio(row.get('easel'), row.get('diffusers_eager')))} "
                         f"| {times(_ratio(row.get('easel'), row.get('diffusers_compiled')))} |")
    stage_names = sorted({k for e in configs for k in (e.get("easel_stages_median_s") or {})})
    if stage_names:
        lines += ["", "## Easel stages (median seconds of the latency requests, from each response's `info`)", "",
                  "| configuration | " + " | ".join(stage_names) + " |",
                  "| --- |" + " --- |" * len(stage_names)]
        for e in configs:
            stages = e.get("easel_stages_median_s") or {}
            lines.append(f"| {label(e)} | " + " | ".join(secs(stages.get(k), 4) for k in stage_names) + " |")
    breakdowns = [(label(e), (e.get("easel") or {}).get("controlnet_per_call")) for e in configs]
    if any(b for _, b in breakdowns):
        lines += ["", "## ControlNet calls (latency requests; means per call, from the server's metrics)", "",
                  "BLS wall: the denoiser's call, from submitting it to its residuals on the denoiser's GPU, in parts "
                  "where the server reports them: waiting for the step's inputs on the GPU, the BLS request (the "
                  "service's compute and the hand-off: Triton and the residuals' transfer), taking the residuals.", "",
                  "| configuration | calls | BLS wall ms | inputs wait ms | BLS request ms | service compute ms "
                  "| hand-off ms | taking residuals ms | transfer + overhead ms | decoder wait ms / step "
                  "| graph replays | session misses |", "| --- |" + " --- |" * 11]
        for name, b in breakdowns:
            if b:
                lines.append(f"| {name} | {b['calls']:.0f} | " + " | ".join(secs(b.get(k), 1) for k in (
                    "bls_wall_ms", "ready_ms", "exec_ms", "compute_ms", "handoff_ms", "outputs_ms",
                    "transfer_and_overhead_ms", "decoder_wait_ms_per_step"))
                    + f" | {b.get('graph_replays', 0):.0f} | {b.get('session_misses', 0):.0f} |")
    ideals = [(label(e), (e.get("easel") or {}).get("controlnet_ideal")) for e in configs]
    if any(i for _, i in ideals):
        lines += ["", "## ControlNets against Gustafson's ideal (same run's parts, ms per step)", "",
                  "Ideal: each ControlNet on a GPU of its own beside the encoder half, max(encoder, ControlNet) + "
                  "decoder + the rest; serial: encoder + k ControlNets + decoder + the rest.", "",
                  "| configuration | encoder | decoder | ControlNet | wait | step | ideal step | serial step "
                  "| ideal speed-up | speed-up | of ideal |", "| --- |" + " --- |" * 10]
        for name, i in ideals:
            if i:
                lines.append(f"| {name} | " + " | ".join(secs(i[k], 1) for k in (
                    "encoder_ms", "decoder_ms", "controlnet_ms", "wait_ms", "step_ms", "ideal_step_ms", "serial_step_ms"))
                    + f" | {times(i['ideal_speedup'])} | {times(i['speedup'])} | {i['of_ideal']:.0%} |")
    lines += ["", "## Cold start", "",
              "Easel: launch to ready, first start with the repository's compile cache empty, second start on the "
              "same repository. Runtime warm-up: `easel_runtime_warmup_seconds` (capturing/compiling buckets at load). "
              "diffusers: the first call of the compiled UNet (compiling included). Configurations that shared a "
              "server were served by one repository exported for the most adapters of any of them; its export and "
              "starts are the first one's.", "",
              "| configuration | Easel runtime | server | export s | first start s | second start s | runtime warm-up s "
              "(first / second) | diffusers load s | diffusers compile + first call s |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for e, shared in zip(configs, server_sharing(configs)):
        easel = e.get("easel") or {}
        warm = easel.get("runtime_warmup_s") or {}
        compiled = e.get("diffusers_compiled") or {}
        server = f"shared with {', '.join(shared)}" if shared else "own" if easel else "n/a"
        lines.append(f"| {e['name']} | {e.get('easel_runtime') or 'n/a'} | {server} | {secs(easel.get('export_s'), 1)} "
                     f"| {secs(e.get('cold_start_first_s'), 1)} | {secs(e.get('cold_start_second_s'), 1)} "
                     f"| {secs(warm.get('first'), 1)} / {secs(warm.get('second'), 1)} "
                     f"| {secs((e.get('diffusers_eager') or {}).get('load_s'), 1)} "
                     f"| {secs(compiled.get('compile_s'), 1)} |")
    lines += ["", "## Image fidelity (seed 0)", "",
              "| configuration | compared | PSNR dB | SSIM | max abs diff (uint8) |", "| --- | --- | --- | --- | --- |"]
    for e in configs:
        for compared, f in (("Easel vs diffusers eager", e.get("fidelity")),
                         ("diffusers compiled vs eager", e.get("fidelity_compiled_vs_eager"))):
            if not f or "error" in f:
                lines.append(f"| {label(e)} | {compared} | {(f or {}).get('error', 'n/a')} | | |")
                continue
            psnr = "inf (identical)" if f.get("identical") else secs(f.get("psnr_db"), 2)
            lines.append(f"| {label(e)} | {compared} | {psnr} | {secs(f.get('ssim'), 5)} | {f.get('max_abs_diff')} |")
    lines += _session_runs(results)
    failures = [(e["name"], s, (e.get(s) or {}).get("error")) for e in configs for s in SYSTEMS
                if (e.get(s) or {}).get("error")]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {n} {LABELS[s]}: {err.splitlines()[0]}" for n, s, err in failures]
    lines += ["", "Plots: `latency.png` (p50, whiskers to p95), `throughput.png`. Raw samples, per-request `info`, "
              "and the server's metrics: `results.json`.", ""]
    return "\n".join(lines)


def server_sharing(configs: list[dict]) -> list[list[str]]:
    """For each configuration, the others Easel measured on the same tritonserver (`easel.server.id`)."""
    ids = [((e.get("easel") or {}).get("server") or {}).get("id") for e in configs]
    return [[other["name"] for other, its in zip(configs, ids) if its == mine and other is not e] if mine else []
            for e, mine in zip(configs, ids)]


def _session_runs(results: dict) -> list[str]:
    """Every phase a session ran, when several runs were pooled into one folder (`session_runs`:
    run, system, machine, latency samples, throughput), so that the spread shows beside the table."""
    runs = results.get("session_runs") or []
    if not runs:
        return []
    levels = sorted({int(c) for r in runs for c in r.get("throughput_img_s", {})})
    lines = ["", "## Runs", "", results.get("session_note", ""), "",
             "| run | system | machine | p50 s (min-max) | " + " | ".join(f"c={c} img/s" for c in levels) + " |",
             "| --- | --- | --- | --- |" + " --- |" * len(levels)]
    for r in runs:
        samples = r.get("latency_s") or []
        spread = f"{secs(percentile(samples, 50))} ({secs(min(samples))}-{secs(max(samples))})" if samples else "n/a"
        thr = r.get("throughput_img_s") or {}
        lines.append(f"| {r['run']} | {LABELS.get(r['system'], r['system'])} | {r.get('machine', 'n/a')} | {spread} | "
                     + " | ".join(secs(thr.get(str(c))) for c in levels) + " |")
    return lines


def plot(results_json_path: str | Path) -> list[Path]:
    """latency.png and throughput.png beside results.json (regenerable from committed JSON)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(results_json_path)
    results = json.loads(path.read_text())
    configs = results.get("configs", [])
    colors = {"easel": "#1f77b4", "diffusers_eager": "#ff7f0e", "diffusers_compiled": "#2ca02c"}
    written = []
    # Where and how it was measured, in each title: a plot travels without its table.
    dtypes = sorted({e.get("dtype") for e in configs if e.get("dtype")})
    gpus = max([len(e.get("gpus") or [0]) for e in configs] + [1])
    setting = ", ".join([f"{results.get('gpu') or '?'}" + (f" x{gpus}" if gpus > 1 else ""), *dtypes,
                         str(results.get("date") or "")[:10]])

    fig, ax = plt.subplots(figsize=(max(6.5, 2.4 * len(configs) + 2.5), 4.8))
    width = 0.27
    top = max([e.get(f"{s}_p95_s") or e.get(f"{s}_p50_s") or 0.0 for e in configs for s in SYSTEMS] + [1e-9])
    handles = []
    for j, system in enumerate(SYSTEMS):
        xs, p50s, ups = [], [], []
        for i, e in enumerate(configs):
            x, p50, p95 = i + (j - 1) * width, e.get(f"{system}_p50_s"), e.get(f"{system}_p95_s")
            if p50 is None:
                ax.text(x, 0.02 * top, "not run", ha="center", va="bottom", fontsize=8, color=colors[system])
                continue
            xs.append(x)
            p50s.append(p50)
            ups.append(max(0.0, (p95 if p95 is not None else p50) - p50))
            ax.text(x, p50 + ups[-1] + 0.015 * top, f"{p50:.2f}", ha="center", va="bottom", fontsize=8)
        if xs:
            ax.bar(xs, p50s, width, yerr=[[0.0] * len(ups), ups], capsize=4, color=colors[system])
        handles.append(Patch(color=colors[system], label=LABELS[system] + ("" if xs else ": n/a")))
    ax.set_xlim(-0.6, len(configs) - 0.4)
    ax.set_ylim(0, top * 1.32)  # room for the legend above the bars
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"{e['name']}\n{e['size']} px, {e['steps']} steps\nEasel {e.get('easel_runtime') or '?'}"
                        for e in configs])
    runs = sorted({e.get("runs") for e in configs if e.get("runs")})
    ax.set_ylabel("seconds per image, lower is better\n"
                  f"(bar: p50{' of ' + '-'.join(map(str, runs[::max(1, len(runs) - 1)])) + ' runs' if runs else ''}; "
                  "whisker: p95)")
    ax.set_title(f"Latency, one request at a time: {setting}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(handles=handles, loc="upper center", ncol=3, fontsize=9)
    fig.tight_layout()
    written.append(path.parent / "latency.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)

    # One y scale for all panels, so that runtimes compare by eye.
    fig, axes = plt.subplots(1, max(1, len(configs)), figsize=(max(7.0, 5.2 * len(configs)), 4.6), squeeze=False,
                             sharey=True)
    for ax, e in zip(axes[0], configs):
        rows = e.get("throughput_img_s") or {}
        levels = sorted(int(c) for c in rows)
        for system in SYSTEMS:
            points = [(c, rows[str(c)].get(system)) for c in levels if rows[str(c)].get(system) is not None]
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", color=colors[system],
                        label=LABELS[system])
        ax.set_xticks(levels)
        ax.set_xlabel("concurrent requests (diffusers: batch size)")
        ax.set_title(f"{e['name']}, {e['size']} px, {e.get('throughput_steps', '?')} steps, "
                     f"Easel {e.get('easel_runtime') or e.get('runtime') or '?'}", fontsize=11)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=9, loc="lower right")
    axes[0][0].set_ylabel("images per second, higher is better")
    fig.suptitle(f"Throughput against concurrency: {setting}")
    fig.tight_layout()
    written.append(path.parent / "throughput.png")
    fig.savefig(written[-1], dpi=120)
    plt.close(fig)
    return written


def write_report(results: dict, out: Path, final: bool = False) -> None:
    """results.json and results.md as far as measured (a time limit still leaves them); the final
    write also compares the images and draws the plots."""
    out.mkdir(parents=True, exist_ok=True)
    for entry, shared in zip(results["configs"], server_sharing(results["configs"])):
        finalize(entry, out / "images" if final else None)
        entry["easel_server_shared_with"] = shared
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    (out / "results.md").write_text(markdown(results))
    if final:
        try:
            plot(out / "results.json")
        except ImportError as exc:  # the GPU image may lack matplotlib: --replot elsewhere
            log.warning("no plots (%s); rerun with --replot %s where matplotlib is installed", exc, out)


def main(argv: list[str] | None = None) -> int:
    """`python -m clients.bench.report DIR...` (`make bench-plots`): redraw the plots of each result
    folder from its results.json, and nothing else (the committed tables
    stay as they are)."""
    import argparse

    from clients.bench.common import start_logging

    parser = argparse.ArgumentParser(prog="python -m clients.bench.report", description=main.__doc__)
    parser.add_argument("folders", nargs="+", type=Path, help="bench/results/<date>-<gpu>/ folders")
    args = parser.parse_args(argv)
    start_logging()
    for folder in args.folders:
        if not (folder / "results.json").is_file():
            log.info("%s: no results.json, nothing to plot", folder)
            continue
        for path in plot(folder / "results.json"):
            log.info("wrote %s", path)
    return 0


def load_results(out: Path) -> dict:
    path = out / "results.json"
    if path.is_file():
        results = json.loads(path.read_text())
        log.info("merging into %s (configurations: %s)", path, [e.get("name") for e in results.get("configs", [])])
        return results
    return {"configs": []}


if __name__ == "__main__":
    raise SystemExit(main())
