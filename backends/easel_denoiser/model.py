"""Triton adapter of the denoiser (decoupled): one per GPU, continuous batching inside.

`execute` only turns requests into DenoiseJobs and enqueues them; the loop thread owns the
engine; a sender thread sends finished results, so responses never wait on a step and a step
never waits on a response. finalize: stop the loop (failing what is left), then drain the
sender, in that order.
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

import json  # noqa: E402
import logging  # noqa: E402
import queue  # noqa: E402
from concurrent.futures import Future  # noqa: E402
import threading  # noqa: E402
import uuid  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from backends.bls_controlnets import BlsControlNets  # noqa: E402
from backends.core.adapters.store import AdapterStore  # noqa: E402
from backends.core.request.contract import WIRE_DTYPES, controlnet_decl  # noqa: E402
from backends.core.request.adapter_inputs import decode_control_image  # noqa: E402
from backends.core.adapters.controlnet import ControlInput  # noqa: E402
from backends.core.engine.denoiser import DenoiseJob, TorchDenoiser  # noqa: E402
from backends.core.engine.loop import DenoiseLoop, DenoiseResult  # noqa: E402
from backends.core.adapters.lora import BOUNDS_FILE  # noqa: E402
from backends.core.adapters.lora_loader import LoraLoaderPool  # noqa: E402
from backends.core.request.params import InvalidInput, Limits  # noqa: E402
from backends.core.engine.scheduler import SchedulerConfig  # noqa: E402
from backends.core.runtime.unet_split import num_skips  # noqa: E402
from backends.triton_adapter import (  # noqa: E402
    Metrics, adapter_store_folder, artifact_folder, error, parameters, params_tensor, placement, read_params,
    setup_logging)

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
log = logging.getLogger("backends.easel_denoiser")


class LoraMetrics:
    """LoRA loading and merging as Prometheus counters (updated from the sender thread only)."""

    def __init__(self, args, merger):
        self.merger = merger
        self.metrics = Metrics({"model": args["model_name"]}, {
            "loads": ("easel_lora_loads_total", "LoRA files loaded", "counter"),
            "seconds": ("easel_lora_load_seconds_total", "seconds spent loading LoRAs", "counter"),
            "bytes": ("easel_lora_loaded_bytes_total", "bytes of LoRA weights loaded", "counter"),
            "merged": ("easel_lora_merged_requests_total", "requests whose LoRAs were merged", "counter"),
            "merge_step": ("easel_lora_merge_step_total", "sum of the steps at which LoRAs landed", "counter"),
            "waits": ("easel_lora_bound_waits_total", "requests that waited at their bound", "counter"),
            "wait_s": ("easel_lora_bound_wait_seconds_total", "seconds requests waited at their bound", "counter"),
            "merge_s": ("easel_lora_merge_seconds_total",
                        "seconds spent merging LoRAs into the weights and restoring them (GPU time on a GPU)",
                        "counter"),
        })

    def record(self, load, result) -> None:
        if load is not None:
            count, seconds, nbytes = load
            self.metrics.increment("loads", count)
            self.metrics.increment("seconds", seconds)
            self.metrics.increment("bytes", nbytes)
        if result.lora_step is not None:
            self.metrics.increment("merged", 1)
            self.metrics.increment("merge_step", result.lora_step)
        self.metrics.increment("waits", int(result.lora_waited))
        self.metrics.increment("wait_s", result.lora_wait_s)
        self.metrics.set_total("merge_s", self.merger.seconds())


class ControlNetCallMetrics:
    """Where a step's ControlNet time goes, as seen by this denoiser (updated from the sender
    thread only): calls made, their wall time by BLS, and how long the decoder half waited."""

    def __init__(self, args, engine):
        self.engine = engine
        self.metrics = Metrics({"model": args["model_name"]}, {
            "calls": ("easel_controlnet_calls_total", "ControlNet calls made by the denoiser", "counter"),
            "call_s": ("easel_controlnet_call_seconds_total", "wall time of those calls (BLS)", "counter"),
            "wait_s": ("easel_controlnet_wait_seconds_total",
                       "seconds the decoder half waited for ControlNet residuals", "counter"),
        })

    def update(self) -> None:
        self.metrics.set_total("calls", self.engine.control_calls)
        self.metrics.set_total("wait_s", self.engine.control_wait_s)
        self.metrics.set_total("call_s", getattr(self.engine.controlnets, "call_s", 0.0))


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        # The loop thread launches kernels from Python while BLS threads wait for the GIL to hand
        # ControlNet tensors over; the default 5 ms switch interval delays each hand-off by up to
        # that much (bench/bls_transport.py measures it).
        sys.setswitchinterval(0.001)
        self.name = args["model_name"]
        params = parameters(args)
        config = SchedulerConfig(max_running=int(params.get("max_running", 16)),
                                 max_batch_rows=int(params.get("max_batch_rows", 16)))
        self.pending: dict[str, tuple] = {}
        self.outbox: queue.Queue[DenoiseResult | None] = queue.Queue()
        self.sender = threading.Thread(target=self._send_loop, name="easel-denoise-sender", daemon=True)
        self.sender.start()
        where = placement(args)
        self.limits = Limits.from_json(params["limits"])
        engine = TorchDenoiser(artifact_folder(args), where, controlnet_mode=params.get("controlnet_mode", "sync"))
        store_folder = adapter_store_folder(args)
        self.store = AdapterStore(store_folder) if store_folder else None
        # LoRA files load in separate processes (diffusers' conversion never holds this process's
        # GIL; a loader that crashes fails its request only): backends/core/adapters/lora_loader.py.
        self.lora_loader = LoraLoaderPool(int(params.get("lora_loaders", 2)), device=where.device) \
            if self.store else None
        if self.lora_loader is not None and not self.lora_loader.wait_started(timeout=300):
            log.warning("LoRA loader processes did not start; LoRA requests will fail until they do")
        # Steps a request may run before its LoRAs must be merged: per LoRA from `easel
        # profile-lora`, else the deployment's (0: wait, exact).
        self.lora_bound = int(params.get("lora_bound_steps", 0))
        bounds = artifact_folder(args) / BOUNDS_FILE
        self.lora_bounds = json.loads(bounds.read_text()) if bounds.exists() else {}
        self.lora_loads: dict[str, tuple[int, float, int]] = {}  # request id -> (count, seconds, bytes)
        self.metrics = LoraMetrics(args, engine.lora_merger)
        if params.get("controlnet_model"):  # the ControlNet service, by BLS
            decl = controlnet_decl(num_skips(engine.unet), WIRE_DTYPES[where.dtype])
            engine.controlnets = BlsControlNets(params["controlnet_model"], decl, self.store)
        self.control_metrics = ControlNetCallMetrics(args, engine)
        self.loop = DenoiseLoop(engine, self.outbox.put, config)
        self.loop.start()

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                params = read_params(request)
                job = DenoiseJob(
                    request_id=uuid.uuid4().hex, params=params,
                    prompt_embeds=pb_utils.get_input_tensor_by_name(request, "prompt_embeds").as_numpy(),
                    pooled_embeds=pb_utils.get_input_tensor_by_name(request, "pooled_embeds").as_numpy(),
                    is_cancelled=sender.is_cancelled, controls=self._controls(request, params))
            except Exception as exc:
                sender.send(error(f"denoiser: {exc}"), flags=FINAL)
                continue
            self.pending[job.request_id] = (sender, params)
            if params.loras:  # file I/O runs in the loader processes, never on Triton's thread or the loop
                job.loras_pending = self._load_loras(job.request_id, params)
                job.lora_bound = min(self.lora_bounds.get(p.name, self.lora_bound) for p in params.loras)
            self.loop.submit(job)
        return None

    def _load_loras(self, request_id, params) -> Future:
        """A future of ((LoraWeights, scale), ...); errors travel in it, so they fail this request
        at a step boundary like a load error does. Never blocks: the store's index is in memory."""
        try:
            if self.store is None:
                raise InvalidInput("loras", "this deployment has no adapter store")
            files = [(p.name, self.store.lora(p.name).path, p.scale) for p in params.loras]
        except InvalidInput as exc:
            failed = Future()
            failed.set_exception(exc)
            return failed

        def loaded(stats):  # (count, seconds, bytes), set before the future resolves
            self.lora_loads[request_id] = stats

        return self.lora_loader.submit(files, on_loaded=loaded)

    def _controls(self, request, params):
        images = pb_utils.get_input_tensor_by_name(request, "control_images").as_numpy().reshape(-1)
        return [ControlInput(c.name, decode_control_image(images[i], self.limits.max_control_image_pixels, i),
                             c.scale, c.guidance_start, c.guidance_end)
                for i, c in enumerate(params.controls)]

    def _send_loop(self):
        while (result := self.outbox.get()) is not None:
            sender, params = self.pending.pop(result.request_id)
            self.metrics.record(self.lora_loads.pop(result.request_id, None), result)
            self.control_metrics.update()
            if result.error is not None:
                sender.send(error(f"denoiser: {result.error}"), flags=FINAL)
                continue
            params = params.with_trace(queue_s=result.queue_s, denoise_s=result.denoise_s,
                                       max_batch=result.max_batch, denoiser=self.name, lora_step=result.lora_step,
                                       lora_wait_s=result.lora_wait_s)
            sender.send(pb_utils.InferenceResponse([
                params_tensor(params), pb_utils.Tensor("latents", np.ascontiguousarray(result.latents))]),
                flags=FINAL)

    def finalize(self):
        if self.lora_loader is not None:
            self.lora_loader.shutdown()
        self.loop.shutdown()
        if self.loop.engine.controlnets is not None:
            self.loop.engine.controlnets.shutdown()
        self.outbox.put(None)
        self.sender.join(timeout=30)
