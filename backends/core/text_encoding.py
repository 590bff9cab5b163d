"""Prompt -> text embeddings, as StableDiffusionXLPipeline.encode_prompt computes them.

Both CLIP encoders read the prompt; the penultimate hidden states are concatenated and the
second encoder's projected output is the pooled embedding. Without a negative prompt and with
`force_zeros_for_empty_prompt` the unconditional rows are zeros; an explicit negative prompt
(even "") is encoded. Rows come out negative first, the order the UNet batch uses.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .placement import Placement
from .params import GenerateParams

OPTIONS_FILE = "text_options.json"


class PromptEncoder:
    def __init__(self, folder: str | Path, placement: Placement):
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
        options = json.loads((folder / OPTIONS_FILE).read_text())
        self.force_zeros_for_empty_prompt = bool(options["force_zeros_for_empty_prompt"])

    def _encode(self, text: str, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, pooled = [], None
        for tokenizer, encoder in zip(self.tokenizers, self.encoders):
            ids = tokenizer(text, padding="max_length", max_length=max_length or tokenizer.model_max_length,
                            truncation=True, return_tensors="pt").input_ids
            out = encoder(ids.to(self.device), output_hidden_states=True)
            if pooled is None and out[0].ndim == 2:
                pooled = out[0]
            hidden.append(out.hidden_states[-2])
        return torch.concat(hidden, dim=-1), pooled

    @torch.inference_mode()
    def encode(self, params: GenerateParams) -> tuple[np.ndarray, np.ndarray]:
        embeds, pooled = self._encode(params.prompt)
        if params.cfg:
            if params.negative_prompt is None and self.force_zeros_for_empty_prompt:
                neg, neg_pooled = torch.zeros_like(embeds), torch.zeros_like(pooled)
            else:
                neg, neg_pooled = self._encode(params.negative_prompt or "", max_length=embeds.shape[1])
            embeds, pooled = torch.cat([neg, embeds]), torch.cat([neg_pooled, pooled])
        return embeds.float().cpu().numpy(), pooled.float().cpu().numpy()
