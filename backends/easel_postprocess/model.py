"""Triton adapter: pixels -> PNG/JPEG/WebP bytes, and the request's `info` JSON (CPU, no torch)."""

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
import time  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from backends.core.request.params import InvalidInput  # noqa: E402
from backends.core.stages.image_encoding import DEFAULT_QUALITY, FORMATS, encode_image  # noqa: E402
from backends.triton_adapter import each_request, limits, read_params, setup_logging  # noqa: E402


def info_of(params) -> dict:
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
    if received is not None:
        info["total_s"] = time.time() - received
    return info


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        self.limits = limits(args)
        # Each format's first encode in a process is slow (PNG's thread pool, PIL's plugins): do it
        # here, not on an instance's first request.
        for fmt in FORMATS:
            encode_image(np.zeros((512, 512, 3), np.uint8), fmt)

    def execute(self, requests):
        return each_request(requests, self._encode, "postprocess")

    def _encode(self, request):
        params = read_params(request, self.limits)
        pixels = pb_utils.get_input_tensor_by_name(request, "pixels").as_numpy()
        if pixels.shape != (params.height, params.width, 3):  # the size was checked in params only
            raise InvalidInput("pixels", f"has shape {pixels.shape}, expected {(params.height, params.width, 3)}")
        start = time.perf_counter()
        image = encode_image(pixels, params.output_format, params.quality)
        params = params.with_trace(postprocess_s=time.perf_counter() - start)
        info = json.dumps(info_of(params)).encode()
        return [pb_utils.Tensor("image", np.array([image], dtype=np.object_)),
                pb_utils.Tensor("info", np.array([info], dtype=np.object_))]
