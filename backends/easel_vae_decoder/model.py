"""Triton adapter: final latents -> uint8 pixels (VAE decode)."""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import logging
import time

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.core.request.params import InvalidInput
from backends.core.runtime.placement import Placement
from backends.core.stages.vae_decoding import LatentDecoder
from backends.triton.adapter import (
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
