"""SDXL components -> ONNX graphs whose inputs and outputs are exactly their ComponentSpec's.

Each component is wrapped in a thin module taking the spec's inputs as *inputs and returning
its outputs as a flat tuple (the split UNet passes skips as a tuple; a graph has one tensor per
name). Every graph is exported in fp32 on CPU; a TensorRT build lowers precision itself.

Two exporters are available. The default is the TorchScript one (`dynamo=False`, deprecated
since torch 2.9 but still shipped): on the tiny test models it takes about 1 s per UNet half
where the torch.export-based one (`dynamo=True`) takes 20-35 s; both give graphs that match
torch to within 3e-5 (fp32). Tracing bakes Python branches on shapes in, so the export sample
has latent sizes that are NOT multiples of the UNet's overall downsampling factor: that takes
diffusers' branch passing explicit upsample sizes, which is correct for every size (the other
branch is only correct for multiples).

After export each graph's input/output dims are rewritten from the spec (symbolic names such
as "latent_h/4" instead of the exporter's own), after checking every fixed dim agrees.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from backends.core.runtime import specs
from backends.core.runtime.specs import ComponentSpec

log = logging.getLogger(__name__)

# Odd latent sizes (see above), batch > 1 (torch.export specialises sizes 0 and 1), tokens < 77.
EXPORT_SIZES = {"batch": 2, "latent_h": 9, "latent_w": 13, "tokens": 7}
ONNX_DIR = "onnx"
_ONNX_TYPES = {"fp32": "FLOAT", "fp16": "FLOAT16", "bf16": "BFLOAT16", "int64": "INT64"}
MAX_INLINE_BYTES = 1 << 30  # protobuf's hard limit is 2 GiB; larger weights go to one <name>.onnx.data


class EncoderGraph(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, *inputs):
        emb, mid, skips = self.encoder(*inputs)
        return (emb, mid, *skips)


class DecoderGraph(nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, *inputs):
        emb, mid, *skips, encoder_hidden_states = inputs
        return self.decoder(emb, mid, tuple(skips), encoder_hidden_states)


class TextEncoderGraph(nn.Module):
    def __init__(self, encoder, pooled: bool):
        super().__init__()
        self.encoder, self.pooled = encoder, pooled

    def forward(self, *inputs):
        out = self.encoder(inputs[0], output_hidden_states=True)
        hidden = out.hidden_states[-2]  # SDXL conditions on the penultimate layer
        return (hidden, out.text_embeds) if self.pooled else hidden


class VaeDecoderGraph(nn.Module):
    def __init__(self, vae):
        super().__init__()
        self.vae = vae

    def forward(self, *inputs):
        return self.vae.decode(inputs[0], return_dict=False)[0]


def export_graph(module: nn.Module, spec: ComponentSpec, path: str | Path, *, dynamo: bool = False,
                 sizes: dict[str, int] = EXPORT_SIZES) -> Path:
    """Export `module` (taking spec.inputs positionally, fp32) to `path`, dims named by the spec."""
    import onnx

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    inputs = spec.sample_inputs(**{a: sizes[a] for a in spec.base_axes()})
    args = tuple(inputs[name] for name in spec.input_names)
    module = module.eval()
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad(), warnings.catch_warnings():
        # Tracing warns on every Python branch on a shape; the ones in these modules are either
        # taken care of by EXPORT_SIZES (see above) or only choose memory layouts.
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # Exported into an empty folder: the TorchScript exporter spills >2 GiB weights as one file
        # per tensor, under names that would collide between components.
        raw = Path(tmp) / "graph.onnx"
        common = dict(input_names=spec.input_names, output_names=spec.output_names)
        if dynamo:
            # Every wrapper takes *inputs, so the shapes go in one nested tuple; names are set below.
            dims = tuple({i: torch.export.Dim.DYNAMIC for i in t.axes()} for t in spec.inputs)
            torch.onnx.export(module, args, raw, dynamo=True, dynamic_shapes=(dims,), external_data=True,
                              **common)
        else:
            torch.onnx.export(module, args, raw, dynamo=False, dynamic_axes=spec.dynamic_axes(), **common)
        model = onnx.load(str(raw))
    _apply_spec_dims(model, spec)
    nbytes = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    for old in (path, path.with_name(path.name + ".data")):
        old.unlink(missing_ok=True)
    onnx.save_model(model, str(path), save_as_external_data=nbytes > MAX_INLINE_BYTES,
                    all_tensors_to_one_file=True, location=path.name + ".data")
    log.info("wrote %s (%s, %s)", path, spec.name, "dynamo" if dynamo else "torchscript")
    return path


def _apply_spec_dims(model, spec: ComponentSpec) -> None:
    """Check the graph's inputs/outputs against the spec and name their symbolic dims by it."""
    from onnx import TensorProto

    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    for kind, values, tensors in (("input", graph.input, spec.inputs), ("output", graph.output, spec.outputs)):
        values = [v for v in values if v.name not in initializers]
        if [v.name for v in values] != [t.name for t in tensors]:
            raise ValueError(f"{spec.name}: graph {kind}s {[v.name for v in values]} are not the spec's "
                             f"{[t.name for t in tensors]}")
        for value, tensor in zip(values, tensors):
            where = f"{spec.name}.{tensor.name}"
            want_type = getattr(TensorProto, _ONNX_TYPES[tensor.resolved_dtype("fp32")])
            if value.type.tensor_type.elem_type != want_type:
                raise ValueError(f"{where}: graph element type {value.type.tensor_type.elem_type} != {want_type}")
            dims = value.type.tensor_type.shape.dim
            if len(dims) != len(tensor.dims):
                raise ValueError(f"{where}: graph rank {len(dims)} != spec rank {len(tensor.dims)}")
            for dim, want in zip(dims, tensor.dims):
                # A fixed size where the spec has an axis means the exporter specialised it: refuse.
                if dim.HasField("dim_value") and dim.dim_value != want:
                    raise ValueError(f"{where}: graph dim {dim.dim_value} where the spec has {want!r}")
                if isinstance(want, str):
                    dim.dim_param = want
                else:
                    dim.dim_value = want


def _fp32(module: nn.Module) -> nn.Module:
    # Refused rather than converted: .float() would silently change the caller's module in place.
    dtypes = {p.dtype for p in module.parameters()}
    if dtypes != {torch.float32}:
        raise ValueError(f"{type(module).__name__}: ONNX export needs fp32 weights, got {sorted(map(str, dtypes))}")
    return module


# ---- per component: (graph module, spec) pairs ---------------------------------------------------------

Graph = tuple[nn.Module, ComponentSpec]


def unet_graphs(unet) -> dict[str, Graph]:
    """The UNet's two halves: unet_encoder and unet_decoder."""
    from backends.core.runtime.unet_split import split_unet

    encoder, decoder = split_unet(_fp32(unet))
    return {"unet_encoder": (EncoderGraph(encoder), specs.unet_encoder_spec(unet.config)),
            "unet_decoder": (DecoderGraph(decoder), specs.unet_decoder_spec(unet.config))}


def text_encoder_graph(encoder, which: str) -> Graph:
    """One CLIP text encoder, `which` = "text_encoder" or "text_encoder_2" (the one with projection)."""
    return (TextEncoderGraph(_fp32(encoder), pooled=which == "text_encoder_2"),
            specs.text_encoder_spec(encoder.config, which))


def vae_decoder_graph(vae) -> Graph:
    return VaeDecoderGraph(_fp32(vae)), specs.vae_decoder_spec(vae.config)


def component_graphs(model_dir: str | Path):
    """Yield (name, graph, spec) for every component of a diffusers SDXL folder, loaded in fp32 one at
    a time (an SDXL UNet in fp32 is 10 GB; nothing else needs to be in memory beside it)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    model_dir = Path(model_dir)
    load = dict(dtype=torch.float32, use_safetensors=True)
    for which, cls in (("text_encoder", CLIPTextModel), ("text_encoder_2", CLIPTextModelWithProjection)):
        yield which, *text_encoder_graph(cls.from_pretrained(model_dir / which, **load).eval(), which)
    unet = UNet2DConditionModel.from_pretrained(model_dir / "unet", **load).eval()
    yield from ((name, *graph) for name, graph in unet_graphs(unet).items())
    del unet  # the halves hold its parameters: let them go before the VAE is loaded
    yield "vae_decoder", *vae_decoder_graph(AutoencoderKL.from_pretrained(model_dir / "vae", **load).eval())


def export_repository_onnx(model_dir: str | Path, repo: str | Path, denoiser: str = "denoiser",
                           version: str = "1", *, dynamo: bool = False) -> list[Path]:
    """<repo>/<model>/<version>/onnx/<component>.onnx next to each Triton model's torch artifacts.

    Components are loaded again from the diffusers folder in fp32, whatever dtype the repository's
    torch artifacts use."""
    model_of = {"text_encoder": "text_encoder", "text_encoder_2": "text_encoder", "unet_encoder": denoiser,
                "unet_decoder": denoiser, "vae_decoder": "vae_decoder"}
    return [export_graph(graph, spec, Path(repo) / model_of[name] / version / ONNX_DIR / f"{name}.onnx",
                         dynamo=dynamo)
            for name, graph, spec in component_graphs(model_dir)]
