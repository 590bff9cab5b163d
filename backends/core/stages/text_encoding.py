"""Prompt -> text embeddings, as StableDiffusionXLPipeline.encode_prompt computes them.

Both CLIP encoders read the prompt; the penultimate hidden states are concatenated and the
second encoder's projected output is the pooled embedding. Without a negative prompt and with
`force_zeros_for_empty_prompt` the unconditional rows are zeros; an explicit negative prompt
(even "") is encoded. Rows come out negative first, the order the UNet batch uses.

A request's LoRAs with text-encoder layers apply to both encoders for that request's encoding
only, unmerged (forward hooks, as diffusers runs an unfused LoRA): the weights are never written.

`graphs=True` (GPUs): each encoder runs as one CUDA graph (prompts are always padded to the
tokenizer's 77 tokens, so one shape each), captured on first use; a request with text-encoder
LoRAs runs eagerly, as its hooks are not in the graph. Same kernels as eager: the graph only
removes the launch cost of some 600 small kernels per prompt.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from backends.core.adapters.store import AdapterStore
from backends.core.adapters.lora import TEXT_ENCODERS, LoraSet, LoraWeights, ModelLayers, UnmergedLoras, load_lora
from backends.core.runtime.cuda_graphs import GraphSet
from backends.core.runtime.placement import Placement
from backends.core.request.params import GenerateParams, InvalidInput, LoraParams

OPTIONS_FILE = "text_options.json"


class TextEncoderLoras:
    """The text-encoder parts of LoRAs, read from the store (only those keys) and kept in a small
    LRU; an entry is read again when its file's mtime or size changes."""

    def __init__(self, store: AdapterStore | None, capacity: int = 16):
        self.store, self.capacity = store, capacity
        self._cache: dict[str, tuple[tuple[int, int, int], LoraWeights]] = {}  # insertion order = recency
        self.reads = 0

    def get(self, loras: Sequence[LoraParams]) -> LoraSet:
        """The request's LoRAs that have text-encoder layers, with their scales."""
        if not loras:
            return ()
        if self.store is None:
            raise InvalidInput("loras", "this deployment has no adapter store")
        entries = [self.store.lora(p.name) for p in loras]  # unknown names fail before any read
        out = []
        for p, entry in zip(loras, entries):
            stamp = entry.file.stamp()  # also refuses a file that left the store since the scan
            cached = self._cache.pop(p.name, None)
            if cached is not None and cached[0] == stamp:
                weights = cached[1]
            else:
                weights = load_lora(p.name, entry.file, text_encoders_only=True)
                self.reads += 1
            self._cache[p.name] = (stamp, weights)
            while len(self._cache) > self.capacity:
                self._cache.pop(next(iter(self._cache)))
            if weights.text_encoders:
                out.append((weights, p.scale))
        return tuple(out)


class PromptEncoder:
    def __init__(self, folder: str | Path, placement: Placement, store: AdapterStore | None = None,
                 graphs: bool = False):
        from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

        folder = Path(folder)
        self.device = torch.device(placement.device)
        dtype = placement.torch_dtype
        self.tokenizers = [CLIPTokenizer.from_pretrained(folder / "tokenizer"),
                           CLIPTokenizer.from_pretrained(folder / "tokenizer_2")]
        self.encoders = [
            CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=dtype, use_safetensors=True),
            CLIPTextModelWithProjection.from_pretrained(folder / "text_encoder_2", dtype=dtype,
                                                        use_safetensors=True),
        ]
        for enc in self.encoders:
            enc.to(self.device).eval()
        self.layers = [ModelLayers(enc) for enc in self.encoders]  # what a LoRA's text-encoder layers may change
        self.graphs = graphs and self.device.type == "cuda"
        self._graphs = GraphSet()  # per encoder and token shape
        options = json.loads((folder / OPTIONS_FILE).read_text())
        self.force_zeros_for_empty_prompt = bool(options["force_zeros_for_empty_prompt"])
        self.loras = TextEncoderLoras(store)
        if store is not None:  # LoRA files are read with diffusers' pipeline code: import it now, not on a request
            from diffusers import StableDiffusionXLPipeline  # noqa: F401

    def _encode(self, text: str, max_length: int | None = None, graphs: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], None
        for index, tokenizer in enumerate(self.tokenizers):
            ids = tokenizer(text, padding="max_length", max_length=max_length or tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            penultimate, first = (self._graphed if graphs else self._run)(index, ids.to(self.device))
            if pooled is None and first is not None:
                pooled = first
            hidden.append(penultimate)
        return torch.concat(hidden, dim=-1), pooled

    def _run(self, index: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The encoder's penultimate hidden states, and its pooled output if it has one (the second)."""
        out = self.encoders[index](ids, output_hidden_states=True)
        return out.hidden_states[-2], out[0] if out[0].ndim == 2 else None

    def _graphed(self, index: int, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        penultimate, pooled = self._graphs((index, tuple(ids.shape)), lambda i: self._run(index, i), ids)
        # Copies: the next replay (the negative prompt's) overwrites the static outputs.
        return penultimate.clone(), None if pooled is None else pooled.clone()

    @torch.inference_mode()
    def encode(self, params: GenerateParams) -> tuple[np.ndarray, np.ndarray]:
        loras = self.loras.get(params.loras)
        with ExitStack() as hooks:  # removed on the way out, whatever happens
            for component, layers in zip(TEXT_ENCODERS, self.layers):
                hooks.enter_context(UnmergedLoras(layers, [(slice(None), loras)], component))
            return self._encode_params(params, graphs=self.graphs and not loras)

    def _encode_params(self, params: GenerateParams, graphs: bool) -> tuple[np.ndarray, np.ndarray]:
        embeds, pooled = self._encode(params.prompt, graphs=graphs)
        if params.cfg:
            if params.negative_prompt is None and self.force_zeros_for_empty_prompt:
                neg, neg_pooled = torch.zeros_like(embeds), torch.zeros_like(pooled)
            else:
                neg, neg_pooled = self._encode(params.negative_prompt or "", max_length=embeds.shape[1],
                                               graphs=graphs)
            embeds, pooled = torch.cat([neg, embeds]), torch.cat([neg_pooled, pooled])
        return embeds.float().cpu().numpy(), pooled.float().cpu().numpy()
