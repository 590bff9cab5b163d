"""Tests for export/tiny.py: the hub-free tiny SDXL pipelines used by tests and the demo."""

import hashlib
import json
import shutil

import numpy as np
import pytest
import torch

from export.tiny import VARIANTS, write_tiny_pipeline

pytest.importorskip("diffusers")
from diffusers import StableDiffusionXLPipeline  # noqa: E402
from transformers import CLIPTokenizer  # noqa: E402

PROMPT = "a photo of the red cat on a mountain at sunset, portrait style"


def _hashes(folder):
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {v: write_tiny_pipeline(root / v, seed=0, variant=v) for v in VARIANTS}


@pytest.fixture(scope="module")
def pipes(tiny_dirs):
    out = {}
    for v, path in tiny_dirs.items():
        pipe = StableDiffusionXLPipeline.from_pretrained(path)
        pipe.set_progress_bar_config(disable=True)
        out[v] = pipe
    return out


def _run(pipe, prompt=PROMPT, height=64, width=64, steps=2):
    gen = torch.Generator("cpu").manual_seed(0)
    return pipe(prompt, num_inference_steps=steps, height=height, width=width, output_type="np", generator=gen).images


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("height,width", [(64, 64), (64, 96)])
def test_pipeline_generates(pipes, variant, height, width):
    images = _run(pipes[variant], height=height, width=width)
    assert images.shape == (1, height, width, 3)
    assert np.isfinite(images).all()
    assert images.min() >= 0.0 and images.max() <= 1.0


@pytest.mark.parametrize("variant", VARIANTS)
def test_layout_and_sdxl_architecture(tiny_dirs, pipes, variant):
    path, pipe = tiny_dirs[variant], pipes[variant]
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline"
    assert index["force_zeros_for_empty_prompt"] is True
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        assert list((path / name).glob("*.safetensors")), name
    assert not list(path.rglob("*.bin")) and not list(path.rglob("*.pt"))
    for name in ("tokenizer", "tokenizer_2"):
        assert (path / name / "vocab.json").is_file() and (path / name / "merges.txt").is_file()
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    assert total < 5 * 1024 * 1024

    unet, te1, te2 = pipe.unet.config, pipe.text_encoder.config, pipe.text_encoder_2.config
    assert unet.addition_embed_type == "text_time" and unet.use_linear_projection
    assert unet.cross_attention_dim == te1.hidden_size + te2.hidden_size
    assert unet.projection_class_embeddings_input_dim == 6 * unet.addition_time_embed_dim + te2.projection_dim
    assert pipe.vae_scale_factor == 8 and pipe.vae.config.latent_channels == 4
    assert te1.vocab_size >= len(pipe.tokenizer) and te2.vocab_size >= len(pipe.tokenizer_2)
    assert pipe.tokenizer.model_max_length == pipe.tokenizer_2.model_max_length == 77
    assert pipe.tokenizer.pad_token == "<|endoftext|>" and pipe.tokenizer_2.pad_token == "!"
    sched = pipe.scheduler.config
    assert (sched.beta_start, sched.beta_end, sched.beta_schedule) == (0.00085, 0.012, "scaled_linear")
    assert (sched.timestep_spacing, sched.steps_offset, sched.prediction_type) == ("leading", 1, "epsilon")


def test_variants_differ(pipes):
    d, a = pipes["default"], pipes["alt"]
    assert type(d.scheduler).__name__ == "EulerDiscreteScheduler"
    assert type(a.scheduler).__name__ != type(d.scheduler).__name__
    assert len(d.unet.config.down_block_types) == 3 and len(a.unet.config.down_block_types) == 2
    for key in ("block_out_channels", "layers_per_block", "attention_head_dim", "cross_attention_dim"):
        assert d.unet.config[key] != a.unet.config[key], key


def test_tokenizer_merges_compress_prompts(pipes):
    tok = pipes["default"].tokenizer
    ids = tok(PROMPT).input_ids
    assert ids[0] == tok.bos_token_id and ids[-1] == tok.eos_token_id
    assert len(ids) < len(PROMPT) // 2
    assert tok.unk_token_id not in ids[1:-1]


def test_vocab_files_match_tokenizer_json(tiny_dirs, pipes, tmp_path):
    # vocab.json + merges.txt alone (what transformers 4.x's slow CLIPTokenizer reads) give the same ids.
    only_files = tmp_path / "tok"
    only_files.mkdir()
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(tiny_dirs["default"] / "tokenizer" / name, only_files / name)
    tok = CLIPTokenizer(str(only_files / "vocab.json"), str(only_files / "merges.txt"))
    assert tok(PROMPT).input_ids == pipes["default"].tokenizer(PROMPT).input_ids


@pytest.mark.parametrize("variant", VARIANTS)
def test_long_prompt_is_truncated(pipes, variant):
    pipe = pipes[variant]
    long_prompt = "a photo of a cat in the city with blue light " * 30
    assert len(pipe.tokenizer(long_prompt).input_ids) > 77
    embeds, _, pooled, _ = pipe.encode_prompt(long_prompt, device="cpu", do_classifier_free_guidance=True)
    cross = pipe.unet.config.cross_attention_dim
    assert embeds.shape == (1, 77, cross)
    assert pooled.shape == (1, pipe.text_encoder_2.config.projection_dim)
    assert _run(pipe, prompt=long_prompt).shape == (1, 64, 64, 3)


def test_deterministic_for_seed(tmp_path):
    a = _hashes(write_tiny_pipeline(tmp_path / "a", seed=7))
    b = _hashes(write_tiny_pipeline(tmp_path / "b", seed=7))
    c = _hashes(write_tiny_pipeline(tmp_path / "c", seed=8))
    assert a == b
    weights = [k for k in a if k.endswith(".safetensors")]
    assert len(weights) == 4
    for k in weights:
        assert a[k] != c[k], k


def test_does_not_disturb_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    write_tiny_pipeline(tmp_path / "p", seed=0)
    assert torch.equal(torch.rand(3), expected)


def test_refuses_non_empty_dir(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="non-empty"):
        write_tiny_pipeline(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_accepts_existing_empty_dir(tmp_path):
    out = tmp_path / "empty"
    out.mkdir()
    assert write_tiny_pipeline(out) == out
    assert (out / "model_index.json").is_file()


def test_unknown_variant(tmp_path):
    with pytest.raises(ValueError, match="default.*alt"):
        write_tiny_pipeline(tmp_path / "x", variant="huge")
    assert not (tmp_path / "x").exists()
