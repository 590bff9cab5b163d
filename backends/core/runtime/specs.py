"""The engine-level I/O contract: one ComponentSpec per exported component.

A spec names every input and output of an engine, its dtype and its dims, and is derived from
the model's config alone (no weights, no modules), so the torch runtime, the ONNX export, the
TensorRT profiles and the Triton configs can all read the same declaration.

Dims are ints or symbolic axes. The base axes are "batch", "latent_h", "latent_w" and "tokens";
a derived axis is written "latent_h/4" (ceil division: what stride-2, padding-1 convolutions do
to odd sizes, applied once per level) or "latent_h*8" (the VAE's upsampling). Derived axes let
a profile or sample input be given by base sizes only, and every other shape follows.

Torch-free at import: light Triton adapters import this module; torch is imported only inside
`sample_inputs`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPES = ("fp32", "fp16", "bf16", "int64", "model")  # "model": whatever dtype the engine runs in
BASE_AXES = ("batch", "latent_h", "latent_w", "tokens")
DEFAULT_SIZES = {"batch": 1, "latent_h": 8, "latent_w": 8, "tokens": 77}

_AXIS = re.compile(r"([a-z][a-z_]*)(?:([*/])([1-9][0-9]*))?")
_TORCH_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "int64": "int64"}


def parse_axis(axis: str) -> tuple[str, str | None, int]:
    """'latent_h/4' -> ('latent_h', '/', 4); 'batch' -> ('batch', None, 1)."""
    m = _AXIS.fullmatch(axis)
    if not m or m.group(1) not in BASE_AXES:
        raise ValueError(f"axis {axis!r}: not one of {BASE_AXES}, optionally followed by /k or *k")
    return m.group(1), m.group(2), int(m.group(3) or 1)


def axis_size(axis: str, sizes: Mapping[str, int]) -> int:
    base, op, k = parse_axis(axis)
    n = sizes[base]
    if op == "*":
        return n * k
    if op == "/":
        return -(-n // k)
    return n


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[int | str, ...]
    # sample_inputs draws uniformly from this range (integers for int64); None: standard normal.
    value_range: tuple[float, float] | None = None

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not one of {DTYPES}")
        object.__setattr__(self, "dims", tuple(self.dims))
        for d in self.dims:
            if isinstance(d, str):
                parse_axis(d)
            elif not isinstance(d, int) or d < 1:
                raise ValueError(f"{self.name}: dim {d!r} is neither a positive int nor an axis name")
        if self.dtype == "int64" and self.value_range is None:
            raise ValueError(f"{self.name}: an int64 input needs a value_range (e.g. the vocabulary)")

    def resolved_dtype(self, model_dtype: str) -> str:
        return model_dtype if self.dtype == "model" else self.dtype

    def axes(self) -> dict[int, str]:
        return {i: d for i, d in enumerate(self.dims) if isinstance(d, str)}

    def shape(self, sizes: Mapping[str, int]) -> tuple[int, ...]:
        return tuple(axis_size(d, sizes) if isinstance(d, str) else d for d in self.dims)


@dataclass(frozen=True)
class Profile:
    """One shape bucket (a TensorRT optimisation profile): (min, opt, max) per base axis."""

    ranges: Mapping[str, tuple[int, int, int]]

    def __post_init__(self):
        for axis, r in self.ranges.items():
            parse_axis(axis)
            if len(r) != 3 or not 1 <= r[0] <= r[1] <= r[2]:
                raise ValueError(f"profile axis {axis}: {r} is not 1 <= min <= opt <= max")

    def sizes(self, which: int) -> dict[str, int]:
        return {axis: r[which] for axis, r in self.ranges.items()}


@dataclass(frozen=True)
class ComponentSpec:
    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    # Hard limits of the model per base axis (min, max), e.g. tokens <= CLIP's position embeddings.
    bounds: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        names = [t.name for t in self.inputs + self.outputs]
        if len(set(names)) != len(names):
            raise ValueError(f"{self.name}: tensor names are not unique: {names}")

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def base_axes(self) -> list[str]:
        """The base axes the inputs use: what a profile or sample_inputs must size."""
        used = {parse_axis(d)[0] for t in self.inputs for d in t.axes().values()}
        return [a for a in BASE_AXES if a in used]

    def dynamic_axes(self) -> dict[str, dict[int, str]]:
        """torch.onnx.export's `dynamic_axes`: every symbolic dim of every input and output."""
        return {t.name: t.axes() for t in self.inputs + self.outputs if t.axes()}

    def dynamic_shapes(self) -> tuple[dict[int, str], ...]:
        """The dynamo exporter's `dynamic_shapes` for a module taking the inputs as positional
        parameters (the exporter names the ONNX dims after them)."""
        return tuple(t.axes() for t in self.inputs)

    def check_sizes(self, sizes: Mapping[str, int]) -> None:
        missing = [a for a in self.base_axes() if a not in sizes]
        if missing:
            raise ValueError(f"{self.name}: no size for axes {missing}")
        for axis, (lo, hi) in self.bounds.items():
            if axis in sizes and not lo <= sizes[axis] <= hi:
                raise ValueError(f"{self.name}: {axis}={sizes[axis]} is outside [{lo}, {hi}]")

    def profile_shapes(self, profile: Profile) -> dict[str, tuple[tuple[int, ...], ...]]:
        """Input name -> (min shape, opt shape, max shape), what TensorRT's profile.set_shape takes."""
        sizes = [profile.sizes(i) for i in range(3)]
        for s in sizes:
            self.check_sizes(s)
        return {t.name: tuple(t.shape(s) for s in sizes) for t in self.inputs if t.axes()}

    def sample_inputs(self, *, model_dtype: str = "fp32", seed: int = 0, device: str = "cpu",
                      **sizes: int) -> dict[str, torch.Tensor]:
        """Random input tensors, by name, for the given base sizes (defaults: DEFAULT_SIZES)."""
        import torch

        unknown = set(sizes) - set(BASE_AXES)
        if unknown:
            raise ValueError(f"unknown axes {sorted(unknown)}; known: {BASE_AXES}")
        if model_dtype not in _TORCH_DTYPES or model_dtype == "int64":
            raise ValueError(f"model_dtype {model_dtype!r} is not fp32, fp16 or bf16")
        sizes = {**DEFAULT_SIZES, **sizes}
        self.check_sizes(sizes)
        g = torch.Generator().manual_seed(seed)
        out = {}
        for t in self.inputs:
            shape = t.shape(sizes)
            dtype = getattr(torch, _TORCH_DTYPES[t.resolved_dtype(model_dtype)])
            if t.dtype == "int64":
                x = torch.randint(int(t.value_range[0]), int(t.value_range[1]), shape, generator=g)
            elif t.value_range is not None:
                lo, hi = t.value_range
                x = torch.rand(shape, generator=g) * (hi - lo) + lo
            else:
                x = torch.randn(shape, generator=g)  # drawn in fp32 so every dtype sees the same values
            out[t.name] = x.to(device=device, dtype=dtype)
        return out


# ---- builders: the spec of each component, from its config -------------------------------------------

def _get(cfg, key: str, default=None):
    """Diffusers configs are dicts, transformers configs are objects."""
    return cfg.get(key, default) if isinstance(cfg, Mapping) else getattr(cfg, key, default)


def _level(axis: str, level: int) -> str:
    return axis if level == 0 else f"{axis}/{2 ** level}"


def _latent(name: str, channels: int, level: int = 0) -> TensorSpec:
    return TensorSpec(name, "model", ("batch", channels, _level("latent_h", level), _level("latent_w", level)))


def unet_skip_shapes(unet_config) -> list[tuple[int, int]]:
    """(channels, level) of each skip the encoder half hands to the decoder half, in order: conv_in's
    output, then per down block its resnets' outputs and its downsampler's (all but the last block)."""
    channels = list(_get(unet_config, "block_out_channels"))
    layers = _get(unet_config, "layers_per_block")
    layers = [layers] * len(channels) if isinstance(layers, int) else list(layers)
    skips = [(channels[0], 0)]
    for level, ch in enumerate(channels):
        skips += [(ch, level)] * layers[level]
        if level < len(channels) - 1:
            skips.append((ch, level + 1))
    return skips


def unet_num_skips(unet_config) -> int:
    return len(unet_skip_shapes(unet_config))


def controlnet_residual_shapes(unet_config, rows: int, height: int, width: int) -> list[tuple[int, int, int, int]]:
    """The shapes of a ControlNet's residuals for `rows` latents of height x width: one per skip,
    then the mid block's (each downsampler halves a side, rounding up)."""
    levels = len(_get(unet_config, "block_out_channels"))
    mid = (_get(unet_config, "block_out_channels")[-1], levels - 1)
    return [(rows, ch, -(-height // 2 ** lv), -(-width // 2 ** lv)) for ch, lv in (*unet_skip_shapes(unet_config), mid)]


def _text_dims(unet_config) -> tuple[int, int]:
    text_dim = _get(unet_config, "cross_attention_dim")
    if not isinstance(text_dim, int):
        raise ValueError(f"cross_attention_dim {text_dim!r}: only one text width for all blocks is supported")
    return text_dim, _get(unet_config, "time_embedding_dim") or 4 * _get(unet_config, "block_out_channels")[0]


# SDXL-base conditions on six time ids: original size, crop top-left, target size (the refiner on five).
TIME_IDS = 6


def unet_pooled_dim(unet_config, time_ids: int = TIME_IDS) -> int:
    """The pooled text embedding's width: what the UNet's added-condition projection takes besides
    its time ids."""
    return _get(unet_config, "projection_class_embeddings_input_dim") - time_ids * _get(unet_config, "addition_time_embed_dim")


def unet_encoder_spec(unet_config, text_dim: int | None = None, pooled_dim: int | None = None) -> ComponentSpec:
    """(latents, timestep, text states, pooled text, time ids) -> (emb, mid, skip_0..skip_{n-1}).

    text_dim/pooled_dim come from the text encoders; given, they are checked against the UNet's
    config (SDXL-base conditions on 6 time ids, the refiner on 5: the pooled width tells which)."""
    own_text_dim, emb_dim = _text_dims(unet_config)
    if text_dim is not None and text_dim != own_text_dim:
        raise ValueError(f"text_dim {text_dim} != the UNet's cross_attention_dim {own_text_dim}")
    add_in = _get(unet_config, "projection_class_embeddings_input_dim")
    per_id = _get(unet_config, "addition_time_embed_dim")
    n_ids = TIME_IDS if pooled_dim is None else (add_in - pooled_dim) // per_id
    if pooled_dim is None:
        pooled_dim = unet_pooled_dim(unet_config, n_ids)
    if n_ids < 1 or pooled_dim + n_ids * per_id != add_in:
        raise ValueError(f"pooled_dim {pooled_dim} does not fit projection_class_embeddings_input_dim {add_in}")
    channels = _get(unet_config, "block_out_channels")
    return ComponentSpec(
        "unet_encoder",
        inputs=(
            _latent("sample", _get(unet_config, "in_channels")),
            TensorSpec("timestep", "fp32", ("batch",), value_range=(0, 1000)),
            TensorSpec("encoder_hidden_states", "model", ("batch", "tokens", own_text_dim)),
            TensorSpec("text_embeds", "model", ("batch", pooled_dim)),
            TensorSpec("time_ids", "model", ("batch", n_ids), value_range=(0, 1024)),
        ),
        outputs=(
            TensorSpec("emb", "model", ("batch", emb_dim)),
            _latent("mid", channels[-1], len(channels) - 1),
            *(_latent(f"skip_{i}", ch, lv) for i, (ch, lv) in enumerate(unet_skip_shapes(unet_config))),
        ),
    )


def unet_decoder_spec(unet_config) -> ComponentSpec:
    """(emb, mid, skip_0..skip_{n-1}, text states) -> model output (noise or v, per the scheduler).

    ControlNet residuals are added to mid and the skips before this engine runs, so the graph has
    one signature whether a ControlNet is active or not."""
    text_dim, emb_dim = _text_dims(unet_config)
    channels = _get(unet_config, "block_out_channels")
    return ComponentSpec(
        "unet_decoder",
        inputs=(
            TensorSpec("emb", "model", ("batch", emb_dim)),
            _latent("mid", channels[-1], len(channels) - 1),
            *(_latent(f"skip_{i}", ch, lv) for i, (ch, lv) in enumerate(unet_skip_shapes(unet_config))),
            TensorSpec("encoder_hidden_states", "model", ("batch", "tokens", text_dim)),
        ),
        outputs=(_latent("model_output", _get(unet_config, "out_channels")),),
    )


TEXT_ENCODERS = ("text_encoder", "text_encoder_2")


def text_encoder_spec(te_config, which: str) -> ComponentSpec:
    """input_ids -> the penultimate layer's hidden states (what SDXL conditions on), plus for
    text_encoder_2 the projected pooled embedding `text_embeds`."""
    if which not in TEXT_ENCODERS:
        raise ValueError(f"which: {which!r} is not one of {TEXT_ENCODERS}")
    outputs = [TensorSpec("penultimate_hidden_states", "model", ("batch", "tokens", _get(te_config, "hidden_size")))]
    if which == "text_encoder_2":
        outputs.append(TensorSpec("text_embeds", "model", ("batch", _get(te_config, "projection_dim"))))
    return ComponentSpec(
        which,
        inputs=(TensorSpec("input_ids", "int64", ("batch", "tokens"), value_range=(0, _get(te_config, "vocab_size"))),),
        outputs=tuple(outputs),
        bounds={"tokens": (1, _get(te_config, "max_position_embeddings"))},
    )


def vae_decoder_spec(vae_config) -> ComponentSpec:
    """Unscaled latents (already divided by scaling_factor) -> image in [-1, 1], NCHW."""
    factor = 2 ** (len(_get(vae_config, "block_out_channels")) - 1)
    return ComponentSpec(
        "vae_decoder",
        inputs=(_latent("latent", _get(vae_config, "latent_channels")),),
        outputs=(TensorSpec("image", "model",
                            ("batch", _get(vae_config, "out_channels"), f"latent_h*{factor}", f"latent_w*{factor}")),),
    )
