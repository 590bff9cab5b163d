"""The denoiser's ResidualProvider that calls the ControlNet service by BLS.

Calls run on a thread pool so that the ControlNets of a step (several per request, several
requests per batch) are in flight together and beside the denoiser's encoder half; the
service's instances (one per GPU or slot) take them in parallel. Tensors cross by DLPack and
the residuals are asked for on the denoiser's GPU, so on GPUs nothing passes through host
memory (bench/micro/bls_transport.py measures what a call costs).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends.core.adapters.store import AdapterStore
from backends.core.request.contract import ModelDecl
from backends.core.request.params import InvalidInput, UnknownAdapter
from backends.triton.adapter import ForwardedError, internal_parameters
from backends.core.adapters.controlnet import ControlCall, Residuals


MAX_SESSIONS = 4096  # sessions remembered as sent (a request has one per ControlNet)
CALL_PARTS = ("ready", "exec", "outputs")


def to_triton(name: str, tensor: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


def to_torch(tensor) -> torch.Tensor:
    # Copy: the response's buffers go back to Triton once the response object is released.
    return from_dlpack(tensor.to_dlpack()).clone()


def sync_current_stream(tensor: torch.Tensor) -> None:
    """Another process reads this tensor next and knows nothing of our stream: finish it first."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


class BlsControlNets:
    def __init__(self, model_name: str, decl: ModelDecl, store: AdapterStore, workers: int = 8, instances: int = 1):
        """`instances`: the service's instances in all (see _exec)."""
        self.model_name = model_name
        self.outputs = [t.name for t in decl.outputs]
        self.store = store
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="easel-controlnet-bls")
        self._streams = threading.local()  # each worker copies results on streams of its own, one per device
        # The calls' wall time in parts, summed (metrics): `ready` waiting for the step's inputs on
        # the GPU, `exec` the BLS request (the service's compute, Triton's hand-offs and the
        # residuals' transfer), `outputs` taking the residuals onto the denoiser's device.
        self.seconds = dict.fromkeys(CALL_PARTS, 0.0)
        self._lock = threading.Lock()
        self.instances = instances
        # session -> calls that carried its constants
        self._sessions: OrderedDict[str, int] = OrderedDict()

    def check(self, name: str) -> None:
        self.store.controlnet(name)

    def submit(self, call: ControlCall) -> "Future[Residuals]":
        return self.pool.submit(self._call, call)

    def _call(self, call: ControlCall) -> Residuals:
        start = time.perf_counter()
        device = torch.device(call.device) if call.device is not None else call.sample.device
        if call.ready is not None:
            call.ready.synchronize()
        ready, executed = time.perf_counter(), None
        with self._stream(device):
            try:
                response = self._exec(call, device)
                executed = time.perf_counter()
                out = {t.name(): to_torch(t).to(device) for t in response.output_tensors()}
                sync_current_stream(out["mid"])  # the copies are done before the response's buffers go back
                return [out[n] for n in self.outputs[:-1]], out["mid"]
            finally:
                end = time.perf_counter()
                executed = executed or end  # (a request that failed spent the rest in it)
                with self._lock:
                    for part, seconds in (("ready", ready - start), ("exec", executed - ready),
                                          ("outputs", end - executed)):
                        self.seconds[part] += seconds

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return nullcontext()
        streams = getattr(self._streams, "by_device", None)
        if streams is None:
            streams = self._streams.by_device = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(streams[device])

    def _exec(self, call: ControlCall, device: torch.device):
        # A session's constants go with its first calls, one per instance of the service (Triton
        # spreads the calls of one request over them: an instance that never got them would ask
        # at every call), and again to an instance that asks (backends/core/adapters/control_sessions.py).
        with self._lock:
            sent = self._sessions.get(call.session, 0) if call.session is not None else 0
        constants = call.session is None or sent < self.instances
        try:
            response = self._request(call, device, constants)
        except UnknownAdapter as exc:
            if constants or exc.field != "session":
                raise
            constants = True  # (the service counts these: easel_controlnet_session_misses_total)
            response = self._request(call, device, constants)
        if call.session is not None and constants:
            with self._lock:
                self._sessions[call.session] = sent + 1
                self._sessions.move_to_end(call.session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return response

    def _request(self, call: ControlCall, device: torch.device, constants: bool):
        inputs = [
            pb_utils.Tensor("name", np.array([call.name.encode()], dtype=np.object_)),
            pb_utils.Tensor("scale", np.array([call.scale], dtype=np.float32)),
            to_triton("sample", call.sample), to_triton("timestep", call.timestep.to(torch.float32)),
        ]
        if call.session is not None:
            inputs.append(pb_utils.Tensor("session", np.array([call.session.encode()], dtype=np.object_)))
        if constants:
            inputs += [to_triton("prompt_embeds", call.embeds), to_triton("pooled_embeds", call.pooled),
                       to_triton("time_ids", call.time_ids), to_triton("image", call.image)]
        sync_current_stream(call.sample)  # to_triton's contiguous copies
        # Residuals straight into our GPU's memory (Triton's default would follow the producer's).
        where = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device.index)} \
            if device.type == "cuda" else {}
        response = pb_utils.InferenceRequest(model_name=self.model_name, inputs=inputs, parameters=internal_parameters(),
                                             requested_output_names=self.outputs, **where).exec()
        if response.has_error():  # the service's InvalidInput/UnknownAdapter keep their kind (and status)
            error = ForwardedError(response.error())
            kind = {pb_utils.TritonError.NOT_FOUND: UnknownAdapter,
                    pb_utils.TritonError.INVALID_ARG: InvalidInput}.get(error.code)
            if kind is None:
                raise RuntimeError(str(error))
            field, _, message = str(error).partition(": ")
            raise kind(field, message)
        return response

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
