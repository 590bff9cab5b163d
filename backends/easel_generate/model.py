"""Triton adapter: hands a request to a denoiser (decoupled, by BLS) and waits for its latents.

The public pipeline is unary; this step is where it meets the continuously batching denoiser.
It holds no tensors' maths (numpy only), so many light instances can wait at once.
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

import triton_python_backend_utils as pb_utils  # noqa: E402

from backends.core.request.contract import GENERATE  # noqa: E402
from backends.triton_adapter import (  # noqa: E402
    ForwardedError, each_request, limits, parameters, read_params, remaining_us, setup_logging)


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        self.limits = limits(args)
        names = [n.strip() for n in parameters(args)["denoisers"].split(",") if n.strip()]
        if not names:
            raise ValueError("parameter denoisers names no model")
        # Round robin over the denoisers (one per GPU), each instance starting at its own index
        # ("generate_0_<k>") so that concurrent requests, which land on different instances,
        # spread over the denoisers too; each denoiser batches what it receives.
        suffix = args["model_instance_name"].rsplit("_", 1)[-1]
        start = int(suffix) % len(names) if suffix.isdigit() else 0
        self.denoisers = itertools.cycle(names[start:] + names[:start])

    def execute(self, requests):
        return each_request(requests, self._generate, "generate")

    def _generate(self, request):
        params = read_params(request, self.limits)  # refuses what breaks the limits before a denoiser sees it
        inputs = [pb_utils.get_input_tensor_by_name(request, t.name) for t in GENERATE.inputs]
        bls = pb_utils.InferenceRequest(model_name=next(self.denoisers), inputs=inputs,
                                        requested_output_names=[t.name for t in GENERATE.outputs],
                                        timeout=remaining_us(request.timeout(), params, "generate"))
        final = None
        for response in bls.exec(decoupled=True):
            if response.has_error():
                raise ForwardedError(response.error())
            if response.output_tensors():
                final = response
        if final is None:
            raise RuntimeError("the denoiser finished without a result")
        outputs = {t.name(): t for t in final.output_tensors()}
        return [outputs[t.name] for t in GENERATE.outputs]

