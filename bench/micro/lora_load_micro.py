"""Decides the LoRA loader pool's shape (processes, workers, read size).

How long the LoRA loader pool takes to hand a request its LoRAs, cold from disk, in process (no
server): the planned path (the worker converts the file's header, this process reads the file
straight onto the device) against the converted one (the worker reads and converts the tensors
and hands them over through /dev/shm), on the same random SDXL-size LoRAs (~340 and ~460 MiB).

Each run drops the files' pages from the page cache first, then loads one LoRA, then both at once
(two loader processes), per path, in an order alternated from run to run. Also the plain cold
read of each file: the floor. Runs on a GPU (`--device cuda`) or on the CPU (the tensors then stay
in host memory: the disk and the copies, not the transfer to a GPU).

    python3 -m bench.micro.lora_load_micro --work /tmp/easel-lora --out $OUT/lora_load_micro.json --device cuda
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

from clients.bench.common import start_logging, write_json
from bench.micro.lora_sdxl import drop_cache, read_speeds, write_loras

log = logging.getLogger("bench.micro.lora_load_micro")


def load_converted(name, path):
    """load_lora under another name: the pool plans only for load_lora itself, so this one takes
    the converted path (the worker reads, converts and writes the tensors to /dev/shm)."""
    from backends.core.adapters.lora import load_lora

    return load_lora(name, path)


def sdxl_unet_config(folder: Path) -> Path:
    """SDXL base's UNet config (export/tiny.py's `sdxl` variant), without its weights: the LoRA
    writer needs the Linear layers' shapes only."""
    import torch
    from diffusers import UNet2DConditionModel

    from export.tiny import unet_kwargs

    with torch.device("meta"):
        unet = UNet2DConditionModel(**unet_kwargs("sdxl"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(dict(unet.config)))
    return folder


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="folder for the LoRA files")
    p.add_argument("--out", type=Path, required=True, help="JSON report")
    p.add_argument("--device", default="cuda", help="where the loaded tensors go: cuda or cpu")
    p.add_argument("--mib", type=float, nargs="+", default=[340.0, 460.0], help="LoRA sizes")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    start_logging()

    from backends.core.adapters.lora import load_lora
    from backends.core.adapters.lora_loader import LoraLoaderPool

    import torch

    loras = write_loras(args.work / "adapters", sdxl_unet_config(args.work / "unet"), args.mib, 1e-3, "cpu")
    paths = [x["path"] for x in loras]
    report = {"device": args.device, "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "torch": torch.__version__, "loras": loras, "runs": args.runs,
              "read_speeds": {x["name"]: read_speeds(x["path"]) for x in loras}, "paths": {}}
    pools = {"planned": LoraLoaderPool(workers=2, device=args.device),
             "converted": LoraLoaderPool(workers=2, load=load_converted, device=args.device)}
    times: dict[str, dict[str, list[float]]] = {path: {"1L": [], "2L": []} for path in pools}
    try:
        for pool in pools.values():
            if not pool.wait_started(timeout=300):
                raise SystemExit("a LoRA loader process did not start")
        for run in range(args.runs):
            for path in (list(pools) if run % 2 == 0 else list(reversed(pools))):
                for label, files in (("1L", paths[:1]), ("2L", paths)):
                    drop_cache(files)
                    start = time.perf_counter()
                    result = pools[path].submit([(Path(f).stem, f, 1.0) for f in files]).result(600)
                    if args.device == "cuda":
                        torch.cuda.synchronize()
                    times[path][label].append(time.perf_counter() - start)
                    if path == "planned" and label == "1L" and run == 0:
                        ((first, _),) = result
                    del result
                log.info("run %d %s: 1L %.3f s, 2L %.3f s", run, path, times[path]["1L"][-1], times[path]["2L"][-1])
    finally:
        for pool in pools.values():
            pool.shutdown()
    for path, by_label in times.items():
        report["paths"][path] = {label: {"median_s": statistics.median(values), "all_s": values}
                                 for label, values in by_label.items()}
    report["planned_over_converted"] = {
        label: report["paths"]["planned"][label]["median_s"] / report["paths"]["converted"][label]["median_s"]
        for label in ("1L", "2L")}
    # The planned path gives the same layers as load_lora in process, bit for bit.
    want = load_lora(Path(paths[0]).stem, paths[0])
    report["planned_equals_load_lora"] = all(
        torch.equal(first.unet[m].down.cpu(), layer.down) and torch.equal(first.unet[m].up.cpu(), layer.up)
        for m, layer in want.unet.items())
    log.info("medians: %s; planned / converted: %s; planned equals load_lora: %s",
             {p: {k: round(v["median_s"], 3) for k, v in d.items()} for p, d in report["paths"].items()},
             {k: round(v, 2) for k, v in report["planned_over_converted"].items()}, report["planned_equals_load_lora"])
    write_json(args.out, report)


if __name__ == "__main__":
    main()
