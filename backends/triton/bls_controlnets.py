"""The denoiser's ResidualProvider that calls the ControlNet service by BLS.

Calls run on a thread pool so that the ControlNets of a step (several per request, several
requests per batch) are in flight together and beside the denoiser's encoder half; the
service's instances (one per GPU or slot) take them in parallel.

On GPUs a call's latents and residuals cross in a mailbox of the calling thread's
(backends/core/adapters/cuda_ipc.py), ordered by interprocess events on the GPU, and the BLS
request carries only its description: the call is on its way while the step's latents are still
being computed, and the residuals land on the denoiser's GPU without Triton's copies. The
request's constants (image, embeddings, time ids: once per session and instance) and every call
on CPUs cross as Triton tensors by DLPack (bench/micro/bls_transport.py measures what such a
call costs).
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

from backends.core.adapters.cuda_ipc import Description, Mailboxes, OpenedMailboxes, Slot, layout
from backends.core.adapters.store import AdapterStore
from backends.core.runtime.specs import controlnet_residual_shapes
from backends.core.request.contract import ModelDecl
from backends.core.request.params import InvalidInput, UnknownAdapter
from backends.triton.adapter import ForwardedError, internal_parameters
from backends.core.adapters.controlnet import ControlCall, Delivered


MAX_SESSIONS = 4096  # sessions remembered as sent (a request has one per ControlNet)
CALL_PARTS = ("ready", "exec", "outputs")
MAILBOX, MAILBOX_EVENT = "mailbox", "mailbox_event"  # the service's input and output for mailbox calls


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
    def __init__(self, model_name: str, decl: ModelDecl, store: AdapterStore, workers: int = 8, instances: int = 1,
                 unet_config=None):
        """`instances`: the service's instances in all (see _exec). `unet_config`: the UNet's,
        whose residual shapes size the mailboxes (without it every call crosses as tensors)."""
        self.model_name = model_name
        self.outputs = [t.name for t in decl.outputs if t.name != MAILBOX_EVENT]
        self.unet_config = unet_config
        self.mailboxes = Mailboxes()
        self.events = OpenedMailboxes()  # the service instances' "residuals written" events
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

    def submit(self, call: ControlCall) -> "Future[Delivered]":
        return self.pool.submit(self._call, call)

    def _call(self, call: ControlCall) -> Delivered:
        start = time.perf_counter()
        device = torch.device(call.device) if call.device is not None else call.sample.device
        by_mailbox = device.type == "cuda" and call.sample.is_cuda and self.unet_config is not None
        ready, executed, mailbox = start, None, None
        with self._stream(device):
            try:
                if not by_mailbox or self._sends_constants(call):
                    # Triton copies a GPU tensor input synchronously, outside our streams: the
                    # host waits until the step's inputs are ready.
                    if call.ready is not None:
                        call.ready.synchronize()
                    ready = time.perf_counter()
                if by_mailbox:
                    views, mailbox = self._fill_mailbox(call, device)
                response = self._exec(call, device, mailbox)
                executed = time.perf_counter()
                if by_mailbox:
                    return self._empty_mailbox(response, views, device)
                out = {t.name(): to_torch(t).to(device) for t in response.output_tensors()}
                sync_current_stream(out["mid"])  # the copies are done before the response's buffers go back
                return Delivered(([out[n] for n in self.outputs[:-1]], out["mid"]))
            finally:
                end = time.perf_counter()
                executed = executed or end  # (a request that failed spent the rest in it)
                with self._lock:
                    for part, seconds in (("ready", ready - start), ("exec", executed - ready),
                                          ("outputs", end - executed)):
                        self.seconds[part] += seconds

    def _fill_mailbox(self, call: ControlCall, device: torch.device) -> tuple[list[torch.Tensor], Description]:
        """This thread's mailbox on `device` with the call's latents and timesteps, written on our
        stream once the step's inputs are (a wait on the GPU), and its description."""
        rows, _, height, width = call.sample.shape
        residuals = controlnet_residual_shapes(self.unet_config, rows, height, width)
        slots = [Slot("sample", tuple(call.sample.shape), call.sample.dtype), Slot("timestep", (rows,), torch.float32),
                 *(Slot(name, shape, call.sample.dtype) for name, shape in zip(self.outputs, residuals))]
        offsets, nbytes = layout(slots)
        memory, handle, inputs_ready = self.mailboxes.get(device, nbytes)
        views = [memory.tensor(o, s.shape, s.dtype) for o, s in zip(offsets, slots)]
        stream = torch.cuda.current_stream(device)
        if call.ready is not None:
            stream.wait_event(call.ready)
        for view, given in zip(views, (call.sample, call.timestep)):
            given.record_stream(stream)  # (read on our stream, later than the host thinks)
            view.copy_(given)
        inputs_ready.record(stream)
        return views, Description(device.index, handle, bytes(inputs_ready.ipc_handle()), tuple(slots))

    def _empty_mailbox(self, response, views: list[torch.Tensor], device: torch.device) -> Delivered:
        """The residuals the service writes into the mailbox, copied out once its event says they are
        there, so that the mailbox can take this thread's next call (it is written on this stream,
        after the copies). Nothing waits on the host: the denoiser's stream waits for the copies."""
        written = bytes(pb_utils.get_output_tensor_by_name(response, MAILBOX_EVENT).as_numpy().tobytes())
        stream = torch.cuda.current_stream(device)
        stream.wait_event(self.events.event(device, written))
        down, mid = [v.clone() for v in views[2:-1]], views[-1].clone()
        return Delivered((down, mid), stream.record_event())

    def _sends_constants(self, call: ControlCall) -> bool:
        with self._lock:
            return call.session is None or self._sessions.get(call.session, 0) < self.instances

    def _stream(self, device: torch.device):
        if device.type != "cuda":
            return nullcontext()
        streams = getattr(self._streams, "by_device", None)
        if streams is None:
            streams = self._streams.by_device = {}
        if device not in streams:
            streams[device] = torch.cuda.Stream(device)
        return torch.cuda.stream(streams[device])

    def _exec(self, call: ControlCall, device: torch.device, mailbox: Description | None = None):
        # A session's constants go with its first calls, one per instance of the service (Triton
        # spreads the calls of one request over them: an instance that never got them would ask
        # at every call), and again to an instance that asks (backends/core/adapters/control_sessions.py).
        with self._lock:
            sent = self._sessions.get(call.session, 0) if call.session is not None else 0
        constants = call.session is None or sent < self.instances
        try:
            response = self._request(call, device, constants, mailbox)
        except UnknownAdapter as exc:
            if constants or exc.field != "session":
                raise
            constants = True  # (the service counts these: easel_controlnet_session_misses_total)
            if call.ready is not None:  # (Triton copies the constants synchronously: see _call)
                call.ready.synchronize()
            response = self._request(call, device, constants, mailbox)
        if call.session is not None and constants:
            with self._lock:
                self._sessions[call.session] = sent + 1
                self._sessions.move_to_end(call.session)
                while len(self._sessions) > MAX_SESSIONS:
                    self._sessions.popitem(last=False)
        return response

    def _request(self, call: ControlCall, device: torch.device, constants: bool, mailbox: Description | None):
        inputs = [
            pb_utils.Tensor("name", np.array([call.name.encode()], dtype=np.object_)),
            pb_utils.Tensor("scale", np.array([call.scale], dtype=np.float32)),
        ]
        if mailbox is None:
            inputs += [to_triton("sample", call.sample), to_triton("timestep", call.timestep.to(torch.float32))]
        else:
            inputs.append(pb_utils.Tensor(MAILBOX, np.array([mailbox.encode()], dtype=np.object_)))
        if call.session is not None:
            inputs.append(pb_utils.Tensor("session", np.array([call.session.encode()], dtype=np.object_)))
        if constants:
            # Beside a mailbox they go from the host (once per session): as the only GPU inputs of a
            # call to another GPU, Triton 2.51 copied them into each other's buffers ("Source and
            # destination byte size do not match: 98304 != 48", the image into time_ids).
            place = (lambda t: t.cpu()) if mailbox is not None else (lambda t: t)
            inputs += [to_triton("prompt_embeds", place(call.embeds)), to_triton("pooled_embeds", place(call.pooled)),
                       to_triton("time_ids", place(call.time_ids)), to_triton("image", place(call.image))]
        if mailbox is None:
            sync_current_stream(call.sample)  # to_triton's contiguous copies (beside a mailbox: none on a GPU)
        # Residuals straight into our GPU's memory (Triton's default would follow the producer's).
        where = {"preferred_memory": pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, device.index)} \
            if device.type == "cuda" and mailbox is None else {}
        outputs = self.outputs if mailbox is None else [MAILBOX_EVENT]
        response = pb_utils.InferenceRequest(model_name=self.model_name, inputs=inputs, parameters=internal_parameters(),
                                             requested_output_names=outputs, **where).exec()
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
