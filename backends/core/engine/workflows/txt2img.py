"""Text to image, with ControlNets and LoRAs: diffusers' StableDiffusionXLPipeline.__call__ and
StableDiffusionXLControlNetPipeline's, written out for many requests at once.

Each request carries its own noise schedule and CPU generator, so a step can batch requests that
sit at different timesteps: every row gets its own timestep, text embeddings and time ids, and
each request's sampler steps its own slice.
"""

from __future__ import annotations

import inspect

import torch

from backends.core.adapters.controlnet import PreparedControl, prepare_control_image
from backends.core.engine import noise
from backends.core.engine.requests import DenoiseJob, RequestState
from backends.core.engine.samplers import SamplerPlan, model_timesteps, scale_model_input, vectorizable
from backends.core.engine.samplers import step as sampler_step
from backends.core.engine.workflows.base import Model
from backends.core.request.params import InvalidInput
from backends.core.runtime.host_copies import to_device
from backends.core.runtime.specs import unet_pooled_dim

# Tokens of a prompt's embeddings: the text encoder pads every prompt to CLIP's model_max_length.
TEXT_TOKENS = 77


class Txt2Img:
    name = "txt2img"

    def __init__(self, model: Model):
        self.model = model

    def latent_shape(self, params) -> tuple[int, int]:
        return params.height // self.model.vae_scale_factor, params.width // self.model.vae_scale_factor

    def start(self, job: DenoiseJob) -> RequestState:
        m, p = self.model, job.params
        if m.unet_config.in_channels != m.unet_config.out_channels:
            raise InvalidInput("image", f"this model's UNet takes {m.unet_config.in_channels} input channels (an "
                                        "inpainting UNet): a request needs an image and a mask_image")
        self.check_text(job)
        generator = torch.Generator("cpu").manual_seed(p.seed)
        sched, plan, step_kwargs = self.sampler(p, generator)
        h, w = self.latent_shape(p)
        latents = noise.randn_like_diffusers((1, m.unet_config.in_channels, h, w), generator, m.device, m.dtype)
        latents = latents * sched.init_noise_sigma
        return self.state(job, sched, sched.timesteps, latents, step_kwargs, plan)

    def sampler(self, params, generator, begin: int | None = None) -> tuple:
        """(scheduler, plan, step kwargs) of a request: its vectorized plan over the shared
        scheduler, or (None for a plan) diffusers stepping the request's own copy. `begin`: the
        schedule's first step the request runs (an edit's strength; diffusers' begin index)."""
        m = self.model
        sched = m.schedulers.shared(params.scheduler, params.steps)
        if vectorizable(sched):  # the plan reads the shared scheduler; nothing steps it
            return sched, SamplerPlan.from_scheduler(sched, params.steps, generator, start=begin or 0), {}
        sched = m.schedulers.fresh(params.scheduler, params.steps)
        if begin is not None and hasattr(sched, "set_begin_index"):
            sched.set_begin_index(begin * sched.order)
        return sched, None, self.step_kwargs(sched, generator)

    def check_text(self, job: DenoiseJob) -> None:
        """Checked before the request joins a batch: embeddings of another shape would fail the
        whole batch's step, everyone's (the denoiser can be called directly, with anything)."""
        cfg, rows = self.model.unet_config, 2 if job.params.cfg else 1
        for name, array, shape in (("prompt_embeds", job.prompt_embeds, (rows, TEXT_TOKENS, cfg.cross_attention_dim)),
                                   ("pooled_embeds", job.pooled_embeds, (rows, unet_pooled_dim(cfg)))):
            if tuple(array.shape) != shape:
                raise InvalidInput(name, f"has shape {tuple(array.shape)}, expected {shape} for these params")

    @staticmethod
    def step_kwargs(sched, generator) -> dict:
        """What diffusers' pipelines pass the scheduler's step (prepare_extra_step_kwargs)."""
        accepted, kwargs = set(inspect.signature(sched.step).parameters), {}
        if "eta" in accepted:
            kwargs["eta"] = 0.0
        if "generator" in accepted:
            kwargs["generator"] = generator
        return kwargs

    def state(self, job: DenoiseJob, sched, timesteps, latents, step_kwargs, plan, cls=RequestState, **fields):
        """The request's state: its sampler and latents as given, its text, time ids and control
        images on the device."""
        m, p = self.model, job.params
        rows = 2 if p.cfg else 1
        controls = []
        for i, c in enumerate(job.controls):
            m.controls.check(c.name)  # unknown names fail here, before any step
            image = prepare_control_image(c.image, p.width, p.height, m.vae_scale_factor)
            controls.append(PreparedControl(c.name, to_device(torch.cat([image] * rows), m.device).to(m.dtype),
                                            c.scale, c.guidance_start, c.guidance_end, session=f"{job.request_id}/{i}"))

        # Every copy from pinned memory: admitted beside running requests, it must not wait for their steps.
        time_ids = to_device(torch.tensor([[p.height, p.width, 0, 0, p.height, p.width]], dtype=m.dtype
                                          ).repeat(rows, 1), m.device)
        return cls(
            job=job, workflow=self, scheduler=sched, timesteps=timesteps, latents=latents,
            embeds=to_device(torch.from_numpy(job.prompt_embeds), m.device).to(m.dtype),
            pooled=to_device(torch.from_numpy(job.pooled_embeds), m.device).to(m.dtype),
            time_ids=time_ids, step_kwargs=step_kwargs, controls=controls, plan=plan, **fields)

    def model_input(self, states):
        if all(s.plan is not None for s in states):
            return self._model_input(states)
        return self._model_input_per_request(states)

    def _model_input(self, states):
        """The UNet's rows for requests stepped by vectorized samplers: one scale and one
        timestep copy for the whole batch, no host sync."""
        plans, indices = [s.plan for s in states], [s.index for s in states]
        x = torch.cat([s.latents for s in states])
        x = scale_model_input(x, plans, indices)
        rows = [s.rows for s in states]
        x = x.repeat_interleave(rows[0], dim=0) if len(set(rows)) == 1 else torch.cat(
            [x[b:b + 1].expand(r, *x.shape[1:]) for b, r in enumerate(rows)])
        return x, model_timesteps(plans, indices, self.model.device, repeats=rows)

    @staticmethod
    def _model_input_per_request(states):
        inputs, timesteps = [], []
        for s in states:
            t = s.timesteps[s.index]
            x = torch.cat([s.latents] * s.rows)
            if s.plan is None:
                inputs.append(s.scheduler.scale_model_input(x, t))
                timesteps.append(t.to(torch.float32).expand(s.rows))
            else:
                inputs.append(scale_model_input(x, [s.plan] * s.rows, [s.index] * s.rows))
                timesteps.append(model_timesteps([s.plan], [s.index], x.device, repeats=[s.rows]))
        return torch.cat(inputs), torch.cat(timesteps)

    def tokens(self, states) -> None:
        return None  # every token of every row

    def prefetch(self, job) -> None:
        pass  # nothing to fetch ahead

    def loading(self, state) -> None:
        return None  # ready at admission

    def adopt(self, state) -> None:
        pass

    def advance(self, states, noise, failed) -> None:
        """Guidance and the sampler step: batched when every request shares a vectorized sampler
        and one guidance, else request by request."""
        if all(s.plan is not None for s in states) and not failed and _same_guidance(states):
            self._advance(states, noise)
            return
        for s, pred in zip(states, noise.split([s.rows for s in states])):
            if s.job.request_id not in failed:
                self._advance([s], pred)

    @staticmethod
    def _advance(states, noise) -> None:
        """Guidance and the sampler step for `states` (their UNet rows in `noise`, in order):
        batched when they share a vectorized sampler call and guidance scale, else one request."""
        if states[0].rows == 2:
            b = len(states)
            pred = noise.view(b, 2, *noise.shape[1:])
            uncond, text = pred[:, 0], pred[:, 1]
            pred = uncond + states[0].job.params.guidance_scale * (text - uncond)
        else:
            pred = noise
        if states[0].plan is not None:
            latents = torch.cat([s.latents for s in states]) if len(states) > 1 else states[0].latents
            latents = sampler_step(pred, latents, [s.plan for s in states], [s.index for s in states])
            for b, s in enumerate(states):
                s.latents = latents[b:b + 1]
            return
        (s,) = states
        s.latents = s.scheduler.step(pred, s.timesteps[s.index], s.latents, **s.step_kwargs, return_dict=False)[0]


def _same_guidance(states) -> bool:
    """One batched guidance needs one scale and one row count (diffusers multiplies by a Python
    float: a per-row tensor of scales would round differently)."""
    return len({(s.rows, s.job.params.guidance_scale) for s in states}) == 1
