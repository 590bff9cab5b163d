"""The torch eager runtime: diffusers' own modules split at the mid block, run as they are.

The exact reference (what CPU tests and the diffusers oracle tests run), and the fallback of the
fast runtime for what it does not capture (batches that mix LoRAs, shapes without a bucket).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager, nullcontext

import torch

from backends.core.adapters.lora import ModelLayers, UnmergedLoras
from backends.core.runtime.base import (EncoderOut, Residuals, RuntimeCaps, RuntimeStats, StepBatch, check_batch,
                                        refit_in_place)
from backends.core.runtime.unet_split import UNetDecoder, UNetEncoder


class EagerUNetRuntime:
    caps = RuntimeCaps(name="eager", token_subsets=True)

    def __init__(self, unet, encoder: UNetEncoder, decoder: UNetDecoder, conv_subsets: bool = False):
        self.weights_module = unet
        self.weight_copies = (unet,)
        self.streams = ()
        self.side_devices = (next(unet.parameters()).device,)
        self.encoder = encoder
        self.decoder = decoder
        self.layers = ModelLayers(unet)
        self.stats = RuntimeStats()
        self.subsets = None  # the transformer blocks' SubsetContext, once a step first has token subsets
        # Reusing rows run the ResNet blocks on their masked box (RuntimeConfig.conv_subsets); read
        # at the first step with token subsets.
        self.conv_subsets = conv_subsets

    @torch.inference_mode()
    def encode(self, batch: StepBatch) -> EncoderOut:
        check_batch(self.caps, batch)
        self.stats.eager_steps += 1
        with self._loras(batch), self._tokens(batch):
            emb, mid, skips = self.encoder(batch.sample, batch.timestep, batch.text, batch.pooled, batch.time_ids)
        return EncoderOut(emb, mid, skips)

    @torch.inference_mode()
    def decode(self, batch: StepBatch, enc: EncoderOut, residuals: Residuals | None) -> torch.Tensor:
        down, mid = residuals if residuals is not None else (None, None)
        with self._loras(batch), self._tokens(batch):
            return self.decoder(enc.emb, enc.mid, enc.skips, batch.text, down, mid)

    def row_sides(self, rows_per_request) -> None:
        return None  # one place

    def refit(self, weights: Mapping[str, torch.Tensor]) -> None:
        refit_in_place(self.weights_module, weights)

    def weights_written(self) -> None:
        return None  # nothing derived from the weights

    @contextmanager
    def _tokens(self, batch: StepBatch):
        """The step's token subsets, seen by the transformer blocks while it runs."""
        if batch.tokens is None:
            yield
            return
        with self.token_layout(batch.tokens):
            yield

    @contextmanager
    def token_layout(self, layout):
        """The transformer blocks serve `layout` (a TokenLayout, or the static form CUDA graphs
        capture) while this is entered; they are made able to at the first call."""
        context = self.subset_context()
        context.layout = layout
        try:
            yield
        finally:
            context.layout = None

    def subset_context(self):
        """The transformer blocks' SubsetContext (runtime/token_subsets.py), installed at the first call."""
        if self.subsets is None:
            from backends.core.runtime.token_subsets import install

            self.subsets = install(self.weights_module, convs=self.conv_subsets)
        return self.subsets

    def _loras(self, batch: StepBatch):
        if not batch.lora_segments:
            return nullcontext()
        return UnmergedLoras(self.layers, [(s.rows, s.loras) for s in batch.lora_segments])
