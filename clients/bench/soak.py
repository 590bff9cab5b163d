"""Soak: a bounded mixed workload against one server, with its memory watched.

Clients send, for `duration_s`, a seeded mix of requests: valid ones of several sizes, step
counts and schedulers (with a ControlNet and a LoRA where the store has them), bad ones (each
must be refused with the status of a client's mistake) and ones whose deadline passes mid-denoise
(each must fail with a deadline or cancel status). Meanwhile the resident memory of tritonserver
and of every process under it, the bytes of the server's /dev/shm regions and, on a GPU, the GPU
memory in use are sampled. Growth is the median of the last third of the samples against the
median of the samples just after warm-up (`warmup_fraction` of the run): Python processes and
Triton's regions grow while the first requests of each kind arrive, then must stay flat.

    python3 -m clients.bench.soak --work /tmp/easel-soak --out soak.json --duration 600            # tiny, CPU
    python3 -m clients.bench.soak --work /tmp/easel-soak --out $OUT/soak.json --device cuda --size 1024 --duration 900

A test (tests/server/test_soak.py) runs a short one in `make test`.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import random
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clients import procs

log = logging.getLogger("easel.bench.soak")

REFUSED = {"StatusCode.INVALID_ARGUMENT", "StatusCode.NOT_FOUND", "400", "404"}
TIMED_OUT = {"StatusCode.DEADLINE_EXCEEDED", "StatusCode.CANCELLED", "499", "504"}
MIB = 1 << 20


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float = 60.0
    concurrency: int = 4
    sizes: tuple[int, ...] = (64, 128)
    steps: tuple[int, ...] = (2, 4)
    schedulers: tuple[str, ...] = ("euler", "euler_a", "dpmpp_2m_karras", "ddim")
    controlnets: tuple[str, ...] = ()  # names in the store; one joins some valid requests
    loras: tuple[str, ...] = ()
    bad_fraction: float = 0.15
    deadline_fraction: float = 0.15
    deadline_s: float = 0.5  # the late requests' deadline; their steps take longer than this
    deadline_steps: int = 40
    max_size: int = 256  # the deployment's limit, for the bad requests to break
    interval_s: float = 1.0
    warmup_fraction: float = 0.3
    seed: int = 0


@dataclass
class SoakReport:
    config: dict
    outcomes: Counter = field(default_factory=Counter)  # kind/outcome -> count
    unexpected: list[str] = field(default_factory=list)  # requests whose outcome was not their kind's
    samples: list[dict] = field(default_factory=list)  # t, rss per process name, shm bytes, gpu bytes
    growth_mib: dict[str, float] = field(default_factory=dict)
    leftover_regions: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "outcomes": dict(self.outcomes)}, indent=2)


def rss_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def gpu_bytes() -> int | None:
    """GPU memory in use on the machine (every process), or None without nvidia-smi."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(int(v) for v in out.split()) * MIB


def sample(server_pid: int, region_prefix: str, t: float) -> dict:
    """One reading: RSS of tritonserver and of every process under it (stubs by their model
    instance, others, such as LoRA loaders, by program and pid), our regions' bytes, the GPU's."""
    rss = {"tritonserver": rss_bytes(server_pid)}
    stubs = procs.stub_instances(server_pid)
    for pid in procs.descendants(server_pid):
        argv = procs.cmdline(pid)
        name = f"stub:{stubs[pid]}" if pid in stubs else f"{Path(argv[0]).name if argv else '?'}:{pid}"
        rss[name] = rss_bytes(pid)
    shm = sum(p.stat().st_size for p in procs.SHM_DIR.glob(f"{region_prefix}*") if p.exists())
    return {"t": t, "rss": {k: v for k, v in rss.items() if v is not None}, "shm": shm, "gpu": gpu_bytes()}


def growth(samples: list[dict], warmup_fraction: float) -> dict[str, float]:
    """MiB each series grew: median of the last third against the median of the first third
    after warm-up; series that are not in both windows are left out."""
    after = [s for s in samples if s["t"] >= warmup_fraction * samples[-1]["t"]]
    third = max(1, len(after) // 3)
    early, late = after[:third], after[-third:]

    def series(window):
        out: dict[str, list[float]] = {}
        for s in window:
            for name, value in s["rss"].items():
                out.setdefault(name, []).append(value)
            out.setdefault("shm", []).append(s["shm"])
            if s["gpu"] is not None:
                out.setdefault("gpu", []).append(s["gpu"])
        return out

    a, b = series(early), series(late)
    per = {k: (statistics.median(b[k]) - statistics.median(a[k])) / MIB for k in a if k in b}
    per["rss_total"] = sum(v for k, v in per.items() if k not in ("shm", "gpu"))
    return per


class Workload:
    """The seeded mix: each call of next() picks a kind and its request's arguments."""

    def __init__(self, config: SoakConfig, control_image: bytes | None):
        self.config = config
        self.control_image = control_image
        self._rng = random.Random(config.seed)
        self._lock = threading.Lock()

    def next(self) -> tuple[str, dict]:
        c = self.config
        with self._lock:
            r = self._rng.random()
            size = self._rng.choice(c.sizes)
            args = {"prompt": f"soak {self._rng.randrange(10**6)}", "width": size, "height": size,
                    "steps": self._rng.choice(c.steps), "scheduler": self._rng.choice(c.schedulers),
                    "seed": self._rng.randrange(2**31)}
            if r < c.bad_fraction:
                breaks = self._rng.choice(("width", "scheduler", "steps", "lora"))
                args.update({"width": {"width": c.max_size + 64}, "scheduler": {"scheduler": "no_such_sampler"},
                             "steps": {"steps": 100000}, "lora": {"loras": ("no_such_lora",), "lora_scales": (1.0,)}
                             }[breaks])
                return f"bad_{breaks}", args
            if r < c.bad_fraction + c.deadline_fraction:
                args.update(steps=c.deadline_steps, width=max(c.sizes), height=max(c.sizes))
                return "deadline", args
            if c.controlnets and self.control_image is not None and self._rng.random() < 0.3:
                args.update(controlnets=(self._rng.choice(c.controlnets),), control_images=(self.control_image,))
            if c.loras and self._rng.random() < 0.3:
                args.update(loras=(self._rng.choice(c.loras),), lora_scales=(0.8,))
            return "ok", args


def run_soak(server, config: SoakConfig, control_image: bytes | None = None) -> SoakReport:
    """Drive `server` (a started clients.serve.TritonServer) with the mix while sampling it."""
    from clients.client import EaselClient, EaselError

    report = SoakReport(config=asdict(config))
    workload = Workload(config, control_image)
    start = time.monotonic()
    deadline = start + config.duration_s
    lock = threading.Lock()

    def record(kind: str, outcome: str, ok: bool, detail: str = "") -> None:
        with lock:
            report.outcomes[f"{kind}:{outcome}"] += 1
            if not ok:
                report.unexpected.append(f"{kind}: {outcome} {detail[:200]}")

    def client_loop() -> None:
        with EaselClient(server.url_grpc, protocol="grpc") as client:
            while time.monotonic() < deadline:
                kind, args = workload.next()
                prompt = args.pop("prompt")
                timeout = config.deadline_s if kind == "deadline" else None
                try:
                    client.generate(prompt, timeout_s=timeout, **args)
                    record(kind, "ok", kind == "ok")
                except EaselError as exc:
                    status = str(exc.status)
                    expected = REFUSED if kind.startswith("bad_") else TIMED_OUT if kind == "deadline" else set()
                    record(kind, status, status in expected, str(exc))

    threads = [threading.Thread(target=client_loop, name=f"soak-{i}", daemon=True) for i in range(config.concurrency)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        report.samples.append(sample(server.pid, server.region_prefix, time.monotonic() - start))
        time.sleep(config.interval_s)
    for t in threads:
        t.join()
    report.samples.append(sample(server.pid, server.region_prefix, time.monotonic() - start))
    report.growth_mib = growth(report.samples, config.warmup_fraction)
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--size", type=int, default=None, help="largest image size (default: 128 on cpu, 1024 on cuda)")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    from clients.bench.common import random_sdxl, tiny, write_controlnets
    from PIL import Image

    from clients.serve import TritonServer
    from export.repository import ExportOptions, export_repository
    from export.tiny_adapters import TINY_CONTROLNETS, TINY_LORAS

    args.work.mkdir(parents=True, exist_ok=True)
    if args.device == "cpu":
        model = tiny(args.work, adapters=True)
        store, size = model / "adapters", args.size or 128
        sizes, steps = (64, size), (2, 4)
        controlnets, loras = TINY_CONTROLNETS, tuple(TINY_LORAS)
        options = ExportOptions(device="cpu", adapters=str(store), max_size=max(256, size))
    else:
        model = random_sdxl(args.work)
        store, size = args.work / "adapters", args.size or 1024
        write_controlnets(model, store, ("cn0",))
        sizes, steps = (size // 2, size), (10, 20)
        controlnets, loras = ("cn0",), ()
        options = ExportOptions(device="cuda", dtype="fp16", gpus=(0,), runtime="graphs", adapters=str(store),
                                max_size=size)
    repo = args.work / f"repo-{args.device}"
    export_repository(model, repo, options)
    config = SoakConfig(duration_s=args.duration, concurrency=args.concurrency, sizes=sizes, steps=steps,
                        controlnets=controlnets, loras=loras, max_size=options.max_size,
                        deadline_steps=min(options.max_steps, 40), interval_s=5.0)
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (120, 40, 200)).save(buf, format="PNG")
    server = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=900).start()
    try:
        server.wait_ready()
        report = run_soak(server, config, buf.getvalue())
    finally:
        prefix = server.region_prefix
        server.stop()
    report.leftover_regions = sorted(p.name for p in procs.SHM_DIR.glob(f"{prefix}*"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report.to_json())
    log.info("outcomes %s; unexpected %d; growth (MiB) %s; leftover regions %d", dict(report.outcomes),
             len(report.unexpected), {k: round(v, 1) for k, v in report.growth_mib.items()},
             len(report.leftover_regions))


if __name__ == "__main__":
    main()
