"""Triton adapter of the ControlNet service: one ControlNet on one request's rows at one step.

Its own model with its own instance_group, so ControlNets are placed independently of the UNet
(their own GPUs, or beside it) and several run at once, one per instance. Each instance keeps
the most used ControlNets resident (backends/core/adapters/controlnet_cache.py) and reports hits,
misses, load time and its resident set as Prometheus metrics on Triton's metrics port.
"""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import json
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from diffusers import ControlNetModel  # noqa: F401  (pay the import when loading, not at the first miss)

from backends.triton.bls_controlnets import MAILBOX, MAILBOX_EVENT, sync_current_stream, to_triton
from backends.core.adapters.cuda_ipc import Description, OpenedMailboxes, layout
from backends.core.adapters.store import AdapterStore
from backends.core.adapters.controlnet import ControlCall, check_call, embed_image, run_controlnet
from backends.core.adapters.controlnet_graphs import ControlNetGraphs
from backends.core.adapters.control_sessions import CONSTANTS, MAX_KEY_CHARS, ControlSessions
from backends.core.request.params import InvalidInput, Limits, UnknownAdapter
from backends.core.runtime.compile_cache import use_compile_cache
from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.triton.adapter import (
    Metrics, adapter_store_folder, drop_metrics, each_request, limits, parameters, placement, scalar, setup_stub,
    version_folder)


# Sessions an instance keeps (a request's control image embedded, embeddings and time ids: 21.6 MB
# at 1024 px in fp16 with guidance), least recently used evicted first.
DEFAULT_SESSION_BYTES = 1 << 30


def _tensor(request, name: str) -> torch.Tensor:
    """An input where it arrived (either device), without a copy."""
    return torch.from_dlpack(pb_utils.get_input_tensor_by_name(request, name).to_dlpack())


class _CacheMetrics:
    """The cache's counters as Prometheus metrics, labelled by model instance."""

    CACHE_COUNTERS = {  # keyed by the cache's stats
        "hits": ("easel_controlnet_cache_hits_total", "ControlNet calls served from the resident set", "counter"),
        "misses": ("easel_controlnet_cache_misses_total", "ControlNet calls that loaded from the store", "counter"),
        "evictions": ("easel_controlnet_cache_evictions_total", "ControlNets evicted", "counter"),
        "load_seconds": ("easel_controlnet_load_seconds_total", "seconds spent loading ControlNets", "counter"),
    }
    OTHERS = {
        "compute_seconds": ("easel_controlnet_compute_seconds_total",
                            "seconds from a call's inputs to its residuals, loads included", "counter"),
        "resident": ("easel_controlnet_resident", "ControlNets resident", "gauge"),
        "resident_bytes": ("easel_controlnet_resident_bytes", "bytes of resident ControlNets", "gauge"),
        "captures": ("easel_controlnet_graph_captures_total", "CUDA graphs of ControlNets captured", "counter"),
        "replays": ("easel_controlnet_graph_replays_total", "ControlNet calls replayed from CUDA graphs", "counter"),
        "session_hits": ("easel_controlnet_session_hits_total",
                         "calls that found their request's image and embeddings kept by the instance", "counter"),
        "session_misses": ("easel_controlnet_session_misses_total",
                           "calls sent back for their request's image and embeddings", "counter"),
        "session_bytes": ("easel_controlnet_session_bytes", "bytes of requests' images and embeddings kept", "gauge"),
    }

    def __init__(self, args):
        labels = {"model": args["model_name"], "instance": args["model_instance_name"]}
        self.metrics = Metrics(labels, {**self.CACHE_COUNTERS, **self.OTHERS})

    def update(self, cache: ControlNetCache, compute_seconds: float, graphs: ControlNetGraphs | None,
               sessions: ControlSessions) -> None:
        self.metrics.set_total("session_hits", sessions.stats.hits)
        self.metrics.set_total("session_misses", sessions.stats.misses)
        self.metrics.set("session_bytes", sessions.nbytes)
        for key in self.CACHE_COUNTERS:
            self.metrics.set_total(key, getattr(cache.stats, key))
        self.metrics.set_total("captures", graphs.captures if graphs else 0)
        self.metrics.set_total("replays", graphs.replays if graphs else 0)
        self.metrics.set_total("compute_seconds", compute_seconds)
        resident = cache.resident
        self.metrics.set("resident", len(resident))
        self.metrics.set("resident_bytes", sum(resident.values()))


def _optional(request, name: str):
    return pb_utils.get_input_tensor_by_name(request, name)


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        params = parameters(args)
        self.placement = placement(args)
        self.placement.make_current()
        # (a repository exported before the service had limits gets the defaults' bounds)
        self.limits = limits(args) if "limits" in params else Limits()
        self.device = torch.device(self.placement.device)
        # On a fast runtime each resident ControlNet runs as CUDA graphs, one per call shape, over
        # compiled code if the UNet's runtime is `compiled`, with the UNet's exact rewrites.
        # (a repository exported before `runtime` has `graphs`: true meant CUDA graphs)
        runtime = params.get("runtime") or ("graphs" if params.get("graphs") == "true" else "eager")
        fast = runtime != "eager" and self.device.type == "cuda"
        self.cache = ControlNetCache(AdapterStore(adapter_store_folder(args)), self.placement,
                                     budget_bytes=int(params["cache_bytes"]), fast=fast)
        self.graphs = None
        if fast:
            if runtime == "compiled":
                use_compile_cache(version_folder(args) / "compile_cache")
            self.graphs = ControlNetGraphs(compiled=runtime == "compiled")
        self.sessions = ControlSessions(int(params.get("session_bytes", DEFAULT_SESSION_BYTES)))
        self.metrics = _CacheMetrics(args)
        self.compute_seconds = 0.0
        # Mailbox calls (backends/core/adapters/cuda_ipc.py): callers' mailboxes and events, and
        # ours that says a call's residuals are written, one per caller's GPU.
        self.opened = OpenedMailboxes()
        self.written: dict[int, torch.cuda.Event] = {}
        self.timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # mailbox calls' GPU time, pending
        self.outputs = [o["name"] for o in json.loads(args["model_config"])["output"] if o["name"] != MAILBOX_EVENT]

    def execute(self, requests):
        # marked: the denoisers call this model by BLS, which loses the status code (MARKS)
        responses = each_request(requests, self._run, "controlnet", marked=True)
        self._collect_timings()
        self.metrics.update(self.cache, self.compute_seconds, self.graphs, self.sessions)
        return responses

    def finalize(self):
        drop_metrics(self, "metrics")

    @torch.inference_mode()
    def _run(self, request):
        start = time.perf_counter()
        name = scalar(pb_utils.get_input_tensor_by_name(request, "name").as_numpy()).decode()
        scale = float(_tensor(request, "scale").reshape(-1)[0])
        self.cache.store.controlnet(name)  # a clear error for a name the store does not hold
        mailbox = _optional(request, MAILBOX)
        if mailbox is not None:
            return self._run_by_mailbox(request, name, scale, mailbox)
        for needed in ("sample", "timestep"):
            if _optional(request, needed) is None:
                raise InvalidInput(needed, f"is needed (or a {MAILBOX})")
        sample, timestep = _tensor(request, "sample"), _tensor(request, "timestep")
        down, mid = self._compute(request, name, scale, sample, timestep)
        sync_current_stream(mid)
        self.compute_seconds += time.perf_counter() - start
        return [*(to_triton(f"down_{i}", d) for i, d in enumerate(down)), to_triton("mid", mid)]

    def _compute(self, request, name: str, scale: float, sample: torch.Tensor, timestep: torch.Tensor):
        dtype = self.placement.torch_dtype
        constants, key, kept = self._constants(request, name)
        # Sizes first: nothing is copied to the GPU or kept for a call no request of this deployment makes.
        check_call(ControlCall(name, scale, constants[0], sample, timestep, *constants[1:]), self.limits, kept)
        model = self.cache.acquire(name)
        try:
            if not kept:  # the image's embedding is kept, not the image: it is the same at every step
                image, embeds, pooled, time_ids = (t.to(self.device, dtype) for t in constants)
                constants = (embed_image(model, image), embeds, pooled, time_ids)
                if key is not None:
                    self.sessions.put(key, constants)
            call = ControlCall(name, scale, constants[0], sample.to(self.device, dtype), timestep.to(self.device),
                               *constants[1:])
            return self.graphs.run(model, call) if self.graphs else run_controlnet(model, call)
        finally:
            self.cache.release(name)

    def _run_by_mailbox(self, request, name: str, scale: float, mailbox):
        """Latents from the caller's mailbox, once its event says they are written (our streams wait
        on the GPU), and the residuals back into it; the response carries the event that says they
        are there. Nothing here waits on the host for the GPU."""
        if self.device.type != "cuda":
            raise InvalidInput(MAILBOX, "needs an instance on a GPU")
        description = Description.decode(scalar(mailbox.as_numpy()), torch.cuda.device_count())
        names = [s.name for s in description.slots]
        if names != ["sample", "timestep", *self.outputs]:
            raise InvalidInput(MAILBOX, f"names {names}, not sample, timestep, {', '.join(self.outputs)}")
        caller = torch.device("cuda", description.device)
        memory = self.opened.memory(caller, description.memory)
        offsets, _ = layout(list(description.slots))
        views = [memory.tensor(o, s.shape, s.dtype) for o, s in zip(offsets, description.slots)]
        ready = self.opened.event(caller, description.inputs_ready)
        ours = torch.cuda.current_stream(self.device)
        # A copy between GPUs runs on the source's stream, so the caller's device's stream waits for
        # the latents; ours waits on an event of that stream's, since torch 2.11 crashes waiting on
        # an interprocess event from a stream of another device (a segfault, no error).
        theirs = torch.cuda.current_stream(caller)
        theirs.wait_event(ready)
        if caller != self.device:
            ours.wait_event(theirs.record_event())
        began = torch.cuda.Event(enable_timing=True)
        began.record(ours)
        down, mid = self._compute(request, name, scale, views[0], views[1])
        for view, residual in zip(views[2:], (*down, mid)):
            if view.shape != residual.shape:
                raise InvalidInput(MAILBOX, f"has room for {tuple(view.shape)} where the residual is "
                                            f"{tuple(residual.shape)}")
            view.copy_(residual)
        ended = torch.cuda.Event(enable_timing=True)
        ended.record(ours)
        self.timings.append((began, ended))
        written = self.written.get(caller.index)
        if written is None:
            written = self.written[caller.index] = torch.cuda.Event(interprocess=True)
        written.record(torch.cuda.current_stream(caller))  # (after the copies: that stream waited on ours)
        handle = np.frombuffer(bytes(written.ipc_handle()), dtype=np.uint8)
        return [pb_utils.Tensor(MAILBOX_EVENT, handle.copy())]

    def _collect_timings(self) -> None:
        """Mailbox calls' GPU time, added to compute_seconds once their events are done."""
        while self.timings and self.timings[0][1].query():
            began, ended = self.timings.pop(0)
            self.compute_seconds += began.elapsed_time(ended) / 1e3

    def _constants(self, request, name: str) -> tuple[tuple[torch.Tensor, ...], str | None, bool]:
        """The call's image, embeddings and time ids, the key to keep them under once the call
        passes its checks, and whether they were kept: given (where they arrived), or what its
        session of this ControlNet kept of them earlier (on our device; nothing to keep again)."""
        given = [_optional(request, n) for n in CONSTANTS]
        session = _optional(request, "session")
        key = scalar(session.as_numpy()).decode(errors="replace") if session is not None else None
        if key is not None and not 0 < len(key) <= MAX_KEY_CHARS:
            raise InvalidInput("session", f"has {len(key)} characters, outside 1 to {MAX_KEY_CHARS}")
        kept_as = f"{name}\n{key}"  # an embedding is its ControlNet's
        if all(t is not None for t in given):
            return tuple(torch.from_dlpack(t.to_dlpack()) for t in given), kept_as if key is not None else None, False
        if any(t is not None for t in given) or key is None:
            raise InvalidInput("image", f"give {', '.join(CONSTANTS)} together, or name a session that was given them")
        kept = self.sessions.get(kept_as)
        if kept is None:  # the caller sends them again (backends/triton/bls_controlnets.py)
            raise UnknownAdapter("session", f"this instance holds no session {key!r} of ControlNet {name!r}")
        return kept, None, True
