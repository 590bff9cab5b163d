"""export/onnx_export.py: every component's ONNX graph, run in onnxruntime, against torch.

Graphs are exported at batch 2, 9x13 latents, 7 tokens (EXPORT_SIZES) and run at the SIZES
below, so every dynamic axis takes values it was not exported with, including odd latent sizes
that are not multiples of the UNet's downsampling factor.

Tolerance: max abs difference <= 1e-4, fp32 on both sides. The graphs are not bit-identical to
torch (onnxruntime fuses and reorders float ops, e.g. in attention and GroupNorm). Measured on the
tiny models: <= 2.5e-5 for the VAE decoder (outputs up to ~6), <= 3.5e-6 for everything else.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from diffusers import UNet2DConditionModel

from export.cli import parser
from export.onnx_export import (EXPORT_SIZES, component_graphs, export_graph, text_encoder_graph,
                                unet_graphs)
from export.repository import ExportOptions, export_repository

ATOL = 1e-4
SIZES = [
    dict(batch=1, latent_h=8, latent_w=8, tokens=77),
    dict(batch=3, latent_h=12, latent_w=16, tokens=20),
    dict(batch=1, latent_h=11, latent_w=7, tokens=5),
]
# Where `easel export --onnx` puts each component's graph, inside the model repository.
REPO_PATHS = {
    "text_encoder": "text_encoder/1/onnx/text_encoder.onnx",
    "text_encoder_2": "text_encoder/1/onnx/text_encoder_2.onnx",
    "unet_encoder": "denoiser/1/onnx/unet_encoder.onnx",
    "unet_decoder": "denoiser/1/onnx/unet_decoder.onnx",
    "vae_decoder": "vae_decoder/1/onnx/vae_decoder.onnx",
}


@pytest.fixture(scope="module")
def onnx_repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("onnx") / "repo", ExportOptions(onnx=True))


@pytest.fixture(scope="module")
def tiny_graphs(tiny_model):
    return {name: (graph, spec) for name, graph, spec in component_graphs(tiny_model)}


@pytest.fixture(scope="module")
def alt_unet(alt_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx_alt")
    graphs = unet_graphs(UNet2DConditionModel.from_pretrained(alt_model / "unet").eval())
    return {name: (graph, spec, export_graph(graph, spec, out / f"{name}.onnx"))
            for name, (graph, spec) in graphs.items()}


def compare(path, graph, spec) -> float:
    """Run the ONNX graph and the torch module on the same spec inputs at every SIZES entry; return
    the largest abs difference over all outputs."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == spec.input_names
    assert [o.name for o in session.get_outputs()] == spec.output_names
    assert [i.shape for i in session.get_inputs()] == [list(t.dims) for t in spec.inputs]
    worst = 0.0
    for sizes in SIZES:
        feed = spec.sample_inputs(seed=1, **sizes)
        got = session.run(None, {name: x.numpy() for name, x in feed.items()})
        with torch.no_grad():
            want = graph(*(feed[name] for name in spec.input_names))
        want = want if isinstance(want, tuple) else (want,)
        for tensor, g, w in zip(spec.outputs, got, want):
            assert g.shape == tensor.shape(sizes) == tuple(w.shape), (tensor.name, sizes)
            worst = max(worst, float(np.abs(g - w.numpy()).max()))
    return worst


@pytest.mark.parametrize("name", list(REPO_PATHS))
def test_repository_graphs_match_torch(onnx_repo, tiny_graphs, name):
    graph, spec = tiny_graphs[name]
    err = compare(onnx_repo / REPO_PATHS[name], graph, spec)
    assert err <= ATOL, f"{name}: max abs diff {err:.2e}"


@pytest.mark.parametrize("name", ["unet_encoder", "unet_decoder"])
def test_alt_unet_halves_match_torch(alt_unet, name):
    graph, spec, path = alt_unet[name]
    err = compare(path, graph, spec)
    assert err <= ATOL, f"alt {name}: max abs diff {err:.2e}"


def test_graphs_are_valid_and_self_contained(onnx_repo):
    for rel in REPO_PATHS.values():
        path = onnx_repo / rel
        onnx.checker.check_model(str(path), full_check=True)
        # Tiny weights stay inline: no side files to ship along.
        assert not path.with_name(path.name + ".data").exists()
    options = json.loads((onnx_repo / "easel_export.json").read_text())["options"]
    assert options["onnx"] is True


def test_dynamo_exporter_matches_torch(tiny_model, tmp_path):
    # The torch.export-based exporter is the optional path; the text encoder keeps this test fast
    # (the UNet halves take 20-35 s each with it).
    from transformers import CLIPTextModelWithProjection

    te = CLIPTextModelWithProjection.from_pretrained(tiny_model / "text_encoder_2").eval()
    graph, spec = text_encoder_graph(te, "text_encoder_2")
    path = export_graph(graph, spec, tmp_path / "te2.onnx", dynamo=True)
    err = compare(path, graph, spec)
    assert err <= ATOL, f"dynamo text_encoder_2: max abs diff {err:.2e}"


def test_non_fp32_modules_are_refused(tiny_model):
    from transformers import CLIPTextModel

    te = CLIPTextModel.from_pretrained(tiny_model / "text_encoder", dtype=torch.float16)
    with pytest.raises(ValueError, match="fp32"):
        text_encoder_graph(te, "text_encoder")


def test_cli_flag():
    args = parser().parse_args(["export", "--model", "m", "--out", "o", "--onnx"])
    assert args.onnx is True
    assert parser().parse_args(["export", "--model", "m", "--out", "o"]).onnx is False
    assert ExportOptions().onnx is False


def test_export_sizes_take_the_general_upsampling_branch(tiny_graphs):
    # See onnx_export's docstring: tracing at a multiple of the UNet's factor would bake in a graph
    # that fails on other sizes.
    unet = tiny_graphs["unet_decoder"][0].decoder.unet
    factor = 2 ** unet.num_upsamplers
    assert EXPORT_SIZES["latent_h"] % factor and EXPORT_SIZES["latent_w"] % factor


def test_large_weights_go_to_one_data_file(tiny_graphs, tmp_path, monkeypatch):
    # SDXL's fp32 UNet halves are over protobuf's 2 GiB limit; pretend these tiny weights are too.
    import export.onnx_export as onnx_export

    monkeypatch.setattr(onnx_export, "MAX_INLINE_BYTES", 0)
    graph, spec = tiny_graphs["text_encoder"]
    path = export_graph(graph, spec, tmp_path / "text_encoder.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["text_encoder.onnx", "text_encoder.onnx.data"]
    assert compare(path, graph, spec) <= ATOL


def test_a_specialised_axis_is_refused(tiny_graphs, tmp_path):
    # Guards the dim renaming: a graph exported without dynamic axes must not pass as dynamic.
    from export.onnx_export import _apply_spec_dims

    graph, spec = tiny_graphs["text_encoder"]
    feed = spec.sample_inputs(batch=2, tokens=7)
    torch.onnx.export(graph, (feed["input_ids"],), tmp_path / "static.onnx", dynamo=False,
                      input_names=spec.input_names, output_names=spec.output_names)
    with pytest.raises(ValueError, match="graph dim 2 where the spec has 'batch'"):
        _apply_spec_dims(onnx.load(str(tmp_path / "static.onnx")), spec)
