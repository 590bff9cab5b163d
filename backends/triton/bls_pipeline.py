"""The public pipeline, run by BLS from the top-level model that a client calls: preprocess,
text_encoder, vae_encoder (an edit's), a denoiser, vae_decoder, with the tensors of
backends/core/request/contract.py, then the image file and `info`, encoded here. `easel` (unary) and `easel_stream` (decoupled: a response
per denoising step, then the image) are this one pipeline (backends/easel_pipeline/model.py).

Why the image is encoded here and not in a model of its own: each hand-off between two stubs
copies the tensor through shared memory, and a 1024 px image's pixels to an encoder model and its
file back cost 8-12 ms a request on the CPU dev machine (bench/results/2026-11-24f-cpu/notes.md),
more than the encode itself at PNG's level 1. The encode runs on the request's worker thread, so
it overlaps the other requests' steps as a model instance would, without the hops.

Why not an ensemble: in Triton 2.51 a client's cancel (a gRPC cancel, a dropped stream) reaches
neither an ensemble's steps nor a BLS request, so the denoiser would compute every step of a
request nobody waits for; and an ensemble cannot forward a decoupled step's intermediate
responses. A top-level Python model does see its client's cancel: its response sender's
`is_cancelled()` turns true (measured ~0.01 s after a gRPC cancel, unary and streaming). So a
request reaches its denoiser under a key of ours, and when the client cancels, a watcher thread
sends that denoiser a small request naming the key: the denoiser drops the request at its next
step boundary. The watcher asks `is_cancelled()` only while no execute runs
(triton/adapter.EXECUTE_LOCK: otherwise Triton 2.51's stub corrupts its heap). A client's
deadline also reaches the denoiser as what is left of the request's timeout
(triton/adapter.remaining_us), for clients that cannot cancel (HTTP).

`execute` only copies the inputs and hands each request to a worker thread, which answers through
the request's response sender: the unary model too, as Triton 2.51 lets a non-decoupled Python
model return None from `execute` and send its one response (FINAL) later. So one instance runs up
to `max_in_flight` requests at once, and refuses the next with UNAVAILABLE at once. numpy only:
the instance holds no engine, only threads waiting on the models it calls.

Triton's traces do not follow the calls: handing a BLS request the client request's `trace()`
from a worker crashed tritonserver (SIGSEGV in TRITONSERVER_ServerInferAsync: the trace does not
outlive `execute`), so bench/micro/pipeline_trace.py reads Triton's per-model statistics instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.core.request import contract
from backends.core.request.adapter_inputs import checked_params
from backends.core.request.params import Cancelled, GenerateParams, InvalidInput, Overloaded
from backends.core.request.response_info import response_info
from backends.core.request.output_format import FORMATS
from backends.core.stages.image_files import encode_image
from backends.core.stages.preview import preview_png
from backends.core.serving.routing import LeastLoaded, RequestCost
from backends.core.serving.load_board import LoadReader
from backends.core.serving.preview_board import PreviewFile, remove_orphan_previews
from backends.triton.adapter import (MARKS_PARAMETER, ForwardedError, failure, input_array, internal_parameters,
                                     is_cancelled, limits, parameters, remaining_us, scalar)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("backends.triton.bls_pipeline")
# How often the watcher asks whether a client cancelled: the denoiser drops the request at the
# first step boundary after it hears, so this bounds the cancel's delay beyond one step.
WATCH_INTERVAL_S = 0.1


@dataclass(eq=False)
class Job:
    """One client request: its inputs (copied out of the request in `execute`), where it stands."""

    sender: object
    inputs: list  # the public inputs it sent, as pb_utils Tensors
    timeout_us: int
    preview_every: int | None  # None: no progress responses (the unary model)
    start: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    # While it denoises: (denoiser, cancel key), for the watcher's cancel.
    denoising: tuple[str, str] | None = None
    cancel_sent: bool = False
    # Once the final response is sent, Triton 2.51 frees the sender's response factory, and
    # is_cancelled() on it crashes tritonserver (SIGSEGV in TRITONBACKEND_ResponseFactoryIsCancelled,
    # seen under load): the final send and the watcher's is_cancelled() take turns under this lock.
    answered: bool = False
    answering: threading.Lock = field(default_factory=threading.Lock)


def _tensor(name: str, value, dtype) -> object:
    return pb_utils.Tensor(name, np.array([value], dtype=dtype))


def _encoded(params: GenerateParams, pixels: np.ndarray) -> tuple[object, object]:
    """The public outputs `image` (the file the request asked for) and `info`."""
    start = time.perf_counter()
    image = encode_image(pixels, params.output_format, params.quality)
    # (`postprocess_s`: the name this stage had as a model of its own, kept for the reports)
    info = response_info(params.with_trace(postprocess_s=time.perf_counter() - start))
    return _tensor("image", image, np.object_), _tensor("info", json.dumps(info).encode(), np.object_)


def request_cost(params: GenerateParams, edit: list) -> RequestCost:
    """What a request weighs for routing. A template edit may reuse a recording and compute its
    masked tokens only: priced by its mask's share (the latent-size mask the VAE encoder gave),
    which the denoiser's board corrects once it knows whether the edit reuses."""
    work = params.work()
    if params.template is None or not edit:
        return RequestCost(work)
    names = [t.name for t in contract.EDIT]
    mask = edit[names.index("mask")].as_numpy()
    # The recording's key as far as routing needs it (the denoiser's template_key is the exact one)
    image = np.ascontiguousarray(edit[names.index("image_mean")].as_numpy())
    key = (params.template, hashlib.sha256(image.tobytes()).hexdigest(), params.width, params.height, params.steps,
           params.scheduler, params.strength, params.seed, params.cfg,
           tuple((lora.name, lora.scale) for lora in params.loras), tuple(c.name for c in params.controls))
    return RequestCost(work, work * float(mask.mean()), key)


class BlsPipeline:
    """The pipeline of one model instance. Progress responses when the model is decoupled."""

    def __init__(self, args):
        self.name = args["model_name"]
        self.progress = pb_utils.using_decoupled_model_transaction_policy(json.loads(args["model_config"]))
        self.limits = limits(args)
        params = parameters(args)
        names = [n.strip() for n in params["denoisers"].split(",") if n.strip()]
        if not names:
            raise ValueError("parameter denoisers names no model")
        # each denoiser batches what it gets
        self.router = LeastLoaded(names, LoadReader(), params.get("routing", "seconds"))
        if self.progress:
            remove_orphan_previews()
        self.max_in_flight = int(params.get("max_in_flight", "16"))
        self.jobs: set[Job] = set()
        self.lock = threading.Lock()  # jobs: execute, workers, watcher
        self.pool = ThreadPoolExecutor(self.max_in_flight, thread_name_prefix=f"{self.name}-bls")
        self.stopping = threading.Event()
        self.watcher = threading.Thread(target=self._watch, name=f"{self.name}-watch", daemon=True)
        self.watcher.start()
        # Each format's first encode in a process is slow (PNG's thread pool, PIL's plugins): here,
        # not in a client's request.
        for fmt in FORMATS:
            encode_image(np.zeros((512, 512, 3), np.uint8), fmt)

    def start(self, request) -> None:
        """Admits `request` and runs it on a worker; every answer goes through its response sender.
        Called from execute, under triton/adapter.EXECUTE_LOCK."""
        sender = request.get_response_sender()
        try:
            job = self._admit(request, sender)
        except Exception as exc:
            sender.send(failure(exc, self.name, log, stream=self.progress), flags=FINAL)
            return
        self.pool.submit(self._run, job)

    def _admit(self, request, sender) -> Job:
        every = None
        if self.progress:
            every = scalar(input_array(request, "preview_every")) or 0
            if not 0 <= every <= self.limits.max_steps:
                raise InvalidInput("preview_every", f"{every} is outside [0, {self.limits.max_steps}]")
        # Copies: the worker must not depend on the request's own tensors once execute returned.
        inputs = [pb_utils.Tensor(t.name, array) for t in contract.PUBLIC.inputs
                  if (array := input_array(request, t.name)) is not None]
        job = Job(sender, inputs, request.timeout(), every)
        with self.lock:
            if len(self.jobs) >= self.max_in_flight:
                raise Overloaded(f"{self.name}: overloaded, {self.max_in_flight} requests are already running; "
                                 "retry later")
            self.jobs.add(job)
        return job

    def _run(self, job: Job) -> None:
        try:
            image, info = self._pipeline(job)
            response = pb_utils.InferenceResponse([image, info])
        except Exception as exc:
            response = failure(exc, self.name, log, stream=self.progress)
        with self.lock:
            self.jobs.discard(job)
        with job.answering:
            job.answered = True
            job.sender.send(response, flags=FINAL)

    def _pipeline(self, job: Job):
        out = self._call(job, "preprocess", contract.PREPROCESS, job.inputs)
        params, control_images = out["params"], out["control_images"]
        out = self._call(job, "text_encoder", contract.TEXT_ENCODER, [params])
        params, embeds, edit = out["params"], [out["prompt_embeds"], out["pooled_embeds"]], []
        checked = checked_params(scalar(params.as_numpy()), self.limits)  # its steps and strength, as it began
        if checked.strength is not None:  # an edit
            files = [t for t in job.inputs if t.name() in ("image", "mask_image")]
            out = self._call(job, "vae_encoder", contract.VAE_ENCODER, [params, *files])
            params, edit = out["params"], [out[t.name] for t in contract.EDIT]
        latents, params = self._denoise(job, checked, params, *embeds, control_images, edit)
        out = self._call(job, "vae_decoder", contract.VAE_DECODER, [params, latents])
        return _encoded(GenerateParams.from_json(scalar(out["params"].as_numpy())), out["pixels"].as_numpy())

    def _call(self, job: Job, model: str, decl: contract.ModelDecl, inputs: list) -> dict:
        if job.cancelled:
            raise Cancelled(f"{self.name}: cancelled by the client before {model}")
        # (marked errors: their status survives BLS, see triton/adapter.MARKS_PARAMETER)
        response = pb_utils.InferenceRequest(model_name=model, inputs=inputs,
                                             parameters={MARKS_PARAMETER: True, **internal_parameters()},
                                             requested_output_names=[t.name for t in decl.outputs]).exec()
        if response.has_error():
            raise ForwardedError(response.error())
        return {t.name(): t for t in response.output_tensors()}

    def _denoise(self, job: Job, checked: GenerateParams, params, prompt_embeds, pooled_embeds, control_images,
                 edit: list):
        """The denoiser's answer (latents, params), its progress responses forwarded as they come.
        `checked`: the request's params as the pipeline read them (steps, work)."""
        if job.cancelled:
            raise Cancelled(f"{self.name}: cancelled by the client before denoising")
        key = uuid.uuid4().hex
        chosen = self.router.pick(request_cost(checked, edit))
        denoiser = chosen.name
        admitted = False
        inputs = [params, prompt_embeds, pooled_embeds, control_images, *edit,
                  _tensor("cancel_key", key.encode(), np.object_)]
        previews = None
        if job.preview_every is not None:  # asks for a response per step
            inputs.append(_tensor("preview_every", job.preview_every, np.int32))
            if job.preview_every:
                try:
                    previews = PreviewFile(key)
                except OSError:  # a preview is never worth a request
                    log.warning("no previews for this request: its file cannot be made", exc_info=True)
        final = None
        try:
            request = pb_utils.InferenceRequest(
                model_name=denoiser, inputs=inputs, requested_output_names=[t.name for t in contract.DENOISER.outputs],
                parameters=internal_parameters(),
                timeout=remaining_us(job.timeout_us, checked, self.name))
            # exec returns at the denoiser's first response: for a keyed request, an empty one once
            # it is admitted, so a cancel sent from now on finds it (contract.DENOISER).
            responses = request.exec(decoupled=True)
            self.router.admitted(chosen)
            admitted = True
            job.denoising = (denoiser, key)
            for i, response in enumerate(responses):
                if response.has_error():
                    raise ForwardedError(response.error())
                outputs = {t.name(): t for t in response.output_tensors()}
                if "error" in outputs:  # a failure after the first response (contract.DENOISER)
                    raise ForwardedError(pb_utils.TritonError(scalar(outputs["error"].as_numpy()).decode()))
                if "latents" in outputs:
                    final = outputs
                elif i > 0 and job.preview_every is not None:  # the first: the admission; then step i
                    self._progress(job, i, checked.denoising_steps, previews)
        finally:
            job.denoising = None
            self.router.release(chosen, admitted, served=final is not None)
            if previews is not None:
                previews.close()
        if final is None:
            raise RuntimeError("the denoiser finished without a result")
        return final["latents"], final["params"]

    def _progress(self, job: Job, step: int, steps: int, previews: PreviewFile | None) -> None:
        tensors = [_tensor("step", step, np.int32), _tensor("steps", steps, np.int32),
                   _tensor("elapsed_s", time.monotonic() - job.start, np.float32)]
        # The denoiser wrote a due step's preview before that step's response; one overwritten
        # since (this thread fell behind) or being written is skipped, never sent mislabelled.
        preview = previews.read() if previews is not None and step % job.preview_every == 0 else None
        if preview is not None and preview[0] == step:
            tensors.append(_tensor("preview", preview_png(preview[1]), np.object_))
        try:
            job.sender.send(pb_utils.InferenceResponse(tensors))
        except Exception:  # the client is gone: keep reading the denoiser's answers to their end
            log.warning("progress not sent", exc_info=True)

    def _watch(self) -> None:
        """Notices clients that cancelled, and has their denoiser drop their request."""
        while not self.stopping.wait(WATCH_INTERVAL_S):
            with self.lock:
                jobs = [j for j in self.jobs if not j.cancel_sent]
            for job in jobs:
                try:
                    if not job.cancelled:
                        with job.answering:
                            if job.answered or not is_cancelled(job.sender):
                                continue
                        job.cancelled = True  # the worker stops before its next model
                    denoising = job.denoising  # (a job that starts denoising now: next round)
                    if denoising is not None:
                        job.cancel_sent = True
                        log.info("a client cancelled its %s request: %s drops it at its next step",
                                 self.name, denoising[0])
                        self._cancel(*denoising)
                except Exception:  # a failed cancel leaves the request to finish; the watcher goes on
                    log.warning("cancelling a request failed", exc_info=True)

    @staticmethod
    def _cancel(denoiser: str, key: str) -> None:
        request = pb_utils.InferenceRequest(model_name=denoiser, requested_output_names=[],
                                            inputs=[_tensor("cancel", key.encode(), np.object_)],
                                            parameters=internal_parameters())
        for response in request.exec(decoupled=True):
            if response.has_error():
                log.warning("%s refused a cancel: %s", denoiser, response.error().message())

    def close(self) -> None:
        self.stopping.set()
        self.watcher.join(timeout=5)
        self.pool.shutdown(wait=False)
