"""The tensor side of the denoiser: per-request state and one batched denoising step.

Each request carries its own diffusers scheduler and CPU generator, so a step can batch
requests that sit at different timesteps: every row gets its own timestep, text embeddings and
time ids, and each request's scheduler steps its own slice. The maths is diffusers'
StableDiffusionXLPipeline.__call__, written out for many requests at once.
"""

from __future__ import annotations

import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from diffusers.utils.torch_utils import randn_tensor

from .artifacts import load_unet_halves
from .placement import Placement
from .params import GenerateParams
from .schedulers import make_scheduler

VAE_SCALE_FACTOR_FILE = "vae_scale_factor.json"


@dataclass
class DenoiseJob:
    """One request as the denoiser receives it (text already encoded, negative rows first)."""

    request_id: str
    params: GenerateParams
    prompt_embeds: np.ndarray  # [rows, tokens, dim]
    pooled_embeds: np.ndarray  # [rows, pooled dim]
    is_cancelled: Callable[[], bool] = lambda: False
    arrival: float = field(default_factory=time.monotonic)


@dataclass
class RequestState:
    job: DenoiseJob
    scheduler: Any
    timesteps: torch.Tensor
    latents: torch.Tensor
    embeds: torch.Tensor
    pooled: torch.Tensor
    time_ids: torch.Tensor
    step_kwargs: dict[str, Any] = field(default_factory=dict)
    index: int = 0
    max_batch: int = 1  # most requests it shared one step with (itself included)

    @property
    def rows(self) -> int:
        return self.embeds.shape[0]


class TorchDenoiser:
    def __init__(self, folder: str | Path, placement: Placement):
        folder = Path(folder)
        self.placement = placement
        self.device = torch.device(placement.device)
        self.dtype = placement.torch_dtype
        self.unet, self.encoder, self.decoder = load_unet_halves(folder, placement)
        self.base_scheduler = _load_scheduler(folder / "scheduler")
        self.vae_scale_factor = json.loads((folder / VAE_SCALE_FACTOR_FILE).read_text())["vae_scale_factor"]
        self.latent_channels = self.unet.config.in_channels

    def latent_shape(self, params: GenerateParams) -> tuple[int, int]:
        return params.height // self.vae_scale_factor, params.width // self.vae_scale_factor

    def start(self, job: DenoiseJob) -> RequestState:
        p = job.params
        rows = 2 if p.cfg else 1
        if job.prompt_embeds.shape[0] != rows or job.pooled_embeds.shape[0] != rows:
            raise ValueError(f"expected {rows} rows of text embeddings, got {job.prompt_embeds.shape[0]}")
        sched = make_scheduler(p.scheduler, self.base_scheduler)
        sched.set_timesteps(p.steps, device=self.device)
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(0)
        generator = torch.Generator("cpu").manual_seed(p.seed)
        h, w = self.latent_shape(p)
        latents = randn_tensor((1, self.latent_channels, h, w), generator=generator, device=self.device,
                               dtype=self.dtype)
        latents = latents * sched.init_noise_sigma

        accepted = set(inspect.signature(sched.step).parameters)
        step_kwargs = {}
        if "eta" in accepted:
            step_kwargs["eta"] = 0.0
        if "generator" in accepted:
            step_kwargs["generator"] = generator

        time_ids = torch.tensor([[p.height, p.width, 0, 0, p.height, p.width]], dtype=self.dtype,
                                device=self.device).repeat(rows, 1)
        return RequestState(
            job=job, scheduler=sched, timesteps=sched.timesteps, latents=latents,
            embeds=torch.from_numpy(job.prompt_embeds).to(self.device, self.dtype),
            pooled=torch.from_numpy(job.pooled_embeds).to(self.device, self.dtype),
            time_ids=time_ids, step_kwargs=step_kwargs)

    @torch.inference_mode()
    def step(self, states: list[RequestState]) -> None:
        """One denoising step for requests of one latent shape, as one UNet batch."""
        inputs, timesteps = [], []
        for s in states:
            t = s.timesteps[s.index]
            x = torch.cat([s.latents] * s.rows)
            inputs.append(s.scheduler.scale_model_input(x, t))
            timesteps.append(t.to(torch.float32).expand(s.rows))
        sample = torch.cat(inputs)
        embeds = torch.cat([s.embeds for s in states])
        emb, mid, skips = self.encoder(sample, torch.cat(timesteps), embeds,
                                       torch.cat([s.pooled for s in states]), torch.cat([s.time_ids for s in states]))
        noise = self.decoder(emb, mid, skips, embeds)

        for s, pred in zip(states, noise.split([s.rows for s in states])):
            if s.rows == 2:
                uncond, text = pred.chunk(2)
                pred = uncond + s.job.params.guidance_scale * (text - uncond)
            t = s.timesteps[s.index]
            s.latents = s.scheduler.step(pred, t, s.latents, **s.step_kwargs, return_dict=False)[0]
            s.index += 1
            s.max_batch = max(s.max_batch, len(states))

    @staticmethod
    def result(state: RequestState) -> np.ndarray:
        return state.latents.float().cpu().numpy()


def _load_scheduler(folder: Path):
    """The model folder's own scheduler class, by the name in its config (diffusers classes only)."""
    import diffusers

    config = json.loads((folder / "scheduler_config.json").read_text())
    name = config.get("_class_name", "")
    cls = getattr(diffusers, name, None)
    if cls is None or not name.endswith("Scheduler"):
        raise ValueError(f"{folder}: scheduler class {name!r} is not a diffusers scheduler")
    return cls.from_config(config)
