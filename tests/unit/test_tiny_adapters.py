"""`easel tiny` also writes an adapter store whose ControlNets diffusers loads and that matter."""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline, StableDiffusionXLPipeline

from backends.core.adapters.store import AdapterStore
from export.tiny_adapters import TINY_CONTROLNETS, TINY_LORAS, write_tiny_adapter_store


def test_store_indexes_tiny_controlnets_that_change_the_image(tiny_model, tmp_path):
    store = AdapterStore(write_tiny_adapter_store(tiny_model, tmp_path / "adapters"))
    assert sorted(store.controlnets) == sorted(TINY_CONTROLNETS)

    base = StableDiffusionXLPipeline.from_pretrained(tiny_model, add_watermarker=False)
    controlnet = ControlNetModel.from_pretrained(store.controlnet("canny").folder, use_safetensors=True)
    pipe = StableDiffusionXLControlNetPipeline(**base.components, controlnet=controlnet)
    hint = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    from PIL import Image

    kwargs = dict(prompt="a cat", width=64, height=64, num_inference_steps=2, output_type="np")
    with_cn = pipe(image=Image.fromarray(hint), generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    without = base(generator=torch.Generator().manual_seed(0), **kwargs).images[0]
    assert np.abs(with_cn - without).max() > 1e-3  # the residuals are not zero


def test_store_is_deterministic(tiny_model, tmp_path):
    def digest(root):
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.safetensors"))}

    a = write_tiny_adapter_store(tiny_model, tmp_path / "a")
    b = write_tiny_adapter_store(tiny_model, tmp_path / "b")
    assert digest(a) == digest(b) and len(digest(a)) == len(TINY_CONTROLNETS) + len(TINY_LORAS)
