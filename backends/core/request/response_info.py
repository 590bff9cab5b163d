"""The `info` output of a finished request: what it asked for, as it ran, and where its time went.

`received_at` (preprocess's time.time() when the request arrived) becomes `total_s`, the server's
own time for the request up to its image file; the other trace entries are the stages' seconds."""

from __future__ import annotations

import time

from backends.core.request.params import GenerateParams
from backends.core.request.output_format import DEFAULT_QUALITY


def response_info(params: GenerateParams) -> dict:
    trace = dict(params.trace)
    received = trace.pop("received_at", None)
    info = {"seed": params.seed, "steps": params.steps, "scheduler": params.scheduler,
            "width": params.width, "height": params.height, "guidance_scale": params.guidance_scale,
            "output_format": params.output_format,
            "quality": DEFAULT_QUALITY.get(params.output_format) if params.quality is None else params.quality,
            "queue_s": trace.pop("queue_s", None), "admit_s": trace.pop("admit_s", None),
            "max_batch": trace.pop("max_batch", None),
            "denoiser": trace.pop("denoiser", None), "lora_merged_at_step": trace.pop("lora_step", None),
            "lora_wait_s": trace.pop("lora_wait_s", None), "stages_s": trace}
    if params.strength is not None:
        info["strength"] = params.strength
    use = trace.pop("template_use", None)
    if params.template is not None:  # "exact" where the runtime could not use the template's recording
        info["template"], info["template_use"] = params.template, use or "exact"
    if received is not None:
        info["total_s"] = time.time() - received
    return info
