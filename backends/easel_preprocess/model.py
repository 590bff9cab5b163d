"""Triton adapter: validates a public request into GenerateParams (CPU, no torch)."""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import logging
import os
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.core.request.contract import DRAIN_FLAG_ENV, PREPROCESS
from backends.core.request.adapter_inputs import validate_request
from backends.core.request.params import Limits
from backends.triton.adapter import (each_request, error, mark, parameters, params_tensor, read_inputs,
                                     scalar, setup_stub, wants_marks)

log = logging.getLogger("backends.preprocess")

# `easel serve` names a file in DRAIN_FLAG_ENV (clients/serve.py, TritonServer.drain) and creates it when it
# starts draining: from then on every request is refused at the pipeline's first step, with
# UNAVAILABLE (gRPC) / 503 (HTTP), so clients and load balancers retry elsewhere, while the
# requests already past this step finish.
DRAINING = "the server is draining (shutting down); retry on another replica"


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        self.limits = Limits.from_json(parameters(args)["limits"])
        self.drain_flag = os.environ.get(DRAIN_FLAG_ENV) or None
        self.draining = False

    def execute(self, requests):
        if self.drain_flag is not None and os.path.exists(self.drain_flag):  # a stat: microseconds
            if not self.draining:  # one line per drain, not one per refused request
                log.warning("draining: refusing new requests with UNAVAILABLE")
                self.draining = True
            code = pb_utils.TritonError.UNAVAILABLE
            return [error(mark(DRAINING, code) if wants_marks(r) else DRAINING, code=code) for r in requests]
        return each_request(requests, self._validate, "preprocess")

    def _validate(self, request):
        raw = {name: _value(value, PREPROCESS.input(name).dims)
               for name, value in read_inputs(request, PREPROCESS).items()}
        params = validate_request(raw, self.limits).with_trace(received_at=time.time())
        images = np.array(raw["control_images"] or [], dtype=np.object_)
        return [params_tensor(params), pb_utils.Tensor("control_images", images)]


def _value(array, dims):
    """A [1] input as its one element, a [-1] input as a list; None when absent."""
    if dims == (1,):
        return scalar(array)
    return None if array is None else array.reshape(-1).tolist()
