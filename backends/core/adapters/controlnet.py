"""ControlNet residuals for one request's rows, as StableDiffusionXLControlNetPipeline computes them.

Each ControlNet sees the same scaled latents, timestep, text embeddings and time ids as the UNet,
plus its control image; its residuals are multiplied by its scale while the step lies inside its
guidance window (diffusers' `controlnet_keep`) and summed over ControlNets in order, as
MultiControlNetModel does. Outside the window diffusers multiplies by zero; here the call is
skipped and zeros are used, the same value for less work.

Who computes residuals is a `ResidualProvider`: `LocalControlNets` in the denoiser's own process
(tests, single-GPU deployments) or the ControlNet service reached by BLS (the Triton adapter's
provider). The denoiser submits every call before its encoder half runs and collects the
results before its decoder half, so ControlNets run beside the encoder.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from backends.core.adapters.controlnet_cache import ControlNetCache
from backends.core.request.params import InvalidInput, Limits


@dataclass
class ControlInput:
    """One ControlNet of a request: its name, control image (PIL) and diffusers' parameters."""

    name: str
    image: Any
    scale: float = 1.0
    guidance_start: float = 0.0
    guidance_end: float = 1.0


@dataclass
class PreparedControl:
    name: str
    image: torch.Tensor  # [rows, 3, H, W], the request's rows (duplicated for CFG)
    scale: float
    guidance_start: float
    guidance_end: float
    session: str | None = None  # ControlCall.session

    def keep(self, step: int, steps: int) -> bool:
        return not (step / steps < self.guidance_start or (step + 1) / steps > self.guidance_end)


@dataclass(frozen=True)
class ControlCall:
    """Everything one ControlNet needs for one request's rows at one step."""

    name: str
    scale: float
    image: torch.Tensor  # the control image, or its embedding (embed_image)
    sample: torch.Tensor
    timestep: torch.Tensor
    embeds: torch.Tensor
    pooled: torch.Tensor
    time_ids: torch.Tensor
    # On GPUs the tensors above are produced asynchronously on the denoiser's stream: a provider
    # that reads them from another thread or process waits on this event first.
    ready: Any = None
    # Names this ControlNet of this request for the service, which keeps the image, embeddings and
    # time ids between its steps (adapters/control_sessions.py). None: every call sends them.
    session: str | None = None
    device: Any = None  # where its residuals go; None: the sample's device


Residuals = tuple[list[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Delivered:
    """One call's residuals, and `written`: a CUDA event recorded after the GPU work that writes
    them, for a provider that answers before that work is done (the ControlNet service's mailbox
    calls: the host learning of their end would put its wake-up on every step's critical path);
    the reader's stream waits on it. None: written already."""

    residuals: Residuals
    written: Any = None

MAX_CALL_ROWS = 2  # a call carries one request's rows: one, or two with guidance
MAX_TOKENS = 77  # the text encoders' (prompts are padded or truncated to it)


def check_call(call: ControlCall, limits: Limits, kept: bool = False) -> None:
    """A call is one request's rows at a size the deployment allows, or InvalidInput naming the
    input: Triton cannot hide the ControlNet service, so it is checked on arrival as a request's
    params are (a direct call with 3072 px latents and 64 rows otherwise ran). `kept`: the image
    is what the service kept of an earlier call of its session (maybe its embedding)."""
    if call.sample.dim() != 4:
        raise InvalidInput("sample", f"has shape {tuple(call.sample.shape)}, not [rows, channels, height, width]")
    rows, _, h, w = call.sample.shape
    if not 1 <= rows <= MAX_CALL_ROWS:
        raise InvalidInput("sample", f"has {rows} rows; a call takes one request's 1 or {MAX_CALL_ROWS}")
    ih, iw = call.image.shape[-2:]
    if kept and call.image.shape[1] != 3:  # an embedding (embed_image): the latents' size
        if tuple(call.image.shape) != (rows, call.image.shape[1], h, w):
            raise InvalidInput("sample", f"has shape {tuple(call.sample.shape)}, not the session's {call.image.shape[0]} "
                                         f"rows of {ih}x{iw}")
    else:
        if call.image.dim() != 4 or tuple(call.image.shape[:2]) != (rows, 3):
            raise InvalidInput("image", f"has shape {tuple(call.image.shape)}, not [{rows}, 3, height, width]")
        if ih > limits.max_height or iw > limits.max_width:
            raise InvalidInput("image", f"is {ih}x{iw}, over the limit of {limits.max_height}x{limits.max_width}")
        if h == 0 or w == 0 or ih % h or iw % w or ih // h != iw // w:
            raise InvalidInput("sample", f"{h}x{w} latents do not scale to the {ih}x{iw} image")
    if call.embeds.dim() != 3 or call.embeds.shape[1] > MAX_TOKENS:
        raise InvalidInput("prompt_embeds", f"has shape {tuple(call.embeds.shape)}, not [rows, at most "
                                            f"{MAX_TOKENS} tokens, width]")
    for name, t in (("timestep", call.timestep), ("prompt_embeds", call.embeds), ("pooled_embeds", call.pooled),
                    ("time_ids", call.time_ids)):
        if t.dim() == 0 or t.shape[0] != rows:
            raise InvalidInput(name, f"has shape {tuple(t.shape)}, not the sample's {rows} rows")


class ResidualProvider(Protocol):
    def check(self, name: str) -> None:
        """Raise InvalidInput for a name the adapter store does not hold."""

    def submit(self, call: ControlCall) -> "Future[Delivered]": ...


@functools.cache  # one class: torch.compile's code for one ControlNet serves the others
def _kept_embedding_class():
    from diffusers.models.controlnets.controlnet import ControlNetConditioningEmbedding

    class KeptEmbedding(ControlNetConditioningEmbedding):
        """A ControlNet's `controlnet_cond_embedding`: eight convolutions of the control image at
        up to its full size (at 1024 px, more than the zero convolutions and attention's text
        projections together), whose result is the same at every step of a request. Given an image
        it embeds it, as before; given the embedding (`embed_image`, once per request) it passes
        it on. Only the class changes: the weights and their names stay diffusers'."""

        def forward(self, conditioning):
            if conditioning.shape[1] == self.conv_in.in_channels:
                return super().forward(conditioning)
            return conditioning

    return KeptEmbedding


def keep_embedding(model) -> None:
    """Let `model` take its control image's embedding in place of the image. Not for a ControlNet
    that flips the image's channels first (`bgr`): it would flip the embedding."""
    embedding = model.controlnet_cond_embedding
    if (model.config.controlnet_conditioning_channel_order == "rgb"
            and embedding.conv_in.in_channels != embedding.conv_out.out_channels):
        embedding.__class__ = _kept_embedding_class()


def embed_image(model, image: torch.Tensor) -> torch.Tensor:
    """What `model` takes at every step of a request in place of its control image: the image's
    embedding where the model keeps it (`keep_embedding`), else the image."""
    embedding = model.controlnet_cond_embedding
    return embedding(image) if isinstance(embedding, _kept_embedding_class()) else image


def run_controlnet(model, call: ControlCall) -> Residuals:
    down, mid = model(call.sample, call.timestep, encoder_hidden_states=call.embeds, controlnet_cond=call.image,
                      conditioning_scale=call.scale,
                      added_cond_kwargs={"text_embeds": call.pooled, "time_ids": call.time_ids}, return_dict=False)
    return list(down), mid


class LocalControlNets:
    """Computes residuals in this process, synchronously, from a ControlNetCache; with `graphs`
    (on a GPU) as CUDA graphs (adapters/controlnet_graphs.py)."""

    def __init__(self, cache: ControlNetCache, graphs: bool = False):
        from backends.core.adapters.controlnet_graphs import ControlNetGraphs

        self.cache = cache
        self.graphs = ControlNetGraphs() if graphs else None

    def check(self, name: str) -> None:
        self.cache.store.controlnet(name)

    @torch.inference_mode()
    def submit(self, call: ControlCall) -> "Future[Delivered]":
        future: Future[Delivered] = Future()
        model = self.cache.acquire(call.name)
        try:
            future.set_result(Delivered(self.graphs.run(model, call) if self.graphs else run_controlnet(model, call)))
        except Exception as exc:
            future.set_exception(exc)
        finally:
            self.cache.release(call.name)
        return future


def prepare_control_image(image, width: int, height: int, vae_scale_factor: int) -> torch.Tensor:
    """PIL image -> [1, 3, height, width] float32 in [0, 1], resized as diffusers does."""
    from diffusers.image_processor import VaeImageProcessor

    processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor, do_convert_rgb=True, do_normalize=False)
    return processor.preprocess(image, height=height, width=width).to(torch.float32)


def sum_residuals(results: list[Residuals]) -> Residuals | None:
    """MultiControlNetModel's sum, in the ControlNets' order."""
    if not results:
        return None
    down, mid = results[0]
    for d, m in results[1:]:
        down = [a + b for a, b in zip(down, d)]
        mid = mid + m
    return down, mid
