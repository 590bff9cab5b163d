"""Triton adapter: an edit's template and mask -> the VAE encoder's latent distributions and the
mask at latent size (backends/core/stages/vae_encoding.py), off the denoiser's step loop."""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import time

import numpy as np
import triton_python_backend_utils as pb_utils

from backends.core.request.edit_inputs import decode_edit_images
from backends.core.request.params import InvalidInput
from backends.core.stages.vae_encoding import EditEncoder
from backends.triton.adapter import (artifact_folder, each_request, limits, parameters, params_tensor, placement,
                                     read_params, scalar, setup_stub)


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        self.limits = limits(args)
        where = placement(args)
        where.make_current()
        self.encoder = EditEncoder(artifact_folder(args), where,
                                   masked_image=parameters(args).get("masked_image", "true") == "true")

    def execute(self, requests):
        return each_request(requests, self._encode, "vae_encoder")

    def _encode(self, request):
        params = read_params(request, self.limits)
        if params.strength is None:
            raise InvalidInput("strength", "is not set: these params are not an edit's")
        files = [scalar(pb_utils.get_input_tensor_by_name(request, name).as_numpy()) for name in ("image", "mask_image")]
        # Decoded and checked again: Triton cannot hide this model from clients.
        edit = decode_edit_images(*files, self.limits)
        edit.check(params.width, params.height)
        start = time.perf_counter()
        arrays = self.encoder.encode(edit.image, edit.mask)
        params = params.with_trace(vae_encoder_s=time.perf_counter() - start)
        return [params_tensor(params), *(pb_utils.Tensor(name, array) for name, array in arrays.items()),
                pb_utils.Tensor("scaling_factor", np.array([self.encoder.scaling_factor], np.float32))]
