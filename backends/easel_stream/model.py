"""Triton adapter of the public `easel_stream` (decoupled, gRPC streaming): `easel`'s pipeline with
a response per denoising step, then the image.

Why not an ensemble like `easel`: an ensemble cannot forward a decoupled step's intermediate
responses, and a client's cancel of an ensemble never reaches its steps (Triton 2.51). A decoupled
top-level model does see its client's cancel (`is_cancelled()` of its response sender, when the
gRPC stream is cancelled), so this model runs the pipeline itself by BLS, with the models and
tensors of backends/core/request/contract.py: preprocess, text_encoder, a denoiser (asked for
progress under a key of ours), vae_decoder, postprocess. A BLS request cannot be cancelled in
2.51, so when the client cancels, a watcher thread sends the denoiser a small request that names
the key, and the denoiser drops the request at its next step boundary.

`execute` only copies the inputs and hands each request to a thread of its own (bounded: past
`max_streams` a request is refused with UNAVAILABLE); previews (the latent-to-RGB approximation
and a small PNG, backends/core/stages/preview.py) are made on that thread, not in the denoiser.
numpy only, like generate.
"""

import os
import site
import sys

# The stub's interpreter ignores PYTHONPATH: add its folders (with their .pth files) ahead of
# the interpreter's own site-packages, as PYTHONPATH would, so the deployment's numpy wins.
_own = list(sys.path)
for _p in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    if _p:
        site.addsitedir(_p)
sys.path[:] = [p for p in sys.path if p not in _own] + _own

import itertools  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from backends.core.request import contract  # noqa: E402
from backends.core.request.adapter_inputs import checked_params  # noqa: E402
from backends.core.request.params import Cancelled, InvalidInput, Limits  # noqa: E402
from backends.core.stages.preview import preview_png  # noqa: E402
from backends.triton_adapter import (  # noqa: E402
    MARKS_PARAMETER, ForwardedError, code_of, error, failure, input_array, limits, parameters, remaining_us, scalar,
    setup_logging)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("backends.easel_stream")
# How often the watcher asks whether a client cancelled: the denoiser drops the request at the
# first step boundary after it hears, so this bounds the cancel's delay beyond one step.
WATCH_INTERVAL_S = 0.1


@dataclass(eq=False)
class Stream:
    """One client request: its inputs (copied out of the request in `execute`), where it stands."""

    sender: object
    inputs: list  # the public inputs it sent, as pb_utils Tensors
    preview_every: int
    timeout_us: int
    start: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    # While it denoises: (denoiser, progress key), for the watcher's cancel.
    denoising: tuple[str, str] | None = None
    cancel_sent: bool = False


def _tensor(name: str, value, dtype) -> object:
    return pb_utils.Tensor(name, np.array([value], dtype=dtype))


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        self.limits: Limits = limits(args)
        params = parameters(args)
        names = [n.strip() for n in params["denoisers"].split(",") if n.strip()]
        if not names:
            raise ValueError("parameter denoisers names no model")
        self.denoisers = itertools.cycle(names)
        self.max_streams = int(params.get("max_streams", "16"))
        self.streams: set[Stream] = set()
        self.lock = threading.Lock()  # streams and the denoisers' cycle: execute, workers, watcher
        self.pool = ThreadPoolExecutor(self.max_streams, thread_name_prefix="easel-stream")
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name="easel-stream-watch", daemon=True)
        self.watcher.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                stream = self._admit(request, sender)
            except Exception as exc:
                sender.send(failure(exc, "easel_stream", log), flags=FINAL)
                continue
            if stream is not None:
                self.pool.submit(self._run, stream)
        return None

    def _admit(self, request, sender) -> Stream | None:
        """The request as a Stream, or None when refused for overload (answered here)."""
        every = scalar(input_array(request, "preview_every"))
        every = 0 if every is None else every
        if not 0 <= every <= self.limits.max_steps:
            raise InvalidInput("preview_every", f"{every} is outside [0, {self.limits.max_steps}]")
        # Copies: the worker must not depend on the request's own tensors once execute returned.
        inputs = [pb_utils.Tensor(t.name, array) for t in contract.PUBLIC.inputs
                  if (array := input_array(request, t.name)) is not None]
        stream = Stream(sender, inputs, int(every), request.timeout())
        with self.lock:
            if len(self.streams) >= self.max_streams:
                code = code_of("UNAVAILABLE")
                sender.send(error(f"easel_stream: overloaded, {self.max_streams} streams are already running; "
                                  "retry later", code=code), flags=FINAL)
                return None
            self.streams.add(stream)
        return stream

    def _run(self, stream: Stream) -> None:
        try:
            image, info = self._pipeline(stream)
            stream.sender.send(pb_utils.InferenceResponse([image, info]), flags=FINAL)
        except Exception as exc:
            stream.sender.send(failure(exc, "easel_stream", log), flags=FINAL)
        finally:
            with self.lock:
                self.streams.discard(stream)

    def _pipeline(self, stream: Stream):
        out = self._call(stream, "preprocess", contract.PREPROCESS, stream.inputs)
        params, control_images = out["params"], out["control_images"]
        out = self._call(stream, "text_encoder", contract.TEXT_ENCODER, [params])
        latents, params = self._denoise(stream, out["params"], out["prompt_embeds"], out["pooled_embeds"],
                                        control_images)
        out = self._call(stream, "vae_decoder", contract.VAE_DECODER, [params, latents])
        out = self._call(stream, "postprocess", contract.POSTPROCESS, [out["params"], out["pixels"]])
        return out["image"], out["info"]

    def _call(self, stream: Stream, model: str, decl: contract.ModelDecl, inputs: list) -> dict:
        if stream.cancelled:
            raise Cancelled(f"easel_stream: cancelled by the client before {model}")
        # (marked errors: their status survives BLS, see triton_adapter.MARKS_PARAMETER)
        response = pb_utils.InferenceRequest(model_name=model, inputs=inputs, parameters={MARKS_PARAMETER: True},
                                             requested_output_names=[t.name for t in decl.outputs]).exec()
        if response.has_error():
            raise ForwardedError(response.error())
        return {t.name(): t for t in response.output_tensors()}

    def _denoise(self, stream: Stream, params, prompt_embeds, pooled_embeds, control_images):
        """The denoiser's progress responses forwarded as they come; returns (latents, params)."""
        if stream.cancelled:
            raise Cancelled("easel_stream: cancelled by the client before denoising")
        checked = checked_params(scalar(params.as_numpy()), self.limits)  # its steps, when it began
        key = uuid.uuid4().hex
        with self.lock:
            denoiser = next(self.denoisers)
        request = pb_utils.InferenceRequest(
            model_name=denoiser,
            inputs=[params, prompt_embeds, pooled_embeds, control_images,
                    _tensor("progress_key", key.encode(), np.object_),
                    _tensor("preview_every", stream.preview_every, np.int32)],
            requested_output_names=[t.name for t in contract.DENOISER.outputs],
            timeout=remaining_us(stream.timeout_us, checked, "easel_stream"))
        responses = request.exec(decoupled=True)
        stream.denoising = (denoiser, key)  # enqueued: a cancel sent now reaches the denoiser after it
        final = None
        try:
            for response in responses:
                if response.has_error():
                    raise ForwardedError(response.error())
                outputs = {t.name(): t for t in response.output_tensors()}
                if "latents" in outputs:
                    final = outputs
                elif "step" in outputs:
                    self._progress(stream, checked.steps, outputs)
        finally:
            stream.denoising = None
        if final is None:
            raise RuntimeError("the denoiser finished without a result")
        return final["latents"], final["params"]

    def _progress(self, stream: Stream, steps: int, outputs: dict) -> None:
        step = int(outputs["step"].as_numpy().reshape(-1)[0])
        tensors = [_tensor("step", step, np.int32), _tensor("steps", steps, np.int32),
                   _tensor("elapsed_s", time.monotonic() - stream.start, np.float32)]
        latents = outputs.get("preview_latents")
        if latents is not None:
            tensors.append(_tensor("preview", preview_png(latents.as_numpy()), np.object_))
        try:
            stream.sender.send(pb_utils.InferenceResponse(tensors))
        except Exception:  # the client is gone: keep reading the denoiser's answers to their end
            log.warning("progress not sent", exc_info=True)

    def _watch(self) -> None:
        """Notices clients that cancelled, and has their denoiser drop their request."""
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                streams = [s for s in self.streams if not s.cancel_sent]
            for stream in streams:
                try:
                    if not stream.cancelled:
                        if not stream.sender.is_cancelled():
                            continue
                        stream.cancelled = True  # the worker stops before its next model
                    denoising = stream.denoising  # (a stream that starts denoising now: next round)
                    if denoising is not None:
                        stream.cancel_sent = True
                        log.info("a client cancelled its stream: %s drops the request at its next step",
                                 denoising[0])
                        self._cancel(*denoising)
                except Exception:  # a failed cancel leaves the request to finish; the watcher goes on
                    log.warning("cancelling a stream failed", exc_info=True)

    @staticmethod
    def _cancel(denoiser: str, key: str) -> None:
        request = pb_utils.InferenceRequest(model_name=denoiser, requested_output_names=[],
                                            inputs=[_tensor("cancel", key.encode(), np.object_)])
        for response in request.exec(decoupled=True):
            if response.has_error():
                log.warning("%s refused a cancel: %s", denoiser, response.error().message())

    def finalize(self):
        self.stopping.set()
        self.watcher.join(timeout=5)
        self.pool.shutdown(wait=False)
