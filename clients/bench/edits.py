"""`easel bench --edit`: template edits through tritonserver, reusing a recording against exact
inpainting of the same request.

One template (random pixels), one seed (a recording is kept per seed: the template's latents
outside the mask are noised with the request's noise), prompts that differ per request:

- Latency per mask ratio (a centered square of 5, 10, 20, 35 and 50% of the image): `--runs`
  edits computed exactly (no `template`), then the same edits naming the template (the first
  records, the rest reuse). p50 of each, the speed-up, and each reused image against the exact one
  of the same prompt: PSNR and SSIM of the whole image and of the masked region.
- Throughput: c clients at once, rounds back to back, every request's mask ratio drawn from a
  distribution with InstGenIE's trace's mean (0.11), exact against reusing, images/s.

Written into `<out>/edits.json` beside the other configurations' results. Random weights: the
figures say what reuse costs and how far it moves an image, not how good pictures look.
"""

from __future__ import annotations

import io
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

log = logging.getLogger("easel.bench.edits")

RATIOS = (0.05, 0.1, 0.2, 0.35, 0.5)
TRACE_MEAN_RATIO = 0.11  # InstGenIE's production trace (0.19 in the public one it cites)
TEMPLATE = "bench-template"
SEED = 7
# Device memory for recordings: SDXL at 1024 px with guidance is 0.42 GB a step.
GPU_TEMPLATE_CACHE_GIB = (48.0, 0.0, 0.0)


def centered_mask(size: int, ratio: float) -> np.ndarray:
    """A square mask of about `ratio` of the image, at the center (255 repaints), in 8 px steps."""
    side = max(8, int(round(size * ratio ** 0.5 / 8)) * 8)
    mask = np.zeros((size, size), np.uint8)
    start = (size - side) // 2
    mask[start:start + side, start:start + side] = 255
    return mask


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


def compare(got: np.ndarray, want: np.ndarray, mask: np.ndarray) -> dict:
    from clients.bench.image_metrics import psnr, ssim

    ys, xs = np.nonzero(mask)
    box = (slice(ys.min(), ys.max() + 1), slice(xs.min(), xs.max() + 1))
    return {"psnr": psnr(got, want), "ssim": ssim(got, want),
            "masked_psnr": psnr(got[box], want[box]), "masked_ssim": ssim(got[box], want[box])}


def record(client, setup, template: bytes, steps: int) -> float:
    """The template's recording at `steps` (a recording is kept per step count), then one reusing
    edit untimed (the first run of the reusing path); the recording's seconds."""
    files = dict(steps=steps, width=setup.size, height=setup.size, seed=SEED, strength=1.0, image=template,
                 mask_image=_png(centered_mask(setup.size, 0.2)), template=TEMPLATE)
    start = time.perf_counter()
    use = client.generate("the recording", **files).info.get("template_use")
    seconds = time.perf_counter() - start
    again = client.generate("a first reuse", **files).info.get("template_use")
    if (use, again) != ("recorded", "reused"):
        raise RuntimeError(f"the template was {use}, then {again}: not recorded and reused (is its cache too small?)")
    return seconds


def latency(client, setup, template: bytes, out: dict) -> None:
    request = dict(steps=setup.steps, width=setup.size, height=setup.size, seed=SEED, strength=1.0, image=template)
    for ratio in RATIOS:
        mask = centered_mask(setup.size, ratio)
        files = dict(request, mask_image=_png(mask))
        row = out.setdefault(str(ratio), {"mask_ratio": float((mask > 0).mean())})
        exact, reused, row["exact_s"], row["reuse_s"], row["quality"] = [], [], [], [], []
        for i in range(setup.runs):
            start = time.perf_counter()
            exact.append(_pixels(client.generate(f"an edit {i}", **files)))
            row["exact_s"].append(time.perf_counter() - start)
        for i in range(setup.runs):
            start = time.perf_counter()
            result = client.generate(f"an edit {i}", template=TEMPLATE, **files)
            row["reuse_s"].append(time.perf_counter() - start)
            if result.info.get("template_use") != "reused":
                raise RuntimeError(f"mask {ratio}: an edit of a recorded template was {result.info.get('template_use')}")
            reused.append(_pixels(result))
            row["quality"].append(compare(reused[-1], exact[i], mask))
        row["exact_p50_s"], row["reuse_p50_s"] = float(np.median(row["exact_s"])), float(np.median(row["reuse_s"]))
        row["speedup"] = row["exact_p50_s"] / row["reuse_p50_s"]
        row["psnr_median"] = float(np.median([q["psnr"] for q in row["quality"]]))
        row["masked_psnr_median"] = float(np.median([q["masked_psnr"] for q in row["quality"]]))
        log.info("mask %.2f: exact p50 %.3fs, reused %.3fs (%.2fx); PSNR %.2f dB (masked %.2f)", ratio,
                 row["exact_p50_s"], row["reuse_p50_s"], row["speedup"], row["psnr_median"], row["masked_psnr_median"])


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
                            seed=SEED, strength=1.0, image=template, mask_image=masks[r * c + i], **extra).info

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


def run_edits(setup, out_dir: Path) -> dict:
    """Exports the model with a template cache, starts tritonserver and measures; writes edits.json."""
    from clients.bench.common import tiny, random_sdxl
    from clients.bench.harness import start_server
    from clients.client import EaselClient
    from export.repository import ExportOptions, export_repository

    model = tiny(setup.work) if setup.smoke else random_sdxl(setup.work)
    repo = setup.work / "repo-edits"
    top = max(setup.concurrency)
    options = ExportOptions(device=setup.device, dtype=setup.dtype, gpus=setup.gpus, runtime=setup.runtime,
                            max_size=max(setup.size, 64), warmup_sizes=(setup.size,),
                            max_steps=max(150, setup.steps, setup.throughput_steps),
                            max_in_flight=max(56, top + 48), max_running=max(16, top),
                            max_batch_rows=max(16, 2 * top),
                            template_cache_gib=(1.0, 0.0, 0.0) if setup.smoke else GPU_TEMPLATE_CACHE_GIB)
    export_repository(model, repo, options)
    template = _png(np.random.default_rng(1234).integers(0, 256, (setup.size, setup.size, 3), dtype=np.uint8))
    results = {"size": setup.size, "steps": setup.steps, "throughput_steps": setup.throughput_steps,
               "runs": setup.runs, "device": setup.device, "gpus": list(setup.gpus), "runtime": setup.resolved_runtime,
               "seed": SEED, "latency": {}, "throughput": {}}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "edits.json"
    server, results["start_s"] = start_server(repo, setup)
    try:
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            client.generate("warm up", steps=2, width=setup.size, height=setup.size, seed=0, strength=1.0,
                            image=template, mask_image=_png(centered_mask(setup.size, 0.2)))
            results["record_s"] = record(client, setup, template, setup.steps)
            latency(client, setup, template, results["latency"])
            path.write_text(json.dumps(results, indent=1))
            if setup.throughput_steps != setup.steps:
                results["throughput_record_s"] = record(client, setup, template, setup.throughput_steps)
        for c in setup.concurrency:
            results["throughput"][str(c)] = throughput(server.url_grpc, setup, template, c)
            path.write_text(json.dumps(results, indent=1))
    finally:
        server.stop()
    return results
