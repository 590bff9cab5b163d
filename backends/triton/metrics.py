"""The denoiser's Prometheus metrics on Triton's metrics port (backends/easel_denoiser/model.py
updates them): what became of its requests, its queue and steps, LoRA loading and merging,
ControlNet calls, and how the UNet runtime spends its steps."""

from __future__ import annotations

import logging
import threading
import time

import triton_python_backend_utils as pb_utils

from backends.core.engine.step_stats import LoopStats
from backends.triton.adapter import Metrics

log = logging.getLogger("backends.easel_denoiser")

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
            "call": ("easel_controlnet_call_seconds_total", "wall time of those calls (BLS)", "counter"),
            "ready": ("easel_controlnet_call_ready_seconds_total",
                      "of the calls' wall time, waiting for the step's inputs on the GPU", "counter"),
            "exec": ("easel_controlnet_call_exec_seconds_total",
                     "of the calls' wall time, the BLS request: the service's compute, Triton's hand-offs "
                     "and the residuals' transfer", "counter"),
            "outputs": ("easel_controlnet_call_outputs_seconds_total",
                        "of the calls' wall time, taking the residuals onto the denoiser's device", "counter"),
            "wait_s": ("easel_controlnet_wait_seconds_total",
                       "seconds the decoder half waited for ControlNet residuals", "counter"),
        })

    def update(self) -> None:
        self.metrics.set_total("calls", self.engine.controls.calls)
        self.metrics.set_total("wait_s", self.engine.controls.wait_s)
        parts = getattr(self.engine.controls.provider, "seconds", {})
        self.metrics.set_total("call", sum(parts.values()))
        for part, seconds in parts.items():
            self.metrics.set_total(part, seconds)


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
            "released": ("easel_runtime_released_buckets_total",
                         "template edits' reusing buckets whose graphs were let go for want of room", "counter"),
        })
        self.metrics.set("warmup_s", denoiser.warmup_s)

    def update(self) -> None:
        stats = self.runtime.stats
        self.metrics.set_total("graph", stats.graph_steps)
        self.metrics.set_total("eager", stats.eager_steps)
        self.metrics.set_total("captures", stats.captures)
        self.metrics.set_total("released", stats.released)


class TemplateMetrics:
    """Templates' recordings (backends/core/engine/template_cache.py) by tier, and the share of
    their edits' block tokens computed (runtime/token_subsets.py)."""

    TIERED = {  # key -> (name, description, kind), one metric per tier
        "hits": ("easel_template_hits_total", "template edits that found their recording, by tier", "counter"),
        "loaded_bytes": ("easel_template_loaded_bytes_total", "bytes of recordings brought to the device",
                         "counter"),
        "evictions": ("easel_template_evictions_total", "recordings that left a tier for want of room", "counter"),
        "bytes": ("easel_template_bytes", "bytes of recordings in a tier", "gauge"),
    }

    def __init__(self, args, denoiser):
        from backends.core.engine.template_cache import TIERS

        self.engine = denoiser.engine
        labels = {"model": args["model_name"]}
        kinds = {"counter": pb_utils.MetricFamily.COUNTER, "gauge": pb_utils.MetricFamily.GAUGE}
        # One family per name, a metric per tier (the families must outlive their metrics).
        self.families = {key: pb_utils.MetricFamily(name=name, description=desc, kind=kinds[kind])
                         for key, (name, desc, kind) in self.TIERED.items()}
        self.tiered = {(key, tier): family.Metric(labels={**labels, "tier": tier})
                       for key, family in self.families.items() for tier in TIERS
                       if key != "loaded_bytes" or tier != "device"}
        self.totals: dict[tuple, float] = {}
        self.metrics = Metrics(labels, {
            "misses": ("easel_template_misses_total", "template edits that recorded (no recording to reuse)",
                       "counter"),
            "load_s": ("easel_template_load_seconds_total", "seconds the cache's loader thread spent bringing "
                                                             "recordings to the device (off the step loop)", "counter"),
            "wait_s": ("easel_template_wait_seconds_total", "seconds edits were held before their first step "
                                                             "waiting for their recording's load", "counter"),
            "stall_s": ("easel_template_stall_seconds_total", "GPU seconds the step loop's stream waited for "
                                                               "streamed recordings' copies", "counter"),
            "computed": ("easel_template_computed_tokens_total",
                         "block tokens computed by edits that reused a recording", "counter"),
            "tokens": ("easel_template_tokens_total", "block tokens those edits would have computed whole",
                       "counter"),
        })

    def update(self) -> None:
        cache = self.engine.templates
        stats = cache.stats
        for (key, tier), metric in self.tiered.items():
            if key == "bytes":
                metric.set(cache.nbytes(tier))
                continue
            total = getattr(stats, key)[tier]
            metric.increment(total - self.totals.get((key, tier), 0))
            self.totals[(key, tier)] = total
        self.metrics.set_total("misses", stats.misses)
        self.metrics.set_total("load_s", stats.load_seconds)
        self.metrics.set_total("wait_s", stats.wait_seconds)
        self.metrics.set_total("stall_s", cache.read_stalls())
        subsets = getattr(self.engine.runtime, "subsets", None)
        if subsets is not None:
            self.metrics.set_total("computed", subsets.computed_tokens)
            self.metrics.set_total("tokens", subsets.all_tokens)


# Histogram buckets (upper bounds; Prometheus adds +Inf). Step parts range from a sampler update's
# fraction of a millisecond to a UNet half's seconds on a busy CPU.
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
ROW_BUCKETS = (1, 2, 4, 6, 8, 12, 16, 24, 32, 48, 64)  # a request with guidance takes 2 rows
FIRST_STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PARTS = ("encoder", "decoder", "sampler", "orchestration")


class StepMetrics:
    """The loop's queue and steps (backends/core/engine/step_stats.py) as Prometheus gauges and
    histograms (Triton 2.51's Python backend has `MetricFamily.HISTOGRAM`: `_bucket`, `_sum`,
    `_count` series), updated by a thread of its own every PERIOD_S: each metric update is a
    round trip to the Triton process (about 30 us on the test host, 5 to 6 per step), kept off the
    loop and off the sender's responses.

    easel_denoiser_queue_depth: admitted requests waiting to join the running batch.
    easel_denoiser_running: requests in the running batch.
    easel_denoiser_step_rows: UNet rows in each step's batch.
    easel_denoiser_step_seconds{part}: each step's wall time in four parts (encoder half, decoder
      half, sampler, orchestration: the rest); GPU time from CUDA events on a GPU.
    easel_denoiser_time_to_first_step_seconds: from the denoiser's admission of a request to the
      end of its first step."""

    PERIOD_S = 0.5

    def __init__(self, args, stats: LoopStats):
        self.stats = stats
        labels = {"model": args["model_name"]}
        self.gauges = Metrics(labels, {
            "queued": ("easel_denoiser_queue_depth", "admitted requests waiting to join the running batch", "gauge"),
            "running": ("easel_denoiser_running", "requests in the running batch", "gauge"),
        })
        # The families must outlive their metrics (Triton drops a metric whose family is gone).
        self.families = [pb_utils.MetricFamily(name=name, description=desc, kind=pb_utils.MetricFamily.HISTOGRAM)
                         for name, desc in (
                             ("easel_denoiser_step_rows", "UNet rows in a step's batch"),
                             ("easel_denoiser_step_seconds",
                              "a step's wall time by part: encoder half, decoder half, sampler, orchestration "
                              "(GPU time on a GPU)"),
                             ("easel_denoiser_time_to_first_step_seconds",
                              "from the denoiser's admission of a request to the end of its first step"))]
        rows, seconds, first = self.families
        self.rows = rows.Metric(labels=labels, buckets=list(map(float, ROW_BUCKETS)))
        self.seconds = [seconds.Metric(labels={**labels, "part": part}, buckets=list(STEP_BUCKETS)) for part in PARTS]
        self.first_step = first.Metric(labels=labels, buckets=list(FIRST_STEP_BUCKETS))
        self._dropped = 0
        self._gauges = (0, 0)  # (queued, running) as last set
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="easel-denoise-metrics", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                self.flush()
            except Exception:  # metrics never take the denoiser down
                log.exception("denoiser step metrics: update failed")

    def flush(self) -> None:
        start = time.perf_counter()
        records = self.stats.take()
        for r in records:
            self.rows.observe(r.rows)
            for metric, value in zip(self.seconds, (r.encoder_s, r.decoder_s, r.sampler_s, r.orchestration_s)):
                metric.observe(value)
            for value in r.first_step_s:
                self.first_step.observe(value)
        # Only what changed, so an idle denoiser makes no calls: with a call every period, one was
        # in flight when tritonserver was killed and its stub did not exit (test_lifecycle.py).
        gauges = (self.stats.queued, self.stats.running)
        for key, value, last in zip(("queued", "running"), gauges, self._gauges):
            if value != last:
                self.gauges.set(key, value)
        self._gauges = gauges
        if self.stats.dropped != self._dropped:
            log.warning("denoiser step metrics: %d step records dropped (this thread fell behind)",
                        self.stats.dropped - self._dropped)
            self._dropped = self.stats.dropped
        if records:
            log.debug("denoiser step metrics: %d steps in %.2f ms", len(records), (time.perf_counter() - start) * 1e3)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.flush()
