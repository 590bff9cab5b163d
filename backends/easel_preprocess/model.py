"""Triton adapter: validates a public request into GenerateParams (CPU, no torch)."""

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

import time  # noqa: E402

from backends.core.contract import PREPROCESS  # noqa: E402
from backends.core.params import Limits, validate  # noqa: E402
from backends.triton_adapter import each_request, parameters, params_tensor, read_inputs, scalar, setup_logging  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        setup_logging()
        self.limits = Limits.from_json(parameters(args)["limits"])

    def execute(self, requests):
        return each_request(requests, self._validate, "preprocess")

    def _validate(self, request):
        raw = {name: scalar(value) for name, value in read_inputs(request, PREPROCESS).items()}
        return [params_tensor(validate(raw, self.limits).with_trace(received_at=time.time()))]
