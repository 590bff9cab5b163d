"""Triton adapter: prompt -> SDXL text embeddings (both CLIP encoders)."""

import easel_bootstrap  # noqa: F401  (first: backends/triton/bootstrap.py, copied beside this file)

import logging
import time

import triton_python_backend_utils as pb_utils

from backends.core.adapters.store import AdapterStore
from backends.core.request.params import validate
from backends.core.stages.text_encoding import PromptEncoder
from backends.triton.adapter import (
    limits,
    adapter_store_folder, artifact_folder, each_request, parameters, params_tensor, placement, read_params,
    setup_stub)


class TritonPythonModel:
    def initialize(self, args):
        setup_stub()
        self.limits = limits(args)
        store_folder = adapter_store_folder(args)  # LoRAs' text-encoder layers apply here
        where = placement(args)
        where.make_current()
        self.encoder = PromptEncoder(artifact_folder(args), where,
                                     AdapterStore(store_folder) if store_folder else None,
                                     graphs=parameters(args).get("graphs", "false") == "true")
        # Graphs are captured now, not on the first request.
        start = time.perf_counter()
        self.encoder.encode(validate({"prompt": "warm-up"}, self.limits))
        logging.getLogger("backends.text_encoder").info("warmed up in %.2f s", time.perf_counter() - start)

    def execute(self, requests):
        return each_request(requests, self._encode, "text_encoder")

    def _encode(self, request):
        params = read_params(request, self.limits)
        start = time.perf_counter()
        embeds, pooled = self.encoder.encode(params)
        params = params.with_trace(text_encoder_s=time.perf_counter() - start)
        return [params_tensor(params), pb_utils.Tensor("prompt_embeds", embeds), pb_utils.Tensor("pooled_embeds", pooled)]
