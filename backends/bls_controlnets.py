"""The denoiser's ResidualProvider that calls the ControlNet service by BLS.

Calls run on a thread pool so that the ControlNets of a step (several per request, several
requests per batch) are in flight together and beside the denoiser's encoder half; the
service's instances (one per GPU or slot) take them in parallel. Tensors cross by DLPack, so
on GPUs they stay on the device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import from_dlpack, to_dlpack

from backends.core.adapter_store import AdapterStore
from backends.core.contract import ModelDecl
from backends.core.controlnet import ControlCall, Residuals


def to_triton(name: str, tensor: torch.Tensor):
    return pb_utils.Tensor.from_dlpack(name, to_dlpack(tensor.contiguous()))


def to_torch(tensor) -> torch.Tensor:
    # Copy: the response's buffers go back to Triton once the response object is released.
    return from_dlpack(tensor.to_dlpack()).clone()


class BlsControlNets:
    def __init__(self, model_name: str, decl: ModelDecl, store: AdapterStore, workers: int = 8):
        self.model_name = model_name
        self.outputs = [t.name for t in decl.outputs]
        self.store = store
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="easel-controlnet-bls")

    def check(self, name: str) -> None:
        self.store.controlnet(name)

    def submit(self, call: ControlCall) -> "Future[Residuals]":
        return self.pool.submit(self._call, call)

    def _call(self, call: ControlCall) -> Residuals:
        inputs = [
            pb_utils.Tensor("name", np.array([call.name.encode()], dtype=np.object_)),
            pb_utils.Tensor("scale", np.array([call.scale], dtype=np.float32)),
            to_triton("sample", call.sample), to_triton("timestep", call.timestep.to(torch.float32)),
            to_triton("prompt_embeds", call.embeds), to_triton("pooled_embeds", call.pooled),
            to_triton("time_ids", call.time_ids), to_triton("image", call.image),
        ]
        response = pb_utils.InferenceRequest(model_name=self.model_name, inputs=inputs,
                                             requested_output_names=self.outputs).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        out = {t.name(): to_torch(t) for t in response.output_tensors()}
        device = call.sample.device
        return [out[n].to(device) for n in self.outputs[:-1]], out["mid"].to(device)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
