"""`easel bench --edit`: template edits through tritonserver, reusing a recording against exact
inpainting of the same request.

One template (random pixels), one seed (a recording is kept per seed: the template's latents
outside the mask are noised with the request's noise), prompts that differ per request:

- Latency per mask ratio (a centered square of 5, 10, 20, 35 and 50% of the image): `--runs`
  edits computed exactly (no `template`), then one edit naming the template, untimed in the p50
  (`reuse_first_s`: it may capture its token share's graphs), then the same edits as the exact ones
  naming the template (reusing the recording made beforehand). p50 of each, the speed-up, and each
  reused image against the exact one of the same prompt: PSNR and SSIM of the whole image and of
  the masked region.
- Throughput: c clients at once, rounds back to back, every request's mask ratio drawn from a
  distribution with InstGenIE's trace's mean (0.11), exact against reusing, images/s.
- The template cache after the latency edits and after the throughput rounds, from the server's
  metrics: hits and bytes loaded by tier, the seconds edits were held for a load, and the GPU
  seconds steps stalled for streamed copies (`--template-cache-gib 0,48,0` streams every reuse from
  host memory; `--profile-template` runs `easel profile-template` first, so that Algorithm 1 plans
  which blocks take the recording).
- diffusers' StableDiffusionXLInpaintPipeline on the same weights, eager and with its UNet
  compiled: latency per mask ratio, and one call batching c edits per concurrency level.

`--conv-subsets` exports the server with the ResNet blocks of reusing edits on their mask's box
(RuntimeConfig.conv_subsets); the exact edits are the same either way.

Written into `<out>/edits.json` (saved after each mask ratio and phase), the server's log
`server-<routing>.log`, `edits.md` and the plots `edits_latency.png`, `edits_load.png` beside
the other configurations' results. Random weights: the
figures say what reuse costs and how far it moves an image, not how good pictures look.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import queue
import re
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from clients.bench.models import SCHEDULER
from export.profile_template import RATIOS, centered_mask
from clients.bench.report import GUIDANCE

log = logging.getLogger("easel.bench.edits")

TRACE_MEAN_RATIO = 0.11  # InstGenIE's production trace (0.19 in the public one it cites)
TEMPLATE = "bench-template"
SEED = 7
SAMPLING = dict(guidance_scale=GUIDANCE, scheduler=SCHEDULER)  # diffusers' EulerDiscreteScheduler, guided
# Device memory for recordings: SDXL at 1024 px with guidance is 0.42 GB a step.
GPU_TEMPLATE_CACHE_GIB = (48.0, 0.0, 0.0)


def trace_ratios(count: int, seed: int = 0) -> list[float]:
    """Mask ratios with the trace's mean: exponential, kept within the measured 0.05-0.5."""
    rng = np.random.default_rng(seed)
    return [float(np.clip(r, 0.05, 0.5)) for r in rng.exponential(TRACE_MEAN_RATIO, count)]


def _png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def _pixels(result) -> np.ndarray:
    return np.asarray(result.image().convert("RGB"))


def _stages(info: dict) -> dict[str, float]:
    """Where an edit's seconds went, as its response says: each stage's, the denoiser's queue and
    admission, and the server's total."""
    out = {k: float(v) for k, v in info.get("stages_s", {}).items() if isinstance(v, (int, float))}
    out.update({k: float(info[k]) for k in ("queue_s", "admit_s", "total_s") if info.get(k) is not None})
    return out


def compare(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> dict:
    from clients.bench.image_metrics import psnr, ssim

    ys, xs = np.nonzero(mask)
    box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
    return {"psnr": psnr(got, want), "ssim": ssim(got, want),
            "masked_psnr": psnr(got[box], want[box]), "masked_ssim": ssim(got[box], want[box])}


def record(url: str, setup, template: bytes, steps: int, denoisers: int) -> float:
    """The template's recording at `steps` (one is kept per step count) on every denoiser, then
    reusing edits to each (the reusing path's first runs; each denoiser prices such steps,
    engine/step_cost.py). Returns the first recording's seconds."""
    from clients.client import EaselClient

    def edit(prompt: str, ratio: float) -> str | None:
        with EaselClient(url, protocol="grpc") as client:
            return client.generate(prompt, steps=steps, width=setup.size, height=setup.size, seed=SEED, strength=1.0,
                                   image=template, template=TEMPLATE, mask_image=_png(centered_mask(setup.size, ratio)),
                                   **SAMPLING).info.get("template_use")

    start = time.perf_counter()
    use = edit("the recording", 0.2)
    seconds = time.perf_counter() - start
    if use != "recorded":
        raise RuntimeError(f"the template's first edit was {use}, not recorded")
    # Rounds of edits sent together (the router spreads them; a denoiser without the recording
    # records it) until a round after the first is reused throughout.
    with ThreadPoolExecutor(max_workers=2 * denoisers) as pool:
        for attempt in range(6):
            uses = list(pool.map(edit, [f"warm {attempt}-{i}" for i in range(2 * denoisers)], [0.05, 0.5] * denoisers))
            if attempt > 0 and set(uses) == {"reused"}:
                return seconds
    raise RuntimeError(f"edits of a recorded template were {uses} (is its cache too small?)")


def reused_edit(client, prompt: str, files: dict):
    """(seconds, result) of an edit naming the template that reused its recording (a denoiser
    that had not served the template records it first: sent again)."""
    for _ in range(3):
        start = time.perf_counter()
        result = client.generate(prompt, template=TEMPLATE, **files)
        seconds, use = time.perf_counter() - start, result.info.get("template_use")
        if use == "reused":
            return seconds, result
    raise RuntimeError(f"edits of a recorded template were {use}")


def latency(client, setup, template: bytes, out: dict, save=lambda: None) -> None:
    """Per mask ratio (RATIOS): exact edits, then reusing ones, into `out`; `save()` after each ratio."""
    request = dict(steps=setup.steps, width=setup.size, height=setup.size, seed=SEED, strength=1.0, image=template,
                   **SAMPLING)
    for ratio in RATIOS:
        mask = centered_mask(setup.size, ratio)
        files = dict(request, mask_image=_png(mask))
        row = out.setdefault(str(ratio), {"mask_ratio": float((mask > 0).mean())})
        exact, reused, row["exact_s"], row["reuse_s"], row["quality"] = [], [], [], [], []
        stages = {"exact": [], "reuse": []}
        for i in range(setup.runs):
            start = time.perf_counter()
            result = client.generate(f"an edit {i}", **files)
            row["exact_s"].append(time.perf_counter() - start)
            exact.append(_pixels(result))
            stages["exact"].append(_stages(result.info))
        # Untimed: a mask's first reusing step of a token share captures that share's graphs
        # (runtime/torch_fast.py), once per server; kept apart from the p50.
        row["reuse_first_s"], _ = reused_edit(client, "a first edit", files)
        for i in range(setup.runs):
            seconds, result = reused_edit(client, f"an edit {i}", files)
            row["reuse_s"].append(seconds)
            reused.append(_pixels(result))
            stages["reuse"].append(_stages(result.info))
            row["quality"].append(compare(reused[-1], exact[i], mask))
        row["exact_p50_s"], row["reuse_p50_s"] = float(np.median(row["exact_s"])), float(np.median(row["reuse_s"]))
        row["speedup"] = row["exact_p50_s"] / row["reuse_p50_s"]
        row["stages_p50_s"] = {path: {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
                               for path, runs in stages.items()}
        row["psnr_median"] = float(np.median([q["psnr"] for q in row["quality"]]))
        row["masked_psnr_median"] = float(np.median([q["masked_psnr"] for q in row["quality"]]))
        log.info("mask %.2f: exact p50 %.3fs, reused %.3fs (%.2fx); PSNR %.2f dB (masked %.2f)", ratio,
                 row["exact_p50_s"], row["reuse_p50_s"], row["speedup"], row["psnr_median"], row["masked_psnr_median"])
        save()


def throughput(url: str, setup, template: bytes, c: int) -> dict:
    """c clients send at once, `rounds` rounds back to back, exact then reusing; masks from the trace."""
    from clients.client import EaselClient

    rounds = setup.easel_rounds(c)
    ratios = trace_ratios(c * rounds, seed=c)
    masks = [_png(centered_mask(setup.size, r)) for r in ratios]
    clients = [EaselClient(url, protocol="grpc") for _ in range(c)]
    out = {"concurrency": c, "rounds": rounds, "mask_ratios": ratios}
    try:
        with ThreadPoolExecutor(max_workers=c) as pool:
            for mode, extra in (("exact", {}), ("reuse", {"template": TEMPLATE})):
                walls, uses = [], []
                for r in range(rounds):
                    barrier = threading.Barrier(c + 1)

                    def one(i: int, r=r, extra=extra):
                        barrier.wait()
                        return clients[i].generate(
                            f"edit {r}-{i}", steps=setup.throughput_steps, width=setup.size, height=setup.size,
                            seed=SEED, strength=1.0, image=template, mask_image=masks[r * c + i], **SAMPLING,
                            **extra).info

                    futures = [pool.submit(one, i) for i in range(c)]
                    barrier.wait()
                    start = time.perf_counter()
                    uses += [f.result().get("template_use") for f in futures]
                    walls.append(time.perf_counter() - start)
                out[mode] = {"round_wall_s": walls, "img_s": c * rounds / sum(walls), "template_use": uses}
    finally:
        for client in clients:
            client.close()
    out["speedup"] = out["reuse"]["img_s"] / out["exact"]["img_s"]
    log.info("c=%d: exact %.3f images/s, reusing %.3f (%.2fx)", c, out["exact"]["img_s"], out["reuse"]["img_s"],
             out["speedup"])
    return out


def diffusers_edits(setup, model: Path, template: np.ndarray, compiled: bool) -> dict:
    """StableDiffusionXLInpaintPipeline, what a diffusers user runs (eager, or its UNet under
    torch.compile's reduce-overhead): latency per mask ratio, one call batching c edits per
    concurrency level (the same masks' distribution as Easel's rounds)."""
    import torch
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLInpaintPipeline
    from PIL import Image

    from clients.bench.models import WARMUP_STEPS, free_gpu

    dtype = torch.float16 if setup.dtype == "fp16" else torch.float32
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(model, dtype=dtype, add_watermarker=False)
    pipe.scheduler = EulerDiscreteScheduler.from_config(pipe.scheduler.config)  # the requests' `euler`
    pipe = pipe.to(setup.torch_device)
    pipe.set_progress_bar_config(disable=True)
    image = Image.fromarray(template)

    def call(count: int, steps: int, masks: list[np.ndarray]) -> float:
        if setup.device == "cuda":
            torch.cuda.synchronize(setup.torch_device)
        start = time.perf_counter()
        pipe([f"an edit {i}" for i in range(count)], image=[image] * count,
             mask_image=[Image.fromarray(m) for m in masks], width=setup.size, height=setup.size, strength=1.0,
             num_inference_steps=steps, guidance_scale=GUIDANCE,
             generator=[torch.Generator("cpu").manual_seed(SEED) for _ in range(count)])
        if setup.device == "cuda":
            torch.cuda.synchronize(setup.torch_device)
        return time.perf_counter() - start

    out = {"compiled": compiled, "latency": {}, "throughput": {}}
    try:
        if compiled:
            pipe.unet = torch.compile(pipe.unet, mode="reduce-overhead")
        out["warmup_s"] = call(1, WARMUP_STEPS, [centered_mask(setup.size, 0.2)])
        for ratio in RATIOS:
            seconds = [call(1, setup.steps, [centered_mask(setup.size, ratio)]) for _ in range(setup.runs)]
            out["latency"][str(ratio)] = {"s": seconds, "p50_s": float(np.median(seconds))}
            log.info("diffusers %s, mask %.2f: p50 %.3fs", "compiled" if compiled else "eager", ratio,
                     out["latency"][str(ratio)]["p50_s"])
        for c in setup.concurrency:
            masks = [centered_mask(setup.size, r) for r in trace_ratios(c * setup.easel_rounds(c), seed=c)[:c]]
            warmup = call(c, WARMUP_STEPS, masks)
            wall = call(c, setup.throughput_steps, masks)
            out["throughput"][str(c)] = {"batch": c, "wall_s": wall, "img_s": c / wall, "warmup_s": warmup}
            log.info("diffusers %s, batch %d: %.3f images/s", "compiled" if compiled else "eager", c, c / wall)
    finally:
        del pipe
        if compiled:
            torch._dynamo.reset()
        free_gpu(setup)
    return out


def open_loop(url: str, setup, template: bytes, rate: float, count: int, seed: int) -> dict:
    """`count` reusing edits arriving as a Poisson process of `rate` per second (each sent at its
    time whatever is still running: open loop), masks from the trace; latency from arrival to image."""
    from clients.client import EaselClient

    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    ratios = trace_ratios(count, seed)
    masks = [_png(centered_mask(setup.size, r)) for r in ratios]
    width = min(count, 64)
    idle: queue.Queue = queue.Queue()
    for _ in range(width):
        idle.put(EaselClient(url, protocol="grpc"))
    latencies, uses = [0.0] * count, [None] * count

    def one(i: int, sent: float) -> None:
        client = idle.get()
        try:
            uses[i] = client.generate(f"a loaded edit {i}", steps=setup.throughput_steps, width=setup.size,
                                      height=setup.size, seed=SEED, strength=1.0, image=template, mask_image=masks[i],
                                      template=TEMPLATE, **SAMPLING).info.get("template_use")
        finally:
            idle.put(client)
        latencies[i] = time.perf_counter() - sent

    try:
        with ThreadPoolExecutor(max_workers=width) as pool:
            start = time.perf_counter()
            futures = []
            for i, at in enumerate(arrivals):
                time.sleep(max(0.0, start + at - time.perf_counter()))
                futures.append(pool.submit(one, i, time.perf_counter()))
            for f in futures:
                f.result()
    finally:
        while not idle.empty():
            idle.get().close()
    out = {"rate": rate, "count": count, "mask_ratios": ratios, "latency_s": latencies,
           "p50_s": float(np.percentile(latencies, 50)), "p95_s": float(np.percentile(latencies, 95)),
           "mean_s": float(np.mean(latencies)), "template_use": {u: uses.count(u) for u in set(uses)}}
    log.info("%.2f edits/s: p50 %.3fs, p95 %.3fs (%s)", rate, out["p50_s"], out["p95_s"], out["template_use"])
    return out


@contextlib.contextmanager
def serving(setup, model: Path, routing: str, denoisers: int, cache_gib: tuple[float, float, float], out_dir: Path):
    """A repository of `model` with a template cache of `cache_gib` and `routing` (easel export
    --routing), served by tritonserver for the block; yields (server, start seconds). The server's
    log is kept in `out_dir` as server-<routing>.log (its captures, compiles and errors)."""
    from clients.bench.servers import start_server
    from export.repository import ExportOptions, export_repository

    top = max(setup.concurrency)
    place = dict(cpu_denoisers=denoisers) if setup.smoke else dict(gpus=setup.gpus)
    options = ExportOptions(device=setup.device, dtype=setup.dtype, runtime=setup.runtime, routing=routing,
                            max_size=max(setup.size, 64), warmup_sizes=(setup.size,),
                            max_steps=max(150, setup.steps, setup.throughput_steps),
                            max_in_flight=max(56, top + 48), max_running=max(16, top),
                            max_batch_rows=max(16, 2 * top),
                            template_cache_gib=cache_gib, warmup_template_edits=True,
                            conv_subsets=setup.conv_subsets, **place)
    repo = setup.work / f"repo-edits-{routing}"
    export_repository(model, repo, options)
    if setup.profile_template:
        from export.profile_template import profile_template

        written = profile_template(repo, size=setup.size)
        shutil.copyfile(written[0], out_dir / written[0].name)
        if setup.device == "cuda":  # the profile's memory back to the device, for the server
            import torch

            torch.cuda.empty_cache()
    if setup.shared_compile_cache:
        from clients.bench.servers import share_compile_cache

        share_compile_cache(repo, setup.work / "compile-cache")
    server, start_s = start_server(repo, setup)
    try:
        yield server, start_s
    finally:
        server.stop()
        (out_dir / f"server-{routing}.log").write_text(server.log_text())


CACHE_METRICS = {  # edits.json's "template_cache" key -> the server's metric (summed over denoisers)
    "hits": "easel_template_hits_total", "misses": "easel_template_misses_total",
    "loaded_bytes": "easel_template_loaded_bytes_total", "wait_s": "easel_template_wait_seconds_total",
    "stall_s": "easel_template_stall_seconds_total",
}


def cache_figures(server) -> dict:
    """The server's template cache so far: hits and bytes loaded by tier, misses, the seconds edits
    waited for a load, and the GPU seconds steps stalled for streamed copies (0 where the copies
    hid behind compute)."""
    from clients.serve import scrape_metrics

    scraped = scrape_metrics(server.metrics_port, list(CACHE_METRICS.values()))
    out = {}
    for key, name in CACHE_METRICS.items():
        values = scraped[name]
        tiers = {}
        for labels, value in values.items():
            tier = re.search(r'tier="([^"]+)"', labels)
            if tier is not None:
                tiers[tier[1]] = tiers.get(tier[1], 0.0) + value
        out[key] = tiers if tiers else sum(values.values())
    return out


def _fmt(value, unit: str = "s", digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def markdown(results: dict) -> str:
    """edits.json as Markdown tables (edits.md)."""
    eager, compiled = results.get("diffusers_eager") or {}, results.get("diffusers_compiled") or {}
    cache = results.get("template_cache_gib")
    cache = f"; template cache {','.join(f'{g:g}' for g in cache)} GiB (device,host,disk)" if cache else ""
    if results.get("conv_subsets"):
        cache += "; ResNet blocks on the mask's box (--conv-subsets)"
    lines = [f"# Template edits ({results['device']}, gpus {results['gpus']}, {results['runtime']}; "
             f"{results['size']} px, {results['steps']} steps, seed {results['seed']}{cache})", "",
             "Random weights: the figures say what reusing a recording costs and how far it moves an image.", "",
             "## Latency per mask ratio (p50)", "",
             "| mask | exact | reusing | speed-up | reusing, first (untimed) | PSNR (masked) | diffusers eager | "
             "diffusers compiled |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ratio, row in results["latency"].items():
        lines.append(f"| {row['mask_ratio']:.2f} | {_fmt(row.get('exact_p50_s'))} | {_fmt(row.get('reuse_p50_s'))} | "
                     f"{_fmt(row.get('speedup'), 'x', 2)} | {_fmt(row.get('reuse_first_s'))} | "
                     f"{_fmt(row.get('psnr_median'), ' dB', 2)} "
                     f"({_fmt(row.get('masked_psnr_median'), ' dB', 2)}) | "
                     f"{_fmt(eager.get('latency', {}).get(ratio, {}).get('p50_s'))} | "
                     f"{_fmt(compiled.get('latency', {}).get(ratio, {}).get('p50_s'))} |")
    stages = [(row["mask_ratio"], row["stages_p50_s"]) for row in results["latency"].values() if "stages_p50_s" in row]
    if stages:
        names = sorted({k for _, paths in stages for runs in paths.values() for k in runs})
        lines += ["", "## Where an edit's seconds go (p50 per stage, as the responses report them)", "",
                  "| mask | path | " + " | ".join(n.removesuffix("_s") for n in names) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in names) + " |"]
        for ratio, paths in stages:
            for path, runs in paths.items():
                lines.append(f"| {ratio:.2f} | {path} | " + " | ".join(_fmt(runs.get(n)) for n in names) + " |")
    lines += ["", f"## Throughput ({results['throughput_steps']} steps, masks around a mean of {TRACE_MEAN_RATIO})", "",
              "| concurrency | exact | reusing | speed-up | diffusers eager (one batch) | diffusers compiled |",
              "| --- | --- | --- | --- | --- | --- |"]
    for c, row in results["throughput"].items():
        lines.append(f"| {c} | {_fmt(row['exact']['img_s'], ' img/s')} | {_fmt(row['reuse']['img_s'], ' img/s')} | "
                     f"{_fmt(row['speedup'], 'x', 2)} | "
                     f"{_fmt(eager.get('throughput', {}).get(c, {}).get('img_s'), ' img/s')} | "
                     f"{_fmt(compiled.get('throughput', {}).get(c, {}).get('img_s'), ' img/s')} |")
    def tiers(values):
        return ", ".join(f"{tier} {v:g}" for tier, v in values.items()) if isinstance(values, dict) else f"{values:g}"

    for key, when in (("template_cache_after_latency", "the latency runs"),
                      ("template_cache", "the latency and throughput runs")):
        cache = results.get(key)
        if cache:
            lines += ["", f"## Template cache (after {when})", "",
                      f"- hits: {tiers(cache['hits'])}; misses: {cache['misses']:g}",
                      f"- bytes loaded to the device: {tiers(cache['loaded_bytes'])}",
                      f"- edits held for a load: {_fmt(cache['wait_s'])}; steps stalled for streamed copies (GPU time): "
                      f"{_fmt(cache['stall_s'])}"]
    if results.get("load"):
        lines += ["", "## Open-loop load (reusing edits, Poisson arrivals)", "",
                  "| edits/s | routing | p50 | p95 | mean |", "| --- | --- | --- | --- | --- |"]
        for routing, rates in results["load"].items():
            for rate, row in rates.items():
                lines.append(f"| {rate} | {routing} | {_fmt(row['p50_s'])} | {_fmt(row['p95_s'])} | "
                             f"{_fmt(row['mean_s'])} |")
    return "\n".join(lines) + "\n"


def plot(path: Path) -> list[Path]:
    """edits_latency.png (p50 per mask ratio, each system) and, with a load run, edits_load.png (p95 per rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads(path.read_text())
    ratios = list(results["latency"])
    x = [results["latency"][r]["mask_ratio"] for r in ratios]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(x, [results["latency"][r]["exact_p50_s"] for r in ratios], "o-", label="Easel exact")
    ax.plot(x, [results["latency"][r]["reuse_p50_s"] for r in ratios], "o-", label="Easel reusing")
    for system in ("diffusers_eager", "diffusers_compiled"):
        if results.get(system):
            ax.plot(x, [results[system]["latency"][r]["p50_s"] for r in ratios], "o--", label=system.replace("_", " "))
    ax.set(xlabel="mask ratio", ylabel="p50 latency (s)", title=f"Template edits, {results['size']} px")
    ax.set_ylim(bottom=0)
    ax.legend()
    written = [path.parent / "edits_latency.png"]
    fig.savefig(written[0], dpi=120, bbox_inches="tight")
    plt.close(fig)
    if results.get("load"):
        fig, ax = plt.subplots(figsize=(6, 4))
        for routing, rates in results["load"].items():
            ax.plot([float(r) for r in rates], [row["p95_s"] for row in rates.values()], "o-",
                    label=f"{routing} routing")
        ax.set(xlabel="edits per second", ylabel="p95 latency (s)", title="Open-loop load")
        ax.set_ylim(bottom=0)
        ax.legend()
        written.append(path.parent / "edits_load.png")
        fig.savefig(written[1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return written


def write_report(results: dict, out_dir: Path, final: bool = False) -> None:
    """edits.json and edits.md as far as measured; the final write also draws the plots."""
    (out_dir / "edits.json").write_text(json.dumps(results, indent=1))
    (out_dir / "edits.md").write_text(markdown(results))
    if final:
        try:
            plot(out_dir / "edits.json")
        except ImportError as exc:  # the GPU image may lack matplotlib: --replot elsewhere
            log.warning("no plots (%s); rerun with --replot %s where matplotlib is installed", exc, out_dir)


def replot(out_dir: Path) -> list[Path]:
    """`easel bench --replot DIR`: edits.md and the plots again from DIR/edits.json."""
    (out_dir / "edits.md").write_text(markdown(json.loads((out_dir / "edits.json").read_text())))
    return plot(out_dir / "edits.json")


def run_edits(setup, out_dir: Path, skip: set[str] = frozenset(), load_rates: tuple[float, ...] = (),
              load_requests: int = 40, cache_gib: tuple[float, float, float] | None = None) -> dict:
    """Measures what the module's docstring says into `out_dir`/edits.json. With `load_rates`, the
    open-loop load at each rate, routed by predicted seconds (mask-aware) and by row-steps, on
    every --gpus denoiser (two on the CPU). `cache_gib`: the template cache's budgets (export
    --template-cache-gib)."""
    from clients.bench.common import tiny, random_sdxl
    from clients.client import EaselClient

    model = tiny(setup.work) if setup.smoke else random_sdxl(setup.work)
    denoisers = 2 if setup.smoke and load_rates else len(setup.gpus)
    if load_rates and denoisers < 2:
        raise SystemExit("easel bench --edit: --load-rates compares routings, which needs two --gpus or more")
    template_pixels = np.random.default_rng(1234).integers(0, 256, (setup.size, setup.size, 3), dtype=np.uint8)
    template = _png(template_pixels)
    results = {"size": setup.size, "steps": setup.steps, "throughput_steps": setup.throughput_steps,
               "runs": setup.runs, "device": setup.device, "gpus": list(setup.gpus), "runtime": setup.resolved_runtime,
               "seed": SEED, "conv_subsets": setup.conv_subsets, "latency": {}, "throughput": {}, "load": {}}
    cache_gib = cache_gib or ((1.0, 0.0, 0.0) if setup.smoke else GPU_TEMPLATE_CACHE_GIB)
    results["template_cache_gib"] = list(cache_gib)
    out_dir.mkdir(parents=True, exist_ok=True)

    def save():
        write_report(results, out_dir)

    for routing in ("seconds", "work") if load_rates else ("seconds",):
        with serving(setup, model, routing, denoisers, cache_gib, out_dir) as (server, start_s):
            results.setdefault("start_s", {})[routing] = start_s
            if routing == "seconds":
                with EaselClient(server.url_grpc, protocol="grpc") as client:
                    client.generate("warm up", steps=2, width=setup.size, height=setup.size, seed=0, strength=1.0,
                                    image=template, mask_image=_png(centered_mask(setup.size, 0.2)), **SAMPLING)
                    results["record_s"] = record(server.url_grpc, setup, template, setup.steps, denoisers)
                    latency(client, setup, template, results["latency"], save)
                # (the host tier's stalls are the latency edits' alone here, before the throughput rounds')
                results["template_cache_after_latency"] = cache_figures(server)
                save()
                if setup.throughput_steps != setup.steps:
                    results["throughput_record_s"] = record(server.url_grpc, setup, template, setup.throughput_steps,
                                                            denoisers)
                for c in setup.concurrency:
                    results["throughput"][str(c)] = throughput(server.url_grpc, setup, template, c)
                    save()
                results["template_cache"] = cache_figures(server)
                save()
            if load_rates:
                if routing != "seconds":  # (the first server recorded at these steps above)
                    record(server.url_grpc, setup, template, setup.throughput_steps, denoisers)
                results["load"][routing] = {str(rate): open_loop(server.url_grpc, setup, template, rate, load_requests,
                                                                 seed=k) for k, rate in enumerate(load_rates)}
                save()
    for system, compiled in (("diffusers_eager", False), ("diffusers_compiled", True)):
        if system not in skip:
            results[system] = diffusers_edits(setup, model, template_pixels, compiled)
            save()
    write_report(results, out_dir, final=True)
    return results
