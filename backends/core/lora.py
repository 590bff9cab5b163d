"""LoRA weights read with diffusers' own converters, merged into a model in place, restored exactly.

Both common layouts (diffusers/PEFT `lora_A`/`lora_B`, kohya `lora_down`/`lora_up` + `alpha`)
go through `StableDiffusionXLPipeline.lora_state_dict` and diffusers' PEFT key conversion, so
a file loads here exactly when it loads in diffusers. Merge: W = W0 + sum_i s_i * (alpha_i/r_i) *
B_i @ A_i, computed in fp32 from the saved original W0 (merging again never accumulates
rounding, and LoRAs never multiply each other). Restore copies W0 back: bit for bit, no
`W -= ...` drift. Writes are in place (`copy_`), so captured CUDA graphs keep seeing the weights.

Text-encoder layers are refused with a clear error for now (issue 4 applies them before the
prompt is encoded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .params import InvalidInput

BOUNDS_FILE = "lora_bounds.json"  # per-LoRA bound K, written by `easel profile-lora` beside the UNet


@dataclass(frozen=True)
class LoraLayer:
    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # B: [out, rank]
    scale: float  # alpha / rank (1.0 when the file names no alpha, as diffusers does)

    def delta(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return self.scale * (self.up.to(device, torch.float32) @ self.down.to(device, torch.float32))


@dataclass(frozen=True)
class LoraWeights:
    name: str
    unet: dict[str, LoraLayer]
    nbytes: int


def load_lora(name: str, path: str | Path) -> LoraWeights:
    """A LoRA file (safetensors; the store never indexes anything else) as per-module layers."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_unet_state_dict_to_peft

    try:
        state, alphas = StableDiffusionXLPipeline.lora_state_dict(str(path))
    except Exception as exc:  # truncated or foreign files: diffusers says what is wrong
        raise InvalidInput("loras", f"{name!r} cannot be read as a LoRA ({exc.__class__.__name__}: {exc})") from None
    other = sorted({k.split(".", 1)[0] for k in state if not k.startswith("unet.")})
    if other:
        raise InvalidInput("loras", f"{name!r} has layers for {other}; only UNet layers are supported yet")
    peft = convert_unet_state_dict_to_peft({k[len("unet."):]: v for k, v in state.items()})
    module_alpha = {}
    for key, alpha in (alphas or {}).items():  # kohya: "<module path>.down.weight.alpha" in diffusers' old naming
        converted = convert_unet_state_dict_to_peft({key[len("unet."):-len(".alpha")]: torch.empty(0)})
        (peft_key,) = converted
        module_alpha[peft_key.rsplit(".lora_", 1)[0]] = float(alpha)

    layers = {}
    for key, down in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        up = peft.get(f"{module}.lora_B.weight")
        if up is None or down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0]:
            raise InvalidInput("loras", f"{name!r}: layer {module} is not a pair of rank-{down.shape[0]} matrices")
        rank = down.shape[0]
        layers[module] = LoraLayer(down, up, module_alpha.get(module, rank) / rank)
    if not layers:
        raise InvalidInput("loras", f"{name!r} holds no LoRA layers")
    nbytes = sum(t.numel() * t.element_size() for t in peft.values())
    return LoraWeights(name, layers, nbytes)


@dataclass
class LoraMerger:
    """Merges LoRAs into one model's Linear weights in place and puts the originals back."""

    model: torch.nn.Module
    _saved: dict[str, torch.Tensor] = field(default_factory=dict)

    @torch.no_grad()
    def merge(self, loras: list[tuple[LoraWeights, float]]) -> None:
        """Set the weights to base + the given LoRAs at the given scales (replacing any earlier merge)."""
        deltas: dict[str, torch.Tensor] = {}
        for lora, scale in loras:
            for module, layer in lora.unet.items():
                weight = self._weight(lora.name, module)
                delta = scale * layer.delta(weight.device)
                if delta.shape != weight.shape:
                    raise InvalidInput("loras", f"{lora.name!r}: layer {module} is {tuple(delta.shape)}, "
                                                f"the base model's is {tuple(weight.shape)}")
                deltas[module] = deltas[module] + delta if module in deltas else delta
        # Checked everything above: now change the weights (all or nothing).
        self.restore(keep=set(deltas))
        for module, delta in deltas.items():
            weight = self._weight("", module)
            if module not in self._saved:
                self._saved[module] = weight.detach().clone()
            original = self._saved[module]
            weight.copy_((original.float() + delta).to(weight.dtype))

    @torch.no_grad()
    def restore(self, keep: set[str] = frozenset()) -> None:
        """Put back the original weights (except those in `keep`, about to be overwritten)."""
        for module in list(self._saved):
            if module not in keep:
                self._weight("", module).copy_(self._saved.pop(module))

    def _weight(self, lora_name: str, module: str) -> torch.Tensor:
        try:
            return self.model.get_submodule(module).weight
        except AttributeError:
            raise InvalidInput("loras", f"{lora_name!r}: layer {module} does not exist in the base model") from None


LoraSet = tuple[tuple[LoraWeights, float], ...]  # the LoRAs of one request, with their scales


def lora_key(loras: LoraSet) -> tuple[tuple[str, float], ...]:
    return tuple((lora.name, scale) for lora, scale in loras)


class UnmergedLoras:
    """For a batch whose requests carry different LoRA sets: each touched Linear adds
    scale * (x @ A^T) @ B^T on the rows of the requests that use that LoRA, the weights untouched.
    Used as a context manager around the batch's forward pass."""

    def __init__(self, model: torch.nn.Module, segments: list[tuple[slice, LoraSet]]):
        self.model = model
        self.parts: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor, float]]] = {}
        for rows, loras in segments:
            for lora, scale in loras:
                for module, layer in lora.unet.items():
                    weight = model.get_submodule(module).weight
                    self.parts.setdefault(module, []).append(
                        (rows, layer.down.to(weight.device, weight.dtype), layer.up.to(weight.device, weight.dtype),
                         scale * layer.scale))
        self._handles = []

    def __enter__(self):
        for module, parts in self.parts.items():
            self._handles.append(self.model.get_submodule(module).register_forward_hook(_low_rank_hook(parts)))
        return self

    def __exit__(self, *exc):
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _low_rank_hook(parts):
    def hook(module, args, output):
        x = args[0]
        for rows, down, up, scale in parts:
            output[rows] += scale * ((x[rows] @ down.T) @ up.T)
        return output
    return hook
