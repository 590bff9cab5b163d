"""`easel bench`'s tritonservers: the repository a configuration is exported to, and the servers
that serve it, one per repository. In a run whose configurations share one server
(`Servers(keep=True)`), the first configuration exports and starts it (its cold start is the
run's), the later ones find it running, and it stops when the run ends."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import time
import uuid
from pathlib import Path

from clients.bench.models import SERVER_CACHE_ENV, Setup

log = logging.getLogger("easel.bench")

METRIC_PREFIXES = ("easel_", "nv_inference_", "nv_gpu_")


def controlnet_instances(setup: Setup) -> int:
    """ControlNet service instances per GPU (or on CPU), enough for the most calls in flight at
    once: every served ControlNet of a request, twice when its rows are called apart (a row split,
    or latent parallelism's two GPUs). On GPUs of their own those calls spread over the GPUs; on
    the denoisers' GPUs each GPU may see all of one denoiser's calls."""
    served = max(1, setup.served_controlnets)
    if not setup.controlnet_gpus:
        return served
    calls = served * (2 if setup.controlnet_row_split or setup.cfg_parallel else 1)
    return math.ceil(calls / len(setup.controlnet_gpus))


def export_options(setup: Setup):
    """The repository of `setup`, sized for the adapters it serves (Setup.served_*) and for the
    run's highest concurrency."""
    from export.repository import ExportOptions

    extra = dict(row_buckets=setup.row_buckets) if setup.row_buckets else {}
    if setup.fused_kernels:
        extra["fused_kernels"] = True
    if setup.vae_dtype:
        extra["vae_dtype"] = setup.vae_dtype
    if setup.fp8:
        extra["fp8"] = setup.fp8
        extra["fp8_fast_accum"] = setup.fp8_fast_accum
    top = max(setup.concurrency)
    store = setup.adapter_store
    return ExportOptions(
        device=setup.device, dtype=setup.dtype, gpus=setup.gpus, cfg_parallel=setup.cfg_parallel,
        max_size=max(setup.size, 64),
        max_steps=max(150, setup.steps, setup.throughput_steps), runtime=setup.runtime, warmup_sizes=(setup.size,),
        max_in_flight=max(56, top + 48), max_running=max(16, top), max_batch_rows=max(16, 2 * top),
        adapters=str(store) if store else None, max_controlnets=max(3, setup.served_controlnets),
        max_loras=max(3, setup.served_loras), controlnet_instances=controlnet_instances(setup),
        controlnet_gpus=setup.controlnet_gpus, controlnet_row_split=setup.controlnet_row_split, **extra)


def repo_path(setup: Setup) -> Path:
    return setup.work / f"repo-{setup.served_name.replace('/', '-')}"


def metrics_snapshot(port: int) -> dict[str, dict[str, float]]:
    """Every metric family whose name starts with METRIC_PREFIXES: name -> {labels: value}."""
    from clients.serve import scrape_metrics

    return dict(sorted(scrape_metrics(port, prefixes=METRIC_PREFIXES).items()))


def total(snapshot: dict | None, name: str) -> float | None:
    values = (snapshot or {}).get(name)
    return sum(values.values()) if values else None


@contextlib.contextmanager
def server_environment(rec: dict):
    """The server's compile cache is the repository's own: a TORCHINDUCTOR_CACHE_DIR or
    TRITON_CACHE_DIR in this environment (set by the user or by an earlier compile in this
    process) would point it elsewhere, so they are left out while servers start."""
    saved = {k: os.environ.pop(k) for k in SERVER_CACHE_ENV if k in os.environ}
    if saved:
        rec["env_removed_for_server"] = saved
    try:
        yield
    finally:
        os.environ.update(saved)


def share_compile_cache(repo: Path, shared: Path) -> Path:
    """Point the compile cache of every model that compiles (denoisers, the ControlNet service) at
    one folder: inductor's cache is content-addressed and safe for several processes."""
    from export.repository import VERSION

    shared.mkdir(parents=True, exist_ok=True)
    for model in repo.iterdir():
        if model.name.startswith("denoiser") or model.name == "controlnet":
            link = model / VERSION / "compile_cache"
            (model / VERSION).mkdir(exist_ok=True)
            if not link.exists():
                link.symlink_to(shared.resolve(), target_is_directory=True)
    return shared


def _folder_bytes(root: Path, name: str) -> int:
    return sum(f.stat().st_size for d in root.rglob(name) if d.is_dir() for f in d.rglob("*") if f.is_file())


def start_server(repo: Path, setup: Setup):
    from clients.serve import TritonServer

    server = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, ready_timeout=setup.ready_timeout,
                          cuda_pool_mib=setup.cuda_pool_mib)
    start = time.perf_counter()
    server.start()
    try:
        server.wait_ready()
    except BaseException:  # ServerStartError (with the log's tail), or an interrupt
        server.stop()
        raise
    return server, time.perf_counter() - start


@dataclasses.dataclass
class Served:
    """A running server and the configurations it has served, in order."""

    server: object  # clients.serve.TritonServer
    repo: Path
    options: object  # export.repository.ExportOptions
    id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex[:12])
    users: list[str] = dataclasses.field(default_factory=list)


class Servers:
    """The run's servers, keyed by what determines their repository. `keep`: a released server
    stays up for the run's later configurations, until close()."""

    def __init__(self, keep: bool = False):
        self.keep = keep
        self._running: dict[tuple, Served] = {}

    @staticmethod
    def key(setup: Setup) -> tuple:
        return (repo_path(setup), export_options(setup), setup.shared_compile_cache, setup.cuda_pool_mib)

    def get(self, setup: Setup, model: Path, rec: dict | None = None, save=lambda: None) -> Served:
        """The server of `setup`'s repository: running already, or exported from `model` and
        started now (its export and cold start go into `rec`). `rec["server"]` names the server
        and the configurations it served before this one."""
        rec = {} if rec is None else rec
        key = self.key(setup)
        served = self._running.get(key)
        if served is not None and served.server.proc.poll() is not None:
            log.warning("the server of %s exited (%s): starting another", served.users,
                        served.server.proc.returncode)
            rec["previous_server_exited"] = {"id": served.id, "returncode": served.server.proc.returncode}
            del self._running[key]
            served = None
        if served is None:
            served = self._running[key] = self._start(setup, model, key[1], rec, save)
        served.users.append(setup.name)
        rec.update(export_options=dataclasses.asdict(served.options), row_buckets=list(served.options.resolved_row_buckets),
                   repo=str(served.repo), server={"id": served.id, "served": setup.served_name,
                                                  "earlier_configs": served.users[:-1]})
        if served.users[:-1]:
            log.info("%s: on the server started for %s", setup.name, served.users[0])
        return served

    def release(self, setup: Setup) -> None:
        """Stop `setup`'s server, unless it is kept for later configurations."""
        if self.keep:
            return
        served = self._running.pop(self.key(setup), None)
        if served is not None:
            served.server.stop()

    def close(self) -> None:
        while self._running:
            _, served = self._running.popitem()
            served.server.stop()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, setup: Setup, model: Path, options, rec: dict, save) -> Served:
        repo = export(setup, model, options, rec, save)
        if setup.shared_compile_cache:
            rec["shared_compile_cache"] = str(share_compile_cache(repo, setup.work / "compile-cache"))
        with server_environment(rec):
            server = cold_start(setup, repo, rec, save)
        rec["runtime_warmup_s"] = {
            "first": total(rec["metrics"]["first_start_ready"], "easel_runtime_warmup_seconds"),
            "second": total(rec["metrics"]["ready"], "easel_runtime_warmup_seconds") if "ready" in rec["metrics"]
            else None}
        log.info("Easel start(s) for %s: %s", setup.name, {k: round(v, 1) for k, v in rec["cold_start_s"].items()})
        return Served(server, repo, options)


def export(setup: Setup, model: Path, options, rec: dict, save) -> Path:
    """A fresh export (the compile cache of the first start is empty) of `model` for `setup`."""
    from export.repository import export_repository

    repo = repo_path(setup)
    if repo.exists():
        shutil.rmtree(repo)
    top = max(setup.concurrency)
    buckets = options.resolved_row_buckets
    rows = top if setup.cfg_parallel else 2 * top  # each GPU of a pair runs half the rows
    if rows > max(buckets):
        log.warning("concurrency %d needs %d UNet rows a GPU; the largest bucket is %d (more rows run eager)",
                    top, rows, max(buckets))
    rec.update(export_options=dataclasses.asdict(options), repo=str(repo))
    start = time.perf_counter()
    export_repository(model, repo, options)
    rec["export_s"] = time.perf_counter() - start
    log.info("Easel %s: exported %s (%s runtime) in %.1fs", setup.name, setup.served_name,
             setup.resolved_runtime, rec["export_s"])
    save()
    return repo


def cold_start(setup: Setup, repo: Path, rec: dict, save):
    """Start the server; without a shared compile cache, stop it and start it again on the same
    repository, its compile cache now warm (the second start)."""
    server, first_s = start_server(repo, setup)
    try:
        rec["cold_start_s"] = {"first": first_s}
        rec["metrics"] = {"first_start_ready": metrics_snapshot(server.metrics_port)}
        if not setup.shared_compile_cache:
            stop = time.perf_counter()
            server.stop()
            rec["first_stop_s"] = time.perf_counter() - stop
            rec["compile_cache_bytes_after_first_start"] = _folder_bytes(repo, "compile_cache")
            log.info("Easel first start (compile cache empty): %.1fs", first_s)
            save()
            server, rec["cold_start_s"]["second"] = start_server(repo, setup)
            rec["metrics"]["ready"] = metrics_snapshot(server.metrics_port)
    except BaseException:
        server.stop()
        raise
    return server
