"""The denoiser's ResidualProvider that calls the ControlNet service by BLS.

Calls run on a thread pool so that the ControlNets of a step (several per request, several
requests per batch) are in flight together and beside the denoiser's encoder half; the
service's instances (one per GPU or slot) take them in parallel. Tensors cross by DLPack and
the residuals are asked for on the denoiser's GPU, so on GPUs nothing passes through host
memory (bench/bls_transport.py measures what a call costs).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends.core.adapters.store import AdapterStore
from backends.core.request.contract import ModelDecl
from backends.core.request.params import InvalidInput, UnknownAdapter
from backends.triton_adapter import ForwardedError
from backends.core.adapters.controlnet import ControlCall, Residuals


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
    def __init__(self, model_name: str, decl: ModelDecl, store: AdapterStore, workers: int = 8):
        self.model_name = model_name
        self.outputs = [t.name for t in decl.outputs]
        self.store = store
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="easel-controlnet-bls")
        self._streams = threading.local()  # each worker copies results on a stream of its own
        self.call_s = 0.0  # wall time of the calls, summed (a metric)
        self._lock = threading.Lock()

    def check(self, name: str) -> None:
        self.store.controlnet(name)

    def submit(self, call: ControlCall) -> "Future[Residuals]":
        return self.pool.submit(self._call, call)

    def _call(self, call: ControlCall) -> Residuals:
        start = time.perf_counter()
        device = call.sample.device
        if call.ready is not None:
            call.ready.synchronize()
        with self._stream(device):
            try:
                return self._exec(call, device)
            finally:
                with self._lock:
                    self.call_s += time.perf_counter() - start

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return nullcontext()
        if getattr(self._streams, "stream", None) is None:
            self._streams.stream = torch.cuda.Stream(device)
        return torch.cuda.stream(self._streams.stream)

    def _exec(self, call: ControlCall, device: torch.device) -> Residuals:
        inputs = [
            pb_utils.Tensor("name", np.array([call.name.encode()], dtype=np.object_)),
            pb_utils.Tensor("scale", np.array([call.scale], dtype=np.float32)),
            to_triton("sample", call.sample), to_triton("timestep", call.timestep.to(torch.float32)),
            to_triton("prompt_embeds", call.embeds), to_triton("pooled_embeds", call.pooled),
            to_triton("time_ids", call.time_ids), to_triton("image", call.image),
        ]
        sync_current_stream(call.sample)  # to_triton's contiguous copies
        # Residuals straight into our GPU's memory (Triton's default would follow the producer's).
        where = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device.index)} \
            if device.type == "cuda" else {}
        response = pb_utils.InferenceRequest(model_name=self.model_name, inputs=inputs,
                                             requested_output_names=self.outputs, **where).exec()
        if response.has_error():  # the service's InvalidInput/UnknownAdapter keep their kind (and status)
            error = ForwardedError(response.error())
            kind = {pb_utils.TritonError.NOT_FOUND: UnknownAdapter,
                    pb_utils.TritonError.INVALID_ARG: InvalidInput}.get(error.code)
            if kind is None:
                raise RuntimeError(str(error))
            field, _, message = str(error).partition(": ")
            raise kind(field, message)
        out = {t.name(): to_torch(t).to(device) for t in response.output_tensors()}
        sync_current_stream(out["mid"])  # the copies are done before the response's buffers go back
        return [out[n] for n in self.outputs[:-1]], out["mid"]

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
