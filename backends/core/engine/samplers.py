"""Sampler arithmetic for a whole batch of requests at once, each request at its own step.

diffusers' schedulers step one request at a time: per request and per step a few Python calls,
a dozen small kernels, and host syncs (Euler compares a sigma tensor with Python floats, DDIM
indexes a CPU table with a device timestep). Here the per-request part happens on the host,
from tables made once at request start, and the device sees a few broadcast ops per step for the
whole batch:

    plan = SamplerPlan.from_scheduler(make_scheduler(name, base), steps, generator)  # per request
    x_in = scale_model_input(latents, plans, indices)          # [B, C, H, W], one row per request
    ...UNet, guidance...                                      # -> pred [B, C, H, W]
    latents = step(pred, latents, plans, indices)

The sampler's batch is one row per request: row b is request b's latents ([1, C, H, W] in
diffusers) and its guided prediction, not the UNet's rows (classifier-free guidance gives a
request two UNet rows and one sampler row). Row b sits at step `indices[b]` of its own plan.

Exactness. The tables are diffusers' own: a private CPU twin of the request's scheduler runs
`set_timesteps`, and every per-step coefficient is evaluated with the very expressions of the
class's `step` on the twin's 0-d float32 CPU tensors (once per config and step count; requests
share them). The tensor arithmetic then repeats diffusers' operations in their order and dtypes:
Euler, Euler a and DPM++ upcast the sample to float32 and cast the result back, DDIM does not
upcast, and a coefficient times a half tensor gives half. Where PyTorch treats diffusers' 0-d CPU
coefficient specially, ours (a [B, 1, ...] device tensor) imitates it (`_Kernels`): CUDA divides
by a CPU scalar by multiplying with its float32 reciprocal, and the CPU rounds a left-hand scalar
to a half tensor's dtype. So results equal diffusers' bit for bit: tested on the CPU in float32,
float16 and bfloat16; on CUDA by a test marked gpu.

No host sync inside a step: coefficients are Python floats looked up on the host, packed into one
[B, k] float32 tensor and copied to the device once (pinned, non-blocking); euler_a's noise is
drawn on the CPU from each request's own generator (as diffusers does for a CPU generator) and
copied once the same way. Nothing here calls `.item()`, converts a device tensor to a Python
number or bool, or branches on a device value (tests/unit/test_samplers.py runs a step on the
meta device, which has no values, to show it).

Supported (`unsupported_reason` says why anything else is not, so the caller can fall back to
diffusers' own per-request stepping): EulerDiscreteScheduler and EulerAncestralDiscreteScheduler
with epsilon or v_prediction (Euler without churn, the step's default); DPMSolverMultistepScheduler
with algorithm_type "dpmsolver++", solver_order 1 or 2, either solver_type, any sigma schedule,
lower_order_final, euler_at_final and final_sigmas_type, epsilon or v_prediction, no thresholding;
DDIMScheduler at eta 0 with epsilon or v_prediction, clip_sample included, no thresholding.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler)

from backends.core.engine.noise import cpu_randn
from backends.core.runtime.host_copies import to_device

log = logging.getLogger(__name__)

Kind = Literal["euler", "euler_a", "dpmpp", "ddim"]
_KINDS: dict[type, Kind] = {
    EulerDiscreteScheduler: "euler",
    EulerAncestralDiscreteScheduler: "euler_a",
    DPMSolverMultistepScheduler: "dpmpp",
    DDIMScheduler: "ddim",
}
_PREDICTIONS = ("epsilon", "v_prediction")
WIDTH = 6  # coefficients per row in the one host-to-device copy of a step (the widest kind's)

# Coefficient columns, per kind ("div" columns are divisors; see the module docstring):
#   euler    0: eps sigma_hat | v c_out   1: v div sigma^2+1   2: div sigma_hat   3: dt
#   euler_a  0: eps sigma     | v c_out   1: v div sigma^2+1   2: div sigma       3: dt   4: sigma_up
#   dpmpp    0: eps sigma_t   | v alpha_t 1: eps div alpha_t | v sigma_t   2: c_sample   3: c_d0
#            4: c_d1 (0 on first-order rows)   5: 1/r0 (0 on first-order rows)
#   ddim     0: eps beta^.5   | v alpha^.5   1: eps div alpha^.5 | v beta^.5   2: alpha_prev^.5   3: c_dir
_DIVISORS: dict[tuple[Kind, str], tuple[int, ...]] = {
    ("euler", "epsilon"): (2,), ("euler", "v_prediction"): (1, 2),
    ("euler_a", "epsilon"): (2,), ("euler_a", "v_prediction"): (1, 2),
    ("dpmpp", "epsilon"): (1,), ("dpmpp", "v_prediction"): (),
    ("ddim", "epsilon"): (1,), ("ddim", "v_prediction"): (),
}


@dataclass(frozen=True)
class Method:
    """What fixes the shape of a step's arithmetic: rows with equal methods are computed together."""

    kind: Kind
    prediction: str  # "epsilon" | "v_prediction"
    clip: float | None = None  # DDIM's clip_sample_range when clip_sample is set


def unsupported_reason(scheduler) -> str | None:
    """Why `scheduler` cannot be stepped here (None: it can)."""
    kind = _KINDS.get(type(scheduler))
    if kind is None:
        return f"{type(scheduler).__name__} is not one of {', '.join(c.__name__ for c in _KINDS)}"
    cfg = scheduler.config
    if cfg.prediction_type not in _PREDICTIONS:
        return f"prediction_type {cfg.prediction_type!r} (supported: {', '.join(_PREDICTIONS)})"
    if kind == "dpmpp":
        if cfg.algorithm_type != "dpmsolver++":
            return f"algorithm_type {cfg.algorithm_type!r} (supported: 'dpmsolver++')"
        if cfg.solver_order not in (1, 2):
            return f"solver_order {cfg.solver_order} (supported: 1, 2)"
        if cfg.solver_type not in ("midpoint", "heun"):
            return f"solver_type {cfg.solver_type!r}"
        if cfg.variance_type is not None:
            return f"variance_type {cfg.variance_type!r} (supported: None)"
        if getattr(cfg, "use_flow_sigmas", False):
            return "use_flow_sigmas (add_noise's alpha and sigma differ)"
    if kind in ("dpmpp", "ddim") and cfg.thresholding:
        return "thresholding (dynamic thresholding needs a per-row quantile)"
    return None


def vectorizable(scheduler) -> bool:
    """Whether `scheduler` can be stepped here; if not, the caller steps it with diffusers."""
    reason = unsupported_reason(scheduler)
    if reason is not None:
        log.debug("sampler: %s falls back to per-request stepping: %s", type(scheduler).__name__, reason)
    return reason is None


@dataclass(frozen=True)
class SamplerTables:
    """diffusers' schedule for one sampler config and step count, as Python floats (shared by
    every request with that config and step count)."""

    method: Method
    timesteps: tuple[float, ...]  # the UNet's timestep per step, as diffusers gives it
    init_noise_sigma: float  # initial latents = standard normal * this
    # Per step, WIDTH coefficients (layout above); `coefs_recip` has the divisor columns as
    # float32 reciprocals (for CUDA).
    coefs: tuple[tuple[float, ...], ...]
    coefs_recip: tuple[tuple[float, ...], ...]
    # scale_model_input's divisor per step (None: the input is not scaled), and its reciprocal.
    scale: tuple[float, ...] | None
    scale_recip: tuple[float, ...] | None
    # DPM++: whether step i takes the second-order update once a previous prediction exists.
    second_order: tuple[bool, ...]
    # What add_noise reads at step i: the sigma (Euler, Euler a, DPM++), or DDIM's alpha_cumprod
    # at the step's timestep; float32, as diffusers' tables hold them.
    noising: tuple[float, ...]

    @classmethod
    def compute(cls, scheduler, num_inference_steps: int) -> SamplerTables:
        """From a CPU twin of `scheduler` after set_timesteps, by the expressions of its step."""
        kind = _KINDS[type(scheduler)]
        twin = type(scheduler).from_config(scheduler.config)
        twin.set_timesteps(num_inference_steps)  # on the CPU: no device tensors, no syncs
        cfg = twin.config
        n = len(twin.timesteps)
        v = cfg.prediction_type == "v_prediction"
        rows = [_COEFFICIENTS[kind](twin, i, n, v) for i in range(n)]
        divisors = _DIVISORS[(kind, cfg.prediction_type)]
        scale = (tuple(float((twin.sigmas[i] ** 2 + 1) ** 0.5) for i in range(n))
                 if kind in ("euler", "euler_a") else None)
        return cls(
            method=Method(kind, cfg.prediction_type,
                          float(cfg.clip_sample_range) if kind == "ddim" and cfg.clip_sample else None),
            timesteps=tuple(float(t) for t in twin.timesteps.tolist()),
            init_noise_sigma=float(twin.init_noise_sigma),
            coefs=tuple(rows),
            coefs_recip=tuple(tuple(_recip(c) if j in divisors else c for j, c in enumerate(r)) for r in rows),
            scale=scale,
            scale_recip=None if scale is None else tuple(_recip(x) for x in scale),
            second_order=tuple(kind == "dpmpp" and cfg.solver_order == 2 and not _dpm_lower_order_final(cfg, i, n)
                               for i in range(n)),
            noising=tuple(float(twin.alphas_cumprod[int(twin.timesteps[i])]) if kind == "ddim"
                          else float(twin.sigmas[i]) for i in range(n)),
        )


_TABLES: dict[tuple, SamplerTables] = {}
_TABLES_KEPT = 512  # configs x step counts; more only when many step counts are in use


def _tables(scheduler, num_inference_steps: int) -> SamplerTables:
    """The tables, computed once per (class, config, steps): they take ~0.5 ms a step (a CPU twin,
    a few dozen scalar ops), and a request start should cost the loop next to nothing."""
    config = json.dumps(dict(scheduler.config), sort_keys=True,
                        default=lambda o: o.tolist() if hasattr(o, "tolist") else repr(o))  # e.g. trained_betas
    key = (type(scheduler), config, num_inference_steps)
    tables = _TABLES.get(key)
    if tables is None:
        if len(_TABLES) >= _TABLES_KEPT:
            _TABLES.clear()
        tables = _TABLES[key] = SamplerTables.compute(scheduler, num_inference_steps)
    return tables


@dataclass(eq=False)
class SamplerPlan:
    """One request's sampler: its tables, and its state across steps. Its steps are counted from
    `start`, the schedule's first step it runs (an edit's strength leaves out those before)."""

    tables: SamplerTables
    generator: torch.Generator | None = None  # euler_a's noise source (the request's CPU generator)
    prev_x0: torch.Tensor | None = None  # DPM++ state: the last data prediction, [1, C, H, W] on the device
    start: int = 0

    @property
    def method(self) -> Method:
        return self.tables.method

    @property
    def timesteps(self) -> tuple[float, ...]:
        return self.tables.timesteps

    @property
    def init_noise_sigma(self) -> float:
        return self.tables.init_noise_sigma

    @property
    def num_steps(self) -> int:
        return len(self.tables.timesteps) - self.start

    @classmethod
    def from_scheduler(cls, scheduler, num_inference_steps: int,
                       generator: torch.Generator | None = None, start: int = 0) -> SamplerPlan:
        """The plan of a request that samples like `scheduler` for `num_inference_steps` steps,
        from step `start` on (diffusers' begin index). `scheduler` is left untouched. euler_a
        needs `generator`: the request's CPU generator, after the initial latents were drawn from it."""
        reason = unsupported_reason(scheduler)
        if reason is not None:
            raise ValueError(f"sampler: cannot vectorize {type(scheduler).__name__}: {reason}")
        if _KINDS[type(scheduler)] == "euler_a" and (generator is None or generator.device.type != "cpu"):
            raise ValueError("sampler: euler_a needs the request's CPU torch.Generator for its noise")
        tables = _tables(scheduler, num_inference_steps)
        if not 0 <= start < len(tables.timesteps):
            raise ValueError(f"sampler: start {start} outside 0..{len(tables.timesteps) - 1}")
        return cls(tables, generator, start=start)


def model_timesteps(plans: Sequence[SamplerPlan], indices: Sequence[int], device: torch.device | str,
                    repeats: Sequence[int] | None = None) -> torch.Tensor:
    """The UNet's float32 timesteps for the batch, `repeats[b]` times for request b (its UNet
    rows, e.g. 2 with guidance), in one copy."""
    _check_batch(plans, indices)
    repeats = repeats or [1] * len(plans)
    values = [p.timesteps[p.start + i] for p, i, r in zip(plans, indices, repeats) for _ in range(r)]
    return _to_device(values, torch.device(device))


def scale_model_input(sample: torch.Tensor, plans: Sequence[SamplerPlan], indices: Sequence[int]) -> torch.Tensor:
    """The UNet input for `sample` [B, ...] (row b at step indices[b] of plans[b]): Euler and
    Euler a divide by sqrt(sigma^2 + 1); DPM++ and DDIM pass the sample through."""
    _check_batch(plans, indices, sample)
    if all(p.tables.scale is None for p in plans):
        return sample
    k = _kernels(sample.device)
    # Rows that are not scaled divide by 1.0, which is exact.
    values = [1.0 if p.tables.scale is None else (p.tables.scale_recip if k.recip else p.tables.scale)[p.start + i]
              for p, i in zip(plans, indices)]
    scale = _to_device(values, sample.device).reshape(-1, *[1] * (sample.dim() - 1))
    return _div(sample, scale, k)


def draw_noise(plans: Sequence[SamplerPlan], like: torch.Tensor) -> torch.Tensor | None:
    """euler_a's noise for one step, like diffusers draws it: per request, from its own CPU
    generator, in the model output's shape [1, ...] and dtype; zeros on the other rows. None when
    no row needs noise."""
    if not any(p.method.kind == "euler_a" for p in plans):
        return None
    shape = (1, *like.shape[1:])
    parts = [cpu_randn(shape, p.generator, like.dtype)
             if p.method.kind == "euler_a" else torch.zeros(shape, dtype=like.dtype) for p in plans]
    return to_device(torch.cat(parts), like.device)


def step(model_output: torch.Tensor, sample: torch.Tensor, plans: Sequence[SamplerPlan], indices: Sequence[int],
         noise: torch.Tensor | None = None) -> torch.Tensor:
    """One sampler step for the batch: row b of `sample` (request b's latents) moves from step
    indices[b] to the next, given row b of `model_output` (its guided prediction). Returns the new
    latents [B, ...]. `noise` is euler_a's (see `draw_noise`; drawn here when not given). DPM++
    plans keep their last data prediction for the next step."""
    _check_batch(plans, indices, sample)
    if model_output.shape != sample.shape:
        raise ValueError(f"sampler: model_output {tuple(model_output.shape)} and sample {tuple(sample.shape)} differ")
    k = _kernels(sample.device)
    second = [p.prev_x0 is not None and p.tables.second_order[p.start + i] for p, i in zip(plans, indices)]
    values = []
    for p, i, sec in zip(plans, indices, second):
        row = (p.tables.coefs_recip if k.recip else p.tables.coefs)[p.start + i]
        if p.method.kind == "dpmpp" and not sec:
            row = (*row[:4], 0.0, 0.0)  # first-order update: the D1 term adds exactly zero
        values.append(row)
    coef = _to_device(values, sample.device)
    if noise is None:
        noise = draw_noise(plans, model_output)
    elif noise.shape != sample.shape:
        raise ValueError(f"sampler: noise {tuple(noise.shape)} does not match sample {tuple(sample.shape)}")

    outputs = []
    for start, stop in _runs(plans):
        method = plans[start].method
        rows = slice(start, stop)
        # [n, WIDTH, 1, 1, 1]: c[:, j] is column j broadcast over the row's latents.
        c = coef[rows].reshape(stop - start, WIDTH, *[1] * (sample.dim() - 1))
        mo, x = model_output[rows], sample[rows]
        v = method.prediction == "v_prediction"
        if method.kind in ("euler", "euler_a"):
            out = _euler(mo, x, c, v, k, None if method.kind == "euler" else noise[rows])
        elif method.kind == "dpmpp":
            out = _dpmpp(mo, x, c, v, k, plans[rows], second[rows])
        else:
            out = _ddim(mo, x, c, v, k, method.clip)
        outputs.append(out)
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def add_noise(original: torch.Tensor, noise: torch.Tensor, plan: SamplerPlan, index: int) -> torch.Tensor:
    """The scheduler's add_noise at the plan's step `index` (counted as `step` counts them), as
    diffusers' begin-indexed schedulers compute it, without a host sync: the one value they look up
    (a sigma, or DDIM's alpha_cumprod) is cast to the samples' dtype on the host, as diffusers casts
    its table, and copied once; the arithmetic is theirs."""
    value = torch.tensor([plan.tables.noising[plan.start + index]], dtype=torch.float32).to(original.dtype)
    v = to_device(value, original.device).reshape(1, *[1] * (original.dim() - 1))
    kind = plan.method.kind
    if kind in ("euler", "euler_a"):
        return original + noise * v
    if kind == "dpmpp":  # _sigma_to_alpha_sigma_t
        alpha_t = 1 / ((v**2 + 1) ** 0.5)
        sigma_t = v * alpha_t
        return alpha_t * original + sigma_t * noise
    return v**0.5 * original + (1 - v) ** 0.5 * noise  # DDIM: sqrt(alpha_cumprod), sqrt(1 - alpha_cumprod)


# --- the arithmetic, as diffusers 0.42.1 writes it ------------------------------------------
# diffusers' coefficients are 0-d float32 CPU tensors; ours are [n, 1, ...] float32 device
# tensors. `_mul`, `_mul_by` and `_div` make ours round like theirs (see `_Kernels`): float32
# maths, the result in the tensor operand's dtype.


def _euler(mo, sample, c, v, k, noise):
    """EulerDiscreteScheduler.step (gamma = 0) and, given noise, EulerAncestralDiscreteScheduler.step."""
    # Upcast to avoid precision issues when computing prev_sample
    sample = sample.to(torch.float32)
    if v:
        pred_original_sample = _mul_by(mo, c[:, 0]) + _div(sample, c[:, 1], k)
    else:
        pred_original_sample = sample - _mul(c[:, 0], mo, k)
    derivative = _div(sample - pred_original_sample, c[:, 2], k)
    prev_sample = sample + derivative * c[:, 3]
    if noise is not None:
        prev_sample = prev_sample + _mul_by(noise, c[:, 4])
    return prev_sample.to(mo.dtype)


def _dpmpp(mo, sample, c, v, k, plans, second):
    """DPMSolverMultistepScheduler.step for dpmsolver++: convert_model_output, then the first- or
    second-order update per row (first-order rows have c_d1 = 1/r0 = 0)."""
    # convert_model_output works on the sample as given (not upcast)
    if v:
        x0 = _mul(c[:, 0], sample, k) - _mul(c[:, 1], mo, k)
    else:
        x0 = _div(sample - _mul(c[:, 0], mo, k), c[:, 1], k)
    sample = sample.to(torch.float32)
    x_t = c[:, 2] * sample - _mul(c[:, 3], x0, k)
    if any(second):
        # m1 for a first-order row is its own x0, so D1 = 0 * 0 there.
        m1 = torch.cat([p.prev_x0 if sec else x0[b:b + 1] for b, (p, sec) in enumerate(zip(plans, second))])
        d1 = _mul(c[:, 5], x0 - m1, k)
        x_t = x_t - _mul(c[:, 4], d1, k)
    for b, p in enumerate(plans):
        p.prev_x0 = x0[b:b + 1]
    return x_t.to(x0.dtype)


def _ddim(mo, sample, c, v, k, clip):
    """DDIMScheduler.step with eta = 0 (no upcast: the maths runs in the inputs' dtype)."""
    if v:
        pred_original_sample = _mul(c[:, 0], sample, k) - _mul(c[:, 1], mo, k)
        pred_epsilon = _mul(c[:, 0], mo, k) + _mul(c[:, 1], sample, k)
    else:
        pred_original_sample = _div(sample - _mul(c[:, 0], mo, k), c[:, 1], k)
        pred_epsilon = mo
    if clip is not None:
        pred_original_sample = pred_original_sample.clamp(-clip, clip)
    pred_sample_direction = _mul(c[:, 3], pred_epsilon, k)
    return _mul(c[:, 2], pred_original_sample, k) + pred_sample_direction


@dataclass(frozen=True)
class _Kernels:
    """What PyTorch's kernels on the sample's device do with a 0-d float32 CPU operand."""

    # CUDA: x / c multiplies by c's float32 reciprocal (computed on the host).
    recip: bool
    # CPU: c * x with c first and x in half or bfloat16 rounds c to x's dtype first (x * c and
    # x / c keep c in float32; CUDA keeps it in float32 everywhere).
    round_left: bool


def _kernels(device: torch.device) -> _Kernels:
    return _Kernels(recip=device.type == "cuda", round_left=device.type == "cpu")


_REDUCED = (torch.float16, torch.bfloat16)


def _mul(coef: torch.Tensor, x: torch.Tensor, k: _Kernels) -> torch.Tensor:
    """diffusers' `coef * x`."""
    if k.round_left and x.dtype in _REDUCED:
        coef = coef.to(x.dtype)
    return (coef * x).to(x.dtype)


def _mul_by(x: torch.Tensor, coef: torch.Tensor) -> torch.Tensor:
    """diffusers' `x * coef`."""
    return (x * coef).to(x.dtype)


def _div(x: torch.Tensor, coef: torch.Tensor, k: _Kernels) -> torch.Tensor:
    """diffusers' `x / coef` (coef holds the reciprocal where k.recip)."""
    return (x * coef if k.recip else x / coef).to(x.dtype)


# --- tables: each coefficient by the expression of the class's own step ---------------------


def _euler_row(twin, i: int, n: int, v: bool) -> tuple[float, ...]:
    sigma = twin.sigmas[i]
    gamma = 0.0  # s_churn = 0, the step's default: no churn
    sigma_hat = sigma * (gamma + 1)
    dt = twin.sigmas[i + 1] - sigma_hat
    if v:
        return _pad(-sigma / (sigma**2 + 1) ** 0.5, sigma**2 + 1, sigma_hat, dt)
    return _pad(sigma_hat, 0.0, sigma_hat, dt)


def _euler_a_row(twin, i: int, n: int, v: bool) -> tuple[float, ...]:
    sigma = twin.sigmas[i]
    sigma_from = twin.sigmas[i]
    sigma_to = twin.sigmas[i + 1]
    sigma_up = (sigma_to**2 * (sigma_from**2 - sigma_to**2) / sigma_from**2) ** 0.5
    sigma_down = (sigma_to**2 - sigma_up**2) ** 0.5
    dt = sigma_down - sigma
    if v:
        return _pad(-sigma / (sigma**2 + 1) ** 0.5, sigma**2 + 1, sigma, dt, sigma_up)
    return _pad(sigma, 0.0, sigma, dt, sigma_up)


def _dpmpp_row(twin, i: int, n: int, v: bool) -> tuple[float, ...]:
    # convert_model_output
    alpha, sigma = twin._sigma_to_alpha_sigma_t(twin.sigmas[i])
    convert = (alpha, sigma) if v else (sigma, alpha)
    # dpm_solver_first_order_update
    sigma_t, sigma_s = twin.sigmas[i + 1], twin.sigmas[i]
    alpha_t, sigma_t = twin._sigma_to_alpha_sigma_t(sigma_t)
    alpha_s, sigma_s = twin._sigma_to_alpha_sigma_t(sigma_s)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    c_sample = sigma_t / sigma_s
    c_d0 = alpha_t * (torch.exp(-h) - 1.0)
    c_d1, inv_r0 = 0.0, 0.0
    if i >= 1 and twin.config.solver_order == 2:
        # multistep_dpm_solver_second_order_update (its c_sample and c_d0 equal the first-order ones)
        sigma_s1 = twin.sigmas[i - 1]
        alpha_s1, sigma_s1 = twin._sigma_to_alpha_sigma_t(sigma_s1)
        lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
        h_0 = lambda_s - lambda_s1
        r0 = h_0 / h
        inv_r0 = 1.0 / r0
        if twin.config.solver_type == "midpoint":
            c_d1 = 0.5 * (alpha_t * (torch.exp(-h) - 1.0))
        else:  # heun adds its term: x - (-c) * D1 equals x + c * D1 exactly
            c_d1 = -(alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0))
    return _pad(*convert, c_sample, c_d0, c_d1, inv_r0)


def _ddim_row(twin, i: int, n: int, v: bool) -> tuple[float, ...]:
    timestep = int(twin.timesteps[i])
    prev_timestep = timestep - twin.config.num_train_timesteps // twin.num_inference_steps
    alpha_prod_t = twin.alphas_cumprod[timestep]
    alpha_prod_t_prev = twin.alphas_cumprod[prev_timestep] if prev_timestep >= 0 else twin.final_alpha_cumprod
    beta_prod_t = 1 - alpha_prod_t
    variance = twin._get_variance(timestep, prev_timestep)
    eta = 0.0
    std_dev_t = eta * variance ** (0.5)
    c_dir = (1 - alpha_prod_t_prev - std_dev_t**2) ** (0.5)
    c_prev = alpha_prod_t_prev ** (0.5)
    if v:
        return _pad(alpha_prod_t**0.5, beta_prod_t**0.5, c_prev, c_dir)
    return _pad(beta_prod_t ** (0.5), alpha_prod_t ** (0.5), c_prev, c_dir)


_COEFFICIENTS = {"euler": _euler_row, "euler_a": _euler_a_row, "dpmpp": _dpmpp_row, "ddim": _ddim_row}


def _dpm_lower_order_final(cfg, i: int, n: int) -> bool:
    """DPMSolverMultistepScheduler.step's `lower_order_final`: the last step is first-order."""
    return (i == n - 1) and (cfg.euler_at_final or (cfg.lower_order_final and n < 15)
                             or cfg.final_sigmas_type == "zero")


# --- host side -------------------------------------------------------------------------------


def _pad(*values) -> tuple[float, ...]:
    """CPU 0-d float32 tensors (or numbers) as Python floats (exact: a double holds any float32),
    padded to WIDTH."""
    return tuple(float(x) for x in values) + (0.0,) * (WIDTH - len(values))


def _recip(value: float) -> float:
    """1 / value in float32, as CUDA's division by a CPU scalar computes it."""
    return float(np.float32(1.0) / np.float32(value))


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """Host floats as one float32 tensor on `device`: one copy, non-blocking from pinned memory."""
    return to_device(torch.tensor(values, dtype=torch.float32, pin_memory=device.type == "cuda"), device)


def _runs(plans: Sequence[SamplerPlan]) -> list[tuple[int, int]]:
    """Maximal stretches of consecutive rows with one method (order a batch by method for few)."""
    runs, start = [], 0
    for b in range(1, len(plans) + 1):
        if b == len(plans) or plans[b].method != plans[start].method:
            runs.append((start, b))
            start = b
    return runs


def _check_batch(plans: Sequence[SamplerPlan], indices: Sequence[int], sample: torch.Tensor | None = None) -> None:
    if len(plans) != len(indices):
        raise ValueError(f"sampler: {len(plans)} plans but {len(indices)} indices")
    if not plans:
        raise ValueError("sampler: empty batch")
    if sample is not None and sample.shape[0] != len(plans):
        raise ValueError(f"sampler: {sample.shape[0]} rows but {len(plans)} plans (one row per request)")
    for p, i in zip(plans, indices):
        if not 0 <= i < p.num_steps:
            raise ValueError(f"sampler: step index {i} outside 0..{p.num_steps - 1}")
