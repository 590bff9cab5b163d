"""The denoiser's Prometheus metrics on Triton's metrics port (backends/easel_denoiser/model.py
updates them): what became of its requests, LoRA loading and merging, ControlNet calls, and how
the UNet runtime spends its steps."""

from __future__ import annotations

import triton_python_backend_utils as pb_utils

from backends.triton_adapter import Metrics

OUTCOMES = ("finished", "cancelled", "invalid", "not_found", "refused", "failed")


class RequestMetrics:
    """What became of the denoiser's requests, by outcome, and the steps they ran: a cancelled
    request shows here with the steps it ran before it stopped (sender and execute threads)."""

    def __init__(self, args):
        labels = {"model": args["model_name"]}
        # One family, a metric per outcome (Metrics makes one per family); the family must outlive them.
        self.requests_family = pb_utils.MetricFamily(
            name="easel_requests_total", description="denoiser requests by outcome", kind=pb_utils.MetricFamily.COUNTER)
        self.requests = {o: self.requests_family.Metric(labels={**labels, "outcome": o}) for o in OUTCOMES}
        self.other = Metrics(labels, {
            "steps": ("easel_denoise_steps_total", "denoising steps run, summed over requests", "counter"),
            "pending": ("easel_denoiser_pending", "requests admitted and not answered yet", "gauge"),
        })

    def record(self, outcome: str, steps: int = 0) -> None:
        self.requests[outcome].increment(1)
        self.other.increment("steps", steps)


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


class RuntimeMetrics:
    """How the UNet runtime spends its steps: warm-up at load, graph replays, eager fallbacks."""

    def __init__(self, args, denoiser):
        self.runtime = denoiser.engine.runtime
        self.metrics = Metrics({"model": args["model_name"], "runtime": self.runtime.caps.name}, {
            "warmup_s": ("easel_runtime_warmup_seconds", "seconds spent capturing/compiling buckets at load", "gauge"),
            "graph": ("easel_runtime_graph_steps_total", "steps replayed from captured CUDA graphs", "counter"),
            "eager": ("easel_runtime_eager_steps_total", "steps run eager (no bucket, mixed LoRAs, eager runtime)",
                      "counter"),
            "captures": ("easel_runtime_captures_total", "CUDA graphs captured", "counter"),
        })
        self.metrics.set("warmup_s", denoiser.warmup_s)

    def update(self) -> None:
        stats = self.runtime.stats
        self.metrics.set_total("graph", stats.graph_steps)
        self.metrics.set_total("eager", stats.eager_steps)
        self.metrics.set_total("captures", stats.captures)
