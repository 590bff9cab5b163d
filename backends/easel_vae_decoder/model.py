"""Triton adapter: final latents -> uint8 pixels (VAE decode)."""

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

import logging  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

from backends.core.request.params import InvalidInput  # noqa: E402
from backends.core.runtime.placement import Placement  # noqa: E402
from backends.core.stages.vae_decoding import LatentDecoder  # noqa: E402
from backends.triton_adapter import (  # noqa: E402
    limits,
    artifact_folder, each_request, parameters, params_tensor, placement, read_params, setup_stub)


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        self.limits = limits(args)
        params = parameters(args)
        flags = {k: params.get(k, "false") == "true" for k in ("graphs", "fused_kernels")}
        attention = Placement(dtype=params.get("attention_dtype", "fp32")).torch_dtype
        dtype = Placement(dtype=params["vae_dtype"]).torch_dtype if "vae_dtype" in params else None
        where = placement(args)
        where.make_current()
        self.decoder = LatentDecoder(artifact_folder(args), where, dtype=dtype, attention_dtype=attention,
                                     **flags)
        # The default size's graph is captured now (cuDNN's algorithm search included: about 2 s at
        # 1024 px on an H200), not on the first request of that size.
        start = time.perf_counter()
        shape = self.decoder.latent_shape(self.limits.default_height, self.limits.default_width)
        self.decoder.decode(np.zeros(shape, np.float32))
        logging.getLogger("backends.vae_decoder").info("warmed up %s in %.2f s", shape, time.perf_counter() - start)

    def execute(self, requests):
        return each_request(requests, self._decode, "vae_decoder")

    def _decode(self, request):
        params = read_params(request, self.limits)
        latents = pb_utils.get_input_tensor_by_name(request, "latents").as_numpy()
        # The size was checked in params; latents of another size would decode another image.
        expected = self.decoder.latent_shape(params.height, params.width)
        if latents.shape != expected:
            raise InvalidInput("latents", f"has shape {latents.shape}, expected {expected} for these params")
        start = time.perf_counter()
        pixels = self.decoder.decode(latents)
        params = params.with_trace(vae_decoder_s=time.perf_counter() - start)
        return [params_tensor(params), pb_utils.Tensor("pixels", pixels)]
