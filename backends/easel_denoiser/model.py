"""Triton adapter of the denoiser (decoupled): one per GPU, continuous batching inside.

`execute` only turns requests into DenoiseJobs and enqueues them; the loop thread owns the
engine; a sender thread sends finished results, so responses never wait on a step and a step
never waits on a response. finalize: stop the loop (failing what is left), then drain the
sender, in that order.
"""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import logging
import sys
import queue
import threading
import time
import uuid

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.triton.bls_controlnets import BlsControlNets
from backends.triton.metrics import (ControlNetCallMetrics, LoraMetrics, RequestMetrics, RuntimeMetrics,
                                     TemplateMetrics)
from backends.triton.metrics import StepMetrics
from backends.core.serving.load_board import LoadWriter
from backends.core.serving.preview_board import MAX_KEY_LENGTH, valid_key, write_preview
from backends.core.adapters.controlnet import ControlInput
from backends.core.engine.builder import build_denoiser
from backends.core.engine.config import DenoiserConfig
from backends.core.engine.requests import DenoiseJob, EditInputs, StepProgress
from backends.core.engine.loop import DenoiseResult, failure_kind
from backends.core.request.adapter_inputs import decode_control_image
from backends.core.request.contract import DENOISE_JOB, EDIT, WIRE_DTYPES, controlnet_decl
from backends.core.request.params import InvalidInput, UnknownAdapter
from backends.core.runtime.unet_split import num_skips
from backends.triton.adapter import (
    adapter_store_folder, artifact_folder, check_caller, code_of, drop_metrics, error, failure, holds_execute_lock,
    input_array, is_cancelled, mark, parameters, params_tensor, placement, public_message, read_params, scalar, setup_stub)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("backends.easel_denoiser")
# The status each failed outcome goes back with (marked: a BLS caller gets only INTERNAL in 2.51).
CODES = {"cancelled": "CANCELLED", "invalid": "INVALID_ARG", "not_found": "NOT_FOUND", "refused": "UNAVAILABLE"}


# The inputs of a denoising request (a cancel request carries only `cancel`).
JOB_INPUTS = tuple(t.name for t in DENOISE_JOB)


def _scalar(request, name: str):
    """An optional [1] input's one element (bytes as text), or None."""
    value = scalar(input_array(request, name))
    return value.decode(errors="replace") if isinstance(value, bytes) else value


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        # The loop thread launches kernels from Python while BLS threads wait for the GIL to hand
        # ControlNet tensors over; the default 5 ms switch interval delays each hand-off by up to
        # that much (bench/micro/bls_transport.py measures it).
        sys.setswitchinterval(0.001)
        self.name = args["model_name"]
        config = DenoiserConfig.from_json(parameters(args)["denoiser"])
        self.limits = config.limits
        self.max_pending = config.max_running + config.max_queue
        self.pending: dict[str, tuple] = {}  # request id -> (sender, params)
        # Requests of the public models (backends/triton/bls_pipeline.py): their cancel flags by the caller's
        # key, and each one's key.
        self.cancels: dict[str, threading.Event] = {}
        self.keys: dict[str, str] = {}  # request id -> cancel key
        self.request_metrics = RequestMetrics(args)
        self.outbox: queue.Queue[DenoiseResult | StepProgress | None] = queue.Queue()
        self.sender = threading.Thread(target=self._send_loop, name="easel-denoise-sender", daemon=True)
        self.sender.start()
        where = placement(args)
        where.make_current()
        store_folder = adapter_store_folder(args)

        def controlnets(engine, store):  # the ControlNet service, by BLS
            decl = controlnet_decl(num_skips(engine.unet), WIRE_DTYPES[where.dtype])
            return BlsControlNets(config.controlnet_model, decl, store, instances=config.controlnet_instances,
                                  unet_config=engine.unet.config)

        # Its outstanding work, for the public models' routers (backends/core/serving/load_board.py).
        self.load_board = LoadWriter(self.name)
        self.denoiser = build_denoiser(config, artifact_folder(args), where, self.outbox.put,
                                       store_folder=store_folder, controlnets=controlnets,
                                       publish_load=self.load_board.publish)
        self.lora_loads: dict[str, tuple[int, float, int]] = {}  # request id -> (count, seconds, bytes)
        engine = self.denoiser.engine
        self.metrics = LoraMetrics(args, engine.loras.merger)
        self.control_metrics = ControlNetCallMetrics(args, engine)
        self.runtime_metrics = RuntimeMetrics(args, self.denoiser)
        self.template_metrics = TemplateMetrics(args, self.denoiser)
        self.loop = self.denoiser.loop
        self.step_metrics = StepMetrics(args, self.loop.stats)  # queue, running, step times: its own thread
        self.loop.start()

    @holds_execute_lock
    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                check_caller(request, self.name)  # (cancels too: a client must not cancel others' requests)
            except UnknownAdapter as exc:
                sender.send(failure(exc, "denoiser", log, marked=True), flags=FINAL)
                continue
            if pb_utils.get_input_tensor_by_name(request, "cancel") is not None:
                self._cancel(request, sender)  # never refused: it frees a place
                continue
            # Bounded admission: past the bound a request is refused at once instead of joining a
            # queue whose wait only grows (each waiting request also holds its tensors).
            if len(self.pending) >= self.max_pending:
                self.request_metrics.record("refused")
                log.warning("request refused: %d requests are pending, the bound is %d", len(self.pending),
                            self.max_pending)
                code = code_of(CODES["refused"])
                sender.send(error(mark(f"denoiser: overloaded, {self.max_pending} requests are already admitted "
                                       "(max_running + max_queue); retry later", code), code=code), flags=FINAL)
                continue
            try:
                for name in JOB_INPUTS:  # optional for Triton only so that a cancel may come alone
                    if pb_utils.get_input_tensor_by_name(request, name) is None:
                        raise InvalidInput(name, "is required")
                params = read_params(request, self.limits)
                timeout_us = request.timeout()  # what is left of the client's deadline (bls_pipeline)
                job = DenoiseJob(
                    request_id=uuid.uuid4().hex, params=params,
                    prompt_embeds=pb_utils.get_input_tensor_by_name(request, "prompt_embeds").as_numpy(),
                    pooled_embeds=pb_utils.get_input_tensor_by_name(request, "pooled_embeds").as_numpy(),
                    is_cancelled=lambda: is_cancelled(sender), controls=self._controls(request, params),
                    deadline=time.monotonic() + timeout_us / 1e6 if timeout_us else None, **self._edit(request, params))
                if job.edit is not None and job.edit.template is not None:
                    job.adapter_versions = self.denoiser.adapter_versions(params)
                self._keyed(request, job, sender)
            except Exception as exc:
                self.request_metrics.record(failure_kind(exc))
                sender.send(failure(exc, "denoiser", log, marked=True), flags=FINAL)
                continue
            self.pending[job.request_id] = (sender, params)
            self.request_metrics.other.set("pending", len(self.pending))
            if params.loras:  # file I/O runs in the loader processes, never on Triton's thread or the loop
                rid = job.request_id
                job.loras_pending = self.denoiser.load_loras(
                    params, on_loaded=lambda stats, rid=rid: self.lora_loads.__setitem__(rid, stats))
                job.lora_bound = self.denoiser.lora_bound(params)
            if job.request_id in self.keys:  # admitted: tells the caller a cancel now finds it
                sender.send(pb_utils.InferenceResponse([]))
            self.loop.submit(job)
        return None

    def _keyed(self, request, job: DenoiseJob, sender) -> None:
        """A request with a `cancel_key` can be cancelled by a later request naming the key; one
        with `preview_every` gets an empty response per step (the sender thread sends them, in
        order with its result), its previews in the key's file (backends/core/serving/preview_board.py). The
        unary `easel` asks only for the first: per-step responses would cost it a BLS response
        each for nothing."""
        key = _scalar(request, "cancel_key")
        if key is not None and not valid_key(key):
            raise InvalidInput("cancel_key", f"must be 1 to {MAX_KEY_LENGTH} letters, digits, '_' or '-'")
        if key is not None and key in self.cancels:
            raise InvalidInput("cancel_key", "is already in use")
        every = _scalar(request, "preview_every")
        if every is not None:
            if not 0 <= every <= self.limits.max_steps:
                raise InvalidInput("preview_every", f"{every} is outside [0, {self.limits.max_steps}]")
            job.on_step, job.preview_every = self.outbox.put, int(every)
        if key is not None:
            cancelled = threading.Event()
            job.is_cancelled = lambda: cancelled.is_set() or is_cancelled(sender)
            self.cancels[key] = cancelled
            self.keys[job.request_id] = key

    def _cancel(self, request, sender) -> None:
        """A public model's client cancelled: the loop drops the request at its next step boundary
        (its own error response then ends the caller's wait). An unknown key has finished."""
        cancelled = self.cancels.get(_scalar(request, "cancel"))
        if cancelled is not None:
            cancelled.set()
        sender.send(flags=FINAL)

    def _send_progress(self, progress: StepProgress) -> None:
        """A step: an empty response (no tensor: contract.DENOISER says why), its preview first."""
        key = self.keys.get(progress.request_id)
        if progress.latents is not None and key is not None:
            try:  # (waits for the copy the loop queued, not for the loop)
                write_preview(key, progress.step, progress.latents.numpy())
            except OSError:  # a preview is never worth a request
                log.warning("preview of request %s not written", progress.request_id, exc_info=True)
        try:
            self.pending[progress.request_id][0].send(pb_utils.InferenceResponse([]))
        except Exception:  # the caller went away: its result (or error) still ends the request
            log.warning("progress of request %s not sent", progress.request_id, exc_info=True)

    @staticmethod
    def _edit(request, params) -> dict:
        """An edit's DenoiseJob fields (the inpaint workflow, its EditInputs), from the EDIT tensors
        that the VAE encoder made; none for text to image. Their shapes are the workflow's to check."""
        given = {t.name: input_array(request, t.name) for t in EDIT}
        if params.strength is None:
            if any(a is not None for a in given.values()):
                raise InvalidInput("strength", "is not set, yet the request carries an edit's tensors")
            return {}
        missing = [name for name, a in given.items() if a is None]
        if missing:
            raise InvalidInput(missing[0], "is required for an edit (params.strength is set)")
        scaling = given.pop("scaling_factor").reshape(-1)
        if scaling.size != 1 or not 0.0 < float(scaling[0]) < 1e3:
            raise InvalidInput("scaling_factor", f"{scaling.tolist()} is not one positive factor")
        return {"workflow": "inpaint", "edit": EditInputs(**given, scaling_factor=float(scaling[0]),
                                                          strength=params.strength, template=params.template)}

    def _controls(self, request, params):
        images = pb_utils.get_input_tensor_by_name(request, "control_images").as_numpy().reshape(-1)
        return [ControlInput(c.name, decode_control_image(images[i], self.limits.max_control_image_pixels, i),
                             c.scale, c.guidance_start, c.guidance_end)
                for i, c in enumerate(params.controls)]

    def _send_loop(self):
        while (result := self.outbox.get()) is not None:
            if isinstance(result, StepProgress):
                self._send_progress(result)
                continue
            sender, params = self.pending.pop(result.request_id)
            key = self.keys.pop(result.request_id, None)
            self.cancels.pop(key, None)
            self.request_metrics.record(result.outcome, result.steps)
            self.request_metrics.other.set("pending", len(self.pending))
            self.metrics.record(self.lora_loads.pop(result.request_id, None), result)
            self.control_metrics.update()
            self.runtime_metrics.update()
            self.template_metrics.update()
            if result.error is not None:
                code = code_of(CODES[result.outcome]) if result.outcome in CODES else None
                if code is None:
                    log.error("request failed: %s", result.error)  # the loop logged its traceback
                else:
                    log.warning("request %s: %s", result.outcome.replace("_", " "), result.error)
                message = f"denoiser: {result.error}"
                message = mark(message, code) if code is not None else message
                if key is None:
                    sender.send(error(message, code=code), flags=FINAL)
                else:  # acknowledged: the error goes in band (contract.DENOISER)
                    text = np.array([public_message(message).encode()], dtype=np.object_)
                    sender.send(pb_utils.InferenceResponse([pb_utils.Tensor("error", text)]), flags=FINAL)
                continue
            params = params.with_trace(queue_s=result.queue_s, admit_s=result.admit_s, denoise_s=result.denoise_s,
                                       max_batch=result.max_batch, denoiser=self.name, lora_step=result.lora_step,
                                       lora_wait_s=result.lora_wait_s,
                                       **({"template_use": result.template_use} if result.template_use else {}))
            sender.send(pb_utils.InferenceResponse([
                params_tensor(params), pb_utils.Tensor("latents", np.ascontiguousarray(result.latents))]),
                flags=FINAL)

    def finalize(self):
        # Fixed order: LoRA loaders, the loop (failing what is left), the ControlNet provider,
        # the load board, then the sender drains what the loop handed it.
        self.denoiser.shutdown()
        self.load_board.close()
        self.outbox.put(None)
        self.sender.join(timeout=30)
        self.step_metrics.stop()
        drop_metrics(self, "request_metrics", "metrics", "control_metrics", "runtime_metrics", "template_metrics",
                     "step_metrics")
