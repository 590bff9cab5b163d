"""Tiny, randomly initialised SDXL-architecture pipelines, built entirely by code.

Easel serves SDXL on Triton. Tests, CI and the demo must exercise the real export and
serving path (two CLIP text encoders, text_time conditioning, 8x VAE, scheduler swap)
without a model hub, network access or gigabytes of weights. ``write_tiny_pipeline``
writes a diffusers folder (``model_index.json``, ``unet/``, ``vae/``, ``text_encoder*/``,
``tokenizer*/``, ``scheduler/``) that ``StableDiffusionXLPipeline.from_pretrained`` loads
exactly like a real SDXL checkpoint: a few MB of safetensors, well under a second per CPU run.

Two variants exist so the serving code is proven not to depend on one configuration:
``"default"`` (3 UNet levels, Euler) and ``"alt"`` (2 UNet levels, different widths,
text encoder sizes, VAE scaling factor and a DDIM scheduler). Weights are random, so the
images are noise; same seed -> byte-identical files.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import tempfile

import torch

logger = logging.getLogger(__name__)

VARIANTS = ("default", "alt")  # tiny text-to-image ones, for tests and the demo
ALL_VARIANTS = (*VARIANTS, "inpaint", "sdxl")

_SDXL_BETAS = dict(
    num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
    timestep_spacing="leading", steps_offset=1, prediction_type="epsilon",
)

# Per-variant knobs: CLIPTextConfig kwargs for both text encoders, UNet/VAE kwargs, scheduler class.
_CONFIGS = {
    "default": dict(
        te1=dict(hidden_size=32, num_attention_heads=4, intermediate_size=37),
        te2=dict(hidden_size=32, num_attention_heads=4, intermediate_size=37, projection_dim=32),
        unet=dict(
            sample_size=16, block_out_channels=(16, 32, 32), layers_per_block=1,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 1, 2), attention_head_dim=(2, 4, 4),
            norm_num_groups=8, addition_time_embed_dim=8,
        ),
        vae=dict(block_out_channels=(8, 16, 16, 16), layers_per_block=1, norm_num_groups=8,
                 sample_size=128, scaling_factor=0.13025),
        scheduler="EulerDiscreteScheduler",
    ),
    "alt": dict(
        te1=dict(hidden_size=24, num_attention_heads=3, intermediate_size=48),
        te2=dict(hidden_size=48, num_attention_heads=4, intermediate_size=64, projection_dim=24),
        unet=dict(
            sample_size=12, block_out_channels=(24, 40), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2), attention_head_dim=(3, 5),
            norm_num_groups=8, addition_time_embed_dim=6,
        ),
        vae=dict(block_out_channels=(8, 8, 16, 24), layers_per_block=2, norm_num_groups=8,
                 sample_size=96, scaling_factor=0.18215),
        scheduler="DDIMScheduler",
    ),
    # An inpainting UNet (9 input channels: latents, mask, masked-image latents) on the default's
    # components, as SDXL's inpainting checkpoints are.
    "inpaint": dict(unet_in_channels=9),
    # Full SDXL-base sizes with random weights: the same code path at real cost, for GPU
    # benchmarks (no model hub here). ~2.6B UNet parameters: build it with device="cuda".
    "sdxl": dict(
        te1=dict(hidden_size=768, num_attention_heads=12, intermediate_size=3072, num_hidden_layers=12,
                 hidden_act="quick_gelu"),
        te2=dict(hidden_size=1280, num_attention_heads=20, intermediate_size=5120, projection_dim=1280,
                 num_hidden_layers=32),
        unet=dict(
            sample_size=128, block_out_channels=(320, 640, 1280), layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10), attention_head_dim=(5, 10, 20),
            norm_num_groups=32, addition_time_embed_dim=256,
        ),
        vae=dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32,
                 sample_size=1024, scaling_factor=0.13025, force_upcast=True),
        scheduler="EulerDiscreteScheduler",
    ),
}

# Common English pairs and words; each word gets merges that make it a single token.
_PAIRS = ["t h", "i n", "e r", "a n", "o n", "r e", "e n", "a t", "o r", "s t", "a r", "in g</w>"]
_WORDS = ["the", "a", "of", "and", "in", "with", "on", "at", "for", "an", "photo", "cat", "dog", "red", "blue",
          "city", "light", "style", "art", "portrait", "landscape", "mountain", "sunset"]


def _bytes_to_unicode() -> list[str]:
    """CLIP/GPT-2 byte -> printable unicode alphabet, in CLIP's vocab order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _bpe(symbols: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Apply BPE merges (lowest rank first) to a symbol list."""
    while len(symbols) > 1:
        pairs = [(ranks.get(p, 1 << 30), i) for i, p in enumerate(zip(symbols, symbols[1:]))]
        rank, i = min(pairs)
        if rank == 1 << 30:
            break
        symbols = symbols[:i] + [symbols[i] + symbols[i + 1]] + symbols[i + 2:]
    return symbols


def _vocab_and_merges() -> tuple[dict[str, int], list[str]]:
    merges = list(_PAIRS)
    ranks = {tuple(m.split(" ")): i for i, m in enumerate(merges)}
    for word in _WORDS:
        toks = _bpe(list(word[:-1]) + [word[-1] + "</w>"], ranks)
        while len(toks) > 1:  # chain new merges left to right until the word is one token
            ranks[(toks[0], toks[1])] = len(merges)
            merges.append(f"{toks[0]} {toks[1]}")
            toks = [toks[0] + toks[1]] + toks[2:]
    alphabet = _bytes_to_unicode()
    tokens = alphabet + [s + "</w>" for s in alphabet] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(dict.fromkeys(tokens))}, merges


def _write_tokenizer_files(folder: pathlib.Path, vocab: dict[str, int], merges: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")


def _text_config(vocab: dict[str, int], pad_token: str, **kw):
    from transformers import CLIPTextConfig

    kw = {"num_hidden_layers": 2, "hidden_act": "gelu", **kw}
    return CLIPTextConfig(
        vocab_size=len(vocab), max_position_embeddings=77,
        bos_token_id=vocab["<|startoftext|>"], eos_token_id=vocab["<|endoftext|>"],
        pad_token_id=vocab[pad_token], **kw,
    )


def _config(variant: str) -> dict:
    """A variant's knobs; `inpaint` is the default's with its UNet's input widened."""
    cfg = _CONFIGS[variant]
    return {**_CONFIGS["default"], **cfg} if variant == "inpaint" else cfg


def unet_kwargs(variant: str) -> dict:
    """The UNet2DConditionModel arguments of a variant (SDXL's layout: text-time embedding, linear
    projections, the two text encoders' widths)."""
    cfg = _config(variant)
    u = cfg["unet"]
    return dict(in_channels=cfg.get("unet_in_channels", 4), out_channels=4, use_linear_projection=True, addition_embed_type="text_time",
                cross_attention_dim=cfg["te1"]["hidden_size"] + cfg["te2"]["hidden_size"],
                projection_class_embeddings_input_dim=6 * u["addition_time_embed_dim"] + cfg["te2"]["projection_dim"],
                **u)


def write_tiny_pipeline(out_dir: str | os.PathLike, seed: int = 0, variant: str = "default",
                        device: str = "cpu", dtype: str = "fp32") -> pathlib.Path:
    """Write a tiny random SDXL pipeline (diffusers layout, safetensors) to ``out_dir``.

    `device`/`dtype` only matter for the full-size `sdxl` variant: random init of 3.5B
    parameters is fast on a GPU, and fp16 halves what is written."""
    import diffusers
    from diffusers import AutoencoderKL, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

    if variant not in _CONFIGS:
        raise ValueError(f"unknown tiny pipeline variant {variant!r}; allowed: {', '.join(ALL_VARIANTS)}")
    out = pathlib.Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"refusing to write tiny pipeline into non-empty path {out}")
    cfg = _config(variant)
    vocab, merges = _vocab_and_merges()

    with tempfile.TemporaryDirectory() as tmp:
        _write_tokenizer_files(pathlib.Path(tmp), vocab, merges)
        files = (os.path.join(tmp, "vocab.json"), os.path.join(tmp, "merges.txt"))
        tokenizer = CLIPTokenizer(*files, pad_token="<|endoftext|>", model_max_length=77)
        tokenizer_2 = CLIPTokenizer(*files, pad_token="!", model_max_length=77)

    # Each component gets its own seed (seed*16+k); fork_rng leaves the caller's global RNG untouched.
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed * 16)
        text_encoder = CLIPTextModel(_text_config(vocab, tokenizer.pad_token, **cfg["te1"])).eval()
        torch.manual_seed(seed * 16 + 1)
        text_encoder_2 = CLIPTextModelWithProjection(_text_config(vocab, tokenizer_2.pad_token, **cfg["te2"])).eval()
        torch.manual_seed(seed * 16 + 2)
        unet = UNet2DConditionModel(**unet_kwargs(variant)).eval()
        v = cfg["vae"]
        n = len(v["block_out_channels"])
        torch.manual_seed(seed * 16 + 3)
        vae = AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=4, down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n, **v,
        ).eval()

    sched_cls = getattr(diffusers, cfg["scheduler"])
    extra = dict(clip_sample=False, set_alpha_to_one=False) if cfg["scheduler"] == "DDIMScheduler" else {}
    scheduler = sched_cls(**_SDXL_BETAS, **extra)

    torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    for module in (text_encoder, text_encoder_2, unet, vae):
        module.to(dtype=torch_dtype)
    pipe = StableDiffusionXLPipeline(
        vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2, tokenizer=tokenizer,
        tokenizer_2=tokenizer_2, unet=unet, scheduler=scheduler, force_zeros_for_empty_prompt=True,
    )
    out.mkdir(parents=True, exist_ok=True)
    pipe.save_pretrained(out, safe_serialization=True)
    # transformers 5 saves only tokenizer.json; vocab.json + merges.txt keep 4.x (slow) loaders working.
    for name in ("tokenizer", "tokenizer_2"):
        _write_tokenizer_files(out / name, vocab, merges)
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    logger.info("wrote tiny SDXL pipeline (variant=%s, seed=%d, %.1f kB) to %s", variant, seed, size / 1024, out)
    return out
