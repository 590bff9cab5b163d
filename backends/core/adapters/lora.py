"""LoRA weights read with diffusers' own converters, merged into a model in place, restored exactly.

Both common layouts (diffusers/PEFT `lora_A`/`lora_B`, kohya `lora_down`/`lora_up` + `alpha`)
go through `StableDiffusionXLPipeline.lora_state_dict` and diffusers' PEFT key conversion, so
a file loads here exactly when it loads in diffusers. Merge: W = W0 + sum_i s_i * (alpha_i/r_i) *
B_i @ A_i, computed in fp32 from the saved original W0 (merging again never accumulates
rounding, and LoRAs never multiply each other). Restore copies W0 back: bit for bit, no
`W -= ...` drift. Writes go into the weights' own memory, so captured CUDA graphs keep seeing them.
Text-encoder layers are applied by the text encoder (backends/core/stages/text_encoding.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from backends.core.adapters.shm_tensors import DTYPES
from backends.core.request.params import InvalidInput, no_paths, shorten

BOUNDS_FILE = "lora_bounds.json"  # per-LoRA bound K, written by `easel profile-lora` beside the UNet
if TYPE_CHECKING:
    from backends.core.adapters.store import StoreFile

DELTA_BYTES = 256 << 20  # fp32 deltas a merge holds at once (a bigger layer still goes alone)


@dataclass(frozen=True)
class LoraLayer:
    down: torch.Tensor  # A: [rank, in]
    up: torch.Tensor  # B: [out, rank]
    scale: float  # alpha / rank (1.0 when the file names no alpha, as diffusers does)


@dataclass(frozen=True)
class LoraWeights:
    name: str
    unet: dict[str, LoraLayer]
    nbytes: int
    # "text_encoder" / "text_encoder_2" -> layers by module path in that encoder (as diffusers names them)
    text_encoders: dict[str, dict[str, LoraLayer]] = field(default_factory=dict)

    def layers(self, component: str = "unet") -> dict[str, LoraLayer]:
        return self.unet if component == "unet" else self.text_encoders.get(component, {})


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")
# Keys of a file's text-encoder part: diffusers/PEFT prefixes and kohya's (te = te1 = the first encoder).
TEXT_ENCODER_PREFIXES = ("text_encoder.", "text_encoder_2.", "lora_te_", "lora_te1_", "lora_te2_")
# The Linear layers diffusers reads a text-encoder LoRA's ranks from (lora_base._load_lora_into_text_encoder).
_TEXT_RANK_MODULES = (".q_proj", ".k_proj", ".v_proj", ".out_proj", ".fc1", ".fc2")


def load_lora(name: str, path: str | Path | StoreFile, text_encoders_only: bool = False) -> LoraWeights:
    """A LoRA file (safetensors; the store never indexes anything else) as per-module layers.
    `path`: a StoreFile of the adapter store (what the server reads: opened without following
    symlinks), or a plain path (tests, references). `text_encoders_only` reads just the
    text-encoder keys (a file without them gives no layers)."""
    from safetensors import safe_open

    try:
        with _opened(path) as file:
            # The tensors are read here, from the file opened above, and handed to diffusers as a
            # dict (never a path it would resolve again). text_encoders_only: only the few MiB of
            # text-encoder tensors come off the disk, not the UNet's hundreds.
            with safe_open(file, framework="pt") as f:
                keys = [k for k in f.keys() if not text_encoders_only or k.startswith(TEXT_ENCODER_PREFIXES)]
                source = {k: f.get_tensor(k) for k in keys}
    except InvalidInput:
        raise
    except Exception as exc:
        raise _unreadable(name, exc) from None
    if not source and text_encoders_only:
        return LoraWeights(name, {}, 0)
    return _convert(name, source, text_encoders_only)


# A file's tensors up to this many elements (kohya's alphas are scalars) are read even for a plan.
PLAN_READS_ELEMENTS = 64


@dataclass(frozen=True)
class LoraPlan:
    """A LoRA whose conversion only renames the file's tensors: each layer's down and up named by
    the file key that holds it, so that the file can be read straight onto the GPU."""
    name: str
    nbytes: int
    scales: dict[str, dict[str, float]]  # component ("unet", text encoders) -> module -> alpha / rank
    sources: dict[str, str]  # "<component>/<module>/down|up" -> the file's key
    shapes: dict[str, tuple[tuple[int, ...], str]]  # the file's key -> (shape, safetensors dtype)
    file_bytes: int  # the file's size when it was planned


def plan_lora(name: str, path: str | Path | StoreFile) -> LoraPlan | None:
    """The conversion of `load_lora` run on the file's header alone (its large tensors as meta
    tensors, shapes without data), or None where it does more than rename them (a cast, a
    concatenation) or fails: `load_lora` then reads the file and says what is wrong."""
    from safetensors import safe_open

    try:
        with _opened(path) as file, safe_open(file, framework="pt") as f:
            file_bytes = os.stat(file).st_size
            source, shapes = {}, {}
            for key in f.keys():
                piece = f.get_slice(key)
                shape, dtype = tuple(piece.get_shape()), piece.get_dtype()
                shapes[key] = (shape, dtype)
                source[key] = (f.get_tensor(key) if math.prod(shape) <= PLAN_READS_ELEMENTS
                               else torch.empty(shape, dtype=DTYPES[dtype], device="meta"))
        keys = {id(tensor): key for key, tensor in source.items()}
        lora = _convert(name, source)  # (diffusers' converters empty the dict they are given)
    except Exception:
        return None
    sources, scales = {}, {}
    for component, layers in (("unet", lora.unet), *lora.text_encoders.items()):
        scales[component] = {module: layer.scale for module, layer in layers.items()}
        for module, layer in layers.items():
            for which, tensor in (("down", layer.down), ("up", layer.up)):
                if id(tensor) not in keys:  # made by the conversion, not one of the file's tensors
                    return None
                sources[f"{component}/{module}/{which}"] = keys[id(tensor)]
    return LoraPlan(name, lora.nbytes, scales, sources, {k: shapes[k] for k in set(sources.values())}, file_bytes)


def read_planned(plan: LoraPlan, path: str | Path | StoreFile,
                 read: Callable[[str], dict[str, torch.Tensor]]) -> LoraWeights:
    """The planned LoRA from its file, `read(path)` giving the file's tensors (shm_tensors'
    read_tensors, onto a device or not), checked against the plan: the file may have been
    replaced since it was planned."""
    def changed() -> InvalidInput:
        return InvalidInput("loras", f"{plan.name!r} changed while it was loading; send the request again")

    try:
        with _opened(path) as file:
            if os.stat(file).st_size != plan.file_bytes:
                raise changed()
            tensors = read(file)
    except InvalidInput:
        raise
    except Exception as exc:  # truncated or rewritten since the plan
        raise _unreadable(plan.name, exc) from None
    for key, (shape, dtype) in plan.shapes.items():
        tensor = tensors.get(key)
        if tensor is None or tuple(tensor.shape) != shape or tensor.dtype != DTYPES[dtype]:
            raise changed()
    parts = {component: {module: LoraLayer(tensors[plan.sources[f"{component}/{module}/down"]],
                                           tensors[plan.sources[f"{component}/{module}/up"]], scale)
                         for module, scale in modules.items()}
             for component, modules in plan.scales.items()}
    unet = parts.pop("unet", {})
    return LoraWeights(plan.name, unet, plan.nbytes, text_encoders={k: v for k, v in parts.items() if v})


def _opened(path: str | Path | StoreFile):
    """A context giving a path that names the file: for a StoreFile the very file its safe open
    found (/proc/self/fd/N), else the path itself."""
    from backends.core.adapters.store import StoreFile

    return path.path() if isinstance(path, StoreFile) else contextlib.nullcontext(str(path))


def _unreadable(name: str, exc: Exception) -> InvalidInput:
    # truncated or foreign files: diffusers or safetensors says what is wrong (paths cut out)
    return InvalidInput("loras", f"{name!r} cannot be read as a LoRA ({exc.__class__.__name__}: "
                                 f"{shorten(no_paths(str(exc)))})")


def _convert(name: str, source: dict[str, torch.Tensor], text_encoders_only: bool = False) -> LoraWeights:
    """A file's tensors as layers, through diffusers' converters."""
    from diffusers import StableDiffusionXLPipeline
    from diffusers.utils import convert_unet_state_dict_to_peft

    if not source:
        raise InvalidInput("loras", f"{name!r} cannot be read as a LoRA (ValueError: the file holds no tensors)")
    try:
        state, alphas = StableDiffusionXLPipeline.lora_state_dict(source)
    except InvalidInput:
        raise
    except Exception as exc:
        raise _unreadable(name, exc) from None
    other = sorted({k.split(".", 1)[0] for k in state if k.split(".", 1)[0] not in ("unet", *TEXT_ENCODERS)})
    if other:
        raise InvalidInput("loras", f"{name!r} has layers for {other}, not an SDXL UNet or text encoder")
    text = {te: _text_encoder_layers(name, state, alphas, te) for te in TEXT_ENCODERS}
    text = {te: layers for te, layers in text.items() if layers}
    unet_state = {k[len("unet."):]: v for k, v in state.items() if k.startswith("unet.")}
    peft = convert_unet_state_dict_to_peft(unet_state) if unet_state else {}
    module_alpha = {}
    for key, alpha in (alphas or {}).items():  # kohya: "<module path>.down.weight.alpha" in diffusers' old naming
        if not key.startswith("unet."):
            continue
        converted = convert_unet_state_dict_to_peft({key[len("unet."):-len(".alpha")]: torch.empty(0)})
        (peft_key,) = converted
        module_alpha[peft_key.rsplit(".lora_", 1)[0]] = float(alpha)

    layers = {}
    for key, down in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        rank = down.shape[0]
        layers[module] = _layer(name, module, down, peft.get(f"{module}.lora_B.weight"), rank,
                                module_alpha.get(module, rank))
    if not layers and not text and not text_encoders_only:
        raise InvalidInput("loras", f"{name!r} holds no LoRA layers")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return LoraWeights(name, layers, nbytes, text)


def _layer(name: str, module: str, down: torch.Tensor, up: torch.Tensor | None, rank: int, alpha: float) -> LoraLayer:
    if up is None or down.ndim != 2 or up.ndim != 2 or up.shape[1] != down.shape[0] or down.shape[0] != rank:
        raise InvalidInput("loras", f"{name!r}: layer {module} is not a pair of rank-{rank} matrices")
    return LoraLayer(down, up, alpha / rank)


@functools.cache
def _flattened(component: str) -> bool:
    """Whether the installed transformers' encoder has no `text_model.` level (CLIPTextModel since
    transformers 5), asked of a tiny instance on the meta device, as diffusers asks the real one."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    cls = CLIPTextModel if component == "text_encoder" else CLIPTextModelWithProjection
    config = CLIPTextConfig(vocab_size=8, hidden_size=8, intermediate_size=8, projection_dim=8, num_hidden_layers=1,
                            num_attention_heads=1, max_position_embeddings=8, bos_token_id=0, eos_token_id=1,
                            pad_token_id=1)
    with torch.device("meta"):
        return not hasattr(cls(config), "text_model")


def _text_encoder_layers(name: str, state: dict, alphas: dict | None, prefix: str) -> dict[str, LoraLayer]:
    """One text encoder's layers, scaled as diffusers scales them: its own LoraConfig (get_peft_kwargs)
    resolved per module by PEFT's pattern lookup. That matters when a kohya file's alphas differ per
    layer: diffusers names the attention ones by their block (they match nothing) and the MLP ones
    with `text_model.` (they match only where the encoder keeps it); the rest get the most common."""
    from diffusers.utils import convert_state_dict_to_diffusers, convert_state_dict_to_peft, get_peft_kwargs
    from peft.utils.other import get_pattern_key

    part = {k[len(prefix) + 1:]: v for k, v in state.items() if k.startswith(prefix + ".")}
    if not part:
        return {}
    try:
        peft = convert_state_dict_to_peft(convert_state_dict_to_diffusers(part))
        if _flattened(prefix):  # as diffusers does, so that paths and alpha patterns match alike
            peft = {k.removeprefix("text_model."): v for k, v in peft.items()}
        ranks = {k: v.shape[1] for k, v in peft.items()
                 if k.endswith(".lora_B.weight") and k[: -len(".lora_B.weight")].endswith(_TEXT_RANK_MODULES)}
        net_alphas = {k[len(prefix) + 1:]: v for k, v in (alphas or {}).items() if k.split(".")[0] == prefix}
        config = get_peft_kwargs(ranks, net_alphas or None, peft, is_unet=False)
    except Exception as exc:  # what diffusers' load_lora_weights would fail on too
        raise InvalidInput("loras", f"{name!r} cannot be read as a LoRA for {prefix} "
                                    f"({exc.__class__.__name__}: {exc})") from None
    layers = {}
    for key, down in peft.items():
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[: -len(".lora_A.weight")]
        rank = config["rank_pattern"].get(get_pattern_key(config["rank_pattern"], module), config["r"])
        alpha = config["alpha_pattern"].get(get_pattern_key(config["alpha_pattern"], module), config["lora_alpha"])
        layers[module] = _layer(name, module, down, peft.get(f"{module}.lora_B.weight"), rank, float(alpha))
    return layers


class ModelLayers:
    """A model's weighted layers by module path, indexed once. An SDXL LoRA names hundreds of
    layers and the step loop checks them when a LoRA arrives (and a mixed batch on every step):
    one dict lookup each instead of a walk down the module tree (30 ms for two, on a CPU here)."""

    def __init__(self, model: torch.nn.Module):
        self.modules = {name: module for name, module in model.named_modules()
                        if isinstance(getattr(module, "weight", None), torch.Tensor)}

    def weight(self, lora_name: str, module: str, layer: LoraLayer) -> torch.Tensor:
        """The weight a LoRA layer changes; a clear error when the model has no such layer or shape."""
        if module not in self.modules:
            raise InvalidInput("loras", f"{lora_name!r}: layer {module} does not exist in the base model")
        weight = self.modules[module].weight
        if (layer.up.shape[0], layer.down.shape[1]) != tuple(weight.shape):
            raise InvalidInput("loras", f"{lora_name!r}: layer {module} is {(layer.up.shape[0], layer.down.shape[1])}, "
                                        f"the base model's is {tuple(weight.shape)}")
        return weight

    def check(self, lora: LoraWeights, component: str = "unet") -> None:
        for module, layer in lora.layers(component).items():
            self.weight(lora.name, module, layer)


class LoraMerger:
    """Merges LoRAs into a model's Linear weights in place and puts the originals back; into every
    copy of the model given (latent parallelism keeps one per GPU), each on its own device.
    `seconds()` is the time merges and restores have taken so far: device time on a GPU (CUDA
    events on the first copy's device, read once they have completed, so nothing waits for them;
    the other copies merge at the same time on theirs), wall time on a CPU."""

    def __init__(self, model: torch.nn.Module | Sequence[torch.nn.Module]):
        copies = [model] if isinstance(model, torch.nn.Module) else list(model)
        self.copies = [ModelLayers(m) for m in copies]
        self.layers = self.copies[0]  # what a LoRA is checked against
        self._cuda = any(w.is_cuda for w in copies[0].parameters())  # how merges are timed
        # (copy, module) -> (weight, its original)
        self._saved: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        self._seconds = 0.0
        self._timings: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._lock = threading.Lock()  # the loop thread times, the metrics thread reads

    @torch.no_grad()
    def merge(self, loras: list[tuple[LoraWeights, float]]) -> None:
        """Set the weights to base + the given LoRAs at the given scales (replacing any earlier merge)."""
        with self._timed():  # checks included: the loop does nothing else meanwhile
            terms: dict[str, list[tuple[LoraLayer, float]]] = {}
            for lora, scale in loras:  # every layer checked before any weight changes (all or nothing)
                for module, layer in lora.unet.items():
                    self.layers.weight(lora.name, module, layer)
                    terms.setdefault(module, []).append((layer, scale * layer.scale))
            self._restore(keep=set(terms))
            for copy, layers in enumerate(self.copies):
                weights = {module: layers.modules[module].weight for module in terms}
                for module, weight in weights.items():
                    if (copy, module) not in self._saved:
                        self._saved[copy, module] = weight, weight.detach().clone()
                for (shape, device, ranks_scales), modules in _groups(weights, terms).items():
                    per_chunk = max(1, DELTA_BYTES // (4 * shape[0] * shape[1]))
                    for first in range(0, len(modules), per_chunk):
                        chunk = modules[first:first + per_chunk]
                        deltas = _deltas([[terms[m][j][0] for m in chunk] for j in range(len(ranks_scales))],
                                         [scale for _, scale in ranks_scales], device)
                        for module, delta in zip(chunk, deltas):
                            # base (fp16) + delta (fp32), summed in fp32, rounded once into the weight, in place
                            torch.add(self._saved[copy, module][1], delta, out=weights[module])

    @torch.no_grad()
    def restore(self) -> None:
        """Put back the original weights."""
        with self._timed():
            self._restore()

    def seconds(self) -> float:
        with self._lock:
            while self._timings and self._timings[0][1].query():
                begin, end = self._timings.pop(0)
                self._seconds += begin.elapsed_time(end) / 1000
            return self._seconds

    def _restore(self, keep: set[str] = frozenset()) -> None:
        for copy, module in list(self._saved):
            if module not in keep:  # (those are about to be overwritten)
                weight, original = self._saved.pop((copy, module))
                weight.copy_(original)

    @contextmanager
    def _timed(self):
        if not self._cuda:
            start = time.perf_counter()
            try:
                yield
            finally:
                with self._lock:
                    self._seconds += time.perf_counter() - start
            return
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        try:
            yield
        finally:
            end.record()
            with self._lock:
                self._timings.append((begin, end))


def _groups(weights: dict[str, torch.Tensor], terms: dict[str, list[tuple[LoraLayer, float]]]
            ) -> dict[tuple, list[str]]:
    """The step loop launches a merge between two steps, and an SDXL LoRA touches hundreds of
    Linears: modules whose terms have the same shapes and scales share one batched product, so a
    merge costs a few kernels per group and one add per module, not several per module."""
    groups: dict[tuple, list[str]] = {}
    for module, parts in terms.items():
        weight = weights[module]
        key = (tuple(weight.shape), weight.device, tuple((layer.down.shape[0], scale) for layer, scale in parts))
        groups.setdefault(key, []).append(module)
    return groups


def _deltas(layers: list[list[LoraLayer]], scales: list[float], device: torch.device) -> torch.Tensor:
    """sum_j scales[j] * B @ A of each module, [modules, out, in] in fp32: for LoRA j, `layers[j]`
    holds its layer of each module. The LoRAs' factors sit side by side along the rank
    ([s_1 B_1 | s_2 B_2] @ [A_1; A_2]), so one product sums them without cross terms."""
    ups = [torch.stack([layer.up for layer in part]).to(device, torch.float32).mul_(scale)
           for part, scale in zip(layers, scales)]
    downs = [torch.stack([layer.down for layer in part]).to(device, torch.float32) for part in layers]
    return torch.bmm(torch.cat(ups, dim=2), torch.cat(downs, dim=1))


LoraSet = tuple[tuple[LoraWeights, float], ...]  # the LoRAs of one request, with their scales


def lora_key(loras: LoraSet) -> tuple[tuple[str, float], ...]:
    return tuple((lora.name, scale) for lora, scale in loras)


class UnmergedLoras:
    """For a batch whose requests carry different LoRA sets: each touched Linear adds
    scale * (x @ A^T) @ B^T on the rows of the requests that use that LoRA, the weights untouched.
    Used as a context manager around the batch's forward pass. This is also how diffusers runs an
    unfused LoRA (PEFT adds lora_B(lora_A(x)) * scaling to the base output)."""

    def __init__(self, layers: ModelLayers, segments: list[tuple[slice, LoraSet]], component: str = "unet"):
        self.layers = layers
        self.parts: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor, float]]] = {}
        for rows, loras in segments:
            for lora, scale in loras:
                for module, layer in lora.layers(component).items():
                    weight = layers.weight(lora.name, module, layer)
                    self.parts.setdefault(module, []).append(
                        (rows, layer.down.to(weight.device, weight.dtype), layer.up.to(weight.device, weight.dtype),
                         scale * layer.scale))
        self._handles = []

    def __enter__(self):
        for module, parts in self.parts.items():
            self._handles.append(self.layers.modules[module].register_forward_hook(_low_rank_hook(parts)))
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
