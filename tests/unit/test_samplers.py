"""The batched samplers track diffusers' own schedulers step for step (CPU, float32: bit for bit).

Each case runs requests that join at different ticks with different step counts, so every batched
call mixes rows at different step indices; each request also runs on its own fresh diffusers
scheduler, stepped the way the denoiser steps it, and the two must agree exactly (torch.equal)
on the UNet input, the UNet timestep and the new latents, at every step.
"""

from __future__ import annotations

import inspect
from typing import Callable

import pytest
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler,
                       EulerDiscreteScheduler, PNDMScheduler)
from diffusers.utils.torch_utils import randn_tensor

from backends.core.engine import samplers
from backends.core.engine.diffusers_schedulers import make_scheduler
from backends.core.engine.samplers import (SamplerPlan, draw_noise, model_timesteps, scale_model_input, step,
                                           unsupported_reason, vectorizable)

SHAPE = (1, 4, 8, 8)  # one request's latents
# SDXL's scheduler/scheduler_config.json (an EulerDiscreteScheduler), the base every sampler is made from.
SDXL = {
    "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear", "num_train_timesteps": 1000,
    "timestep_spacing": "leading", "steps_offset": 1, "prediction_type": "epsilon", "interpolation_type": "linear",
    "use_karras_sigmas": False, "clip_sample": False, "set_alpha_to_one": False, "sample_max_value": 1.0,
    "skip_prk_steps": True, "trained_betas": None,
}


def named(name: str, **base_overrides) -> Callable[[str], object]:
    """A sampler made as the server makes it: make_scheduler(name, the model's own scheduler)."""
    return lambda prediction: make_scheduler(
        name, EulerDiscreteScheduler.from_config({**SDXL, **base_overrides, "prediction_type": prediction}))


def direct(cls, **options) -> Callable[[str], object]:
    return lambda prediction: cls.from_config({**SDXL, "prediction_type": prediction}, **options)


CASES = {
    "default": named("default"),
    "default_trailing": named("default", timestep_spacing="trailing"),
    "euler": named("euler"),
    "euler_karras": direct(EulerDiscreteScheduler, use_karras_sigmas=True),
    "euler_a": named("euler_a"),
    "euler_a_trailing": named("euler_a", timestep_spacing="trailing"),
    "dpmpp_2m_karras": named("dpmpp_2m_karras"),
    "dpmpp_2m": direct(DPMSolverMultistepScheduler, algorithm_type="dpmsolver++", solver_order=2),
    # second-order up to the last step:
    "dpmpp_2m_sigma_min": direct(DPMSolverMultistepScheduler, solver_order=2, lower_order_final=False,
                                 final_sigmas_type="sigma_min", use_karras_sigmas=True),
    "dpmpp_2m_euler_at_final": direct(DPMSolverMultistepScheduler, lower_order_final=False, euler_at_final=True,
                                      final_sigmas_type="sigma_min"),
    "dpmpp_2m_heun": direct(DPMSolverMultistepScheduler, solver_type="heun", use_karras_sigmas=True),
    "dpmpp_1": direct(DPMSolverMultistepScheduler, solver_order=1),
    "ddim": named("ddim"),
    "ddim_trailing": direct(DDIMScheduler, timestep_spacing="trailing", set_alpha_to_one=True),
    "ddim_clip": direct(DDIMScheduler, clip_sample=True),
}


def track(makers: list[Callable[[], object]], steps: list[int], starts: list[int], *, device: str = "cpu",
          dtype: torch.dtype = torch.float32, atol: float = 0.0, rtol: float = 0.0, seed: int = 0,
          forbid_syncs: bool = False) -> int:
    """Run the requests both ways, tick by tick; request r joins at tick starts[r]. Returns the
    number of batched calls. forbid_syncs (CUDA): the batched calls run under
    torch.cuda.set_sync_debug_mode("error"), which raises on any synchronizing call."""
    dev = torch.device(device)
    data = torch.Generator().manual_seed(seed)  # the fake UNet's outputs
    refs, plans, kwargs, ref_x, vec_x = [], [], [], [], []
    for r, (make, n) in enumerate(zip(makers, steps)):
        # The denoiser's way: its own scheduler on the device, a CPU generator drawing the latents first.
        sched = make()
        sched.set_timesteps(n, device=dev)
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(0)
        gen = torch.Generator("cpu").manual_seed(1000 + r)
        ref_x.append(randn_tensor(SHAPE, generator=gen, device=dev, dtype=dtype) * sched.init_noise_sigma)
        accepted = set(inspect.signature(sched.step).parameters)
        kwargs.append({**({"eta": 0.0} if "eta" in accepted else {}),
                       **({"generator": gen} if "generator" in accepted else {})})
        refs.append(sched)
        # The batched way: a plan from another fresh instance, the same seed.
        gen = torch.Generator("cpu").manual_seed(1000 + r)
        plan = SamplerPlan.from_scheduler(make(), n, generator=gen)
        vec_x.append(randn_tensor(SHAPE, generator=gen, device=dev, dtype=dtype) * plan.init_noise_sigma)
        assert torch.equal(vec_x[r], ref_x[r])
        assert plan.num_steps == len(sched.timesteps)
        plans.append(plan)

    index = [0] * len(makers)
    calls = tick = 0
    while any(i < n for i, n in zip(index, steps)):
        rows = [r for r in range(len(makers)) if starts[r] <= tick and index[r] < steps[r]]
        tick += 1
        if not rows:
            continue
        outputs = {r: torch.randn(SHAPE, generator=data).to(dev, dtype) for r in rows}
        ref_in = {}
        for r in rows:
            t = refs[r].timesteps[index[r]]
            ref_in[r] = refs[r].scale_model_input(ref_x[r], t)
            ref_x[r] = refs[r].step(outputs[r], t, ref_x[r], **kwargs[r], return_dict=False)[0]

        batch, at = [plans[r] for r in rows], [index[r] for r in rows]
        sample, model_output = torch.cat([vec_x[r] for r in rows]), torch.cat([outputs[r] for r in rows])
        if forbid_syncs:
            torch.cuda.set_sync_debug_mode("error")
        try:
            timesteps = model_timesteps(batch, at, dev, repeats=[2] * len(rows))
            unet_in = scale_model_input(sample, batch, at)
            new = step(model_output, sample, batch, at)
        finally:
            if forbid_syncs:
                torch.cuda.set_sync_debug_mode("default")
        calls += 1
        for b, r in enumerate(rows):
            where = f"request {r} step {index[r]}/{steps[r]}"
            t = refs[r].timesteps[index[r]].to(torch.float32)
            assert timesteps[2 * b].item() == timesteps[2 * b + 1].item() == t.item(), where
            _close(unet_in[b:b + 1], ref_in[r], atol, rtol, f"{where}: UNet input")
            _close(new[b:b + 1], ref_x[r], atol, rtol, f"{where}: latents")
            vec_x[r] = new[b:b + 1]
            index[r] += 1
    return calls


def _close(got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float, where: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, f"{where}: {got.dtype} {tuple(got.shape)}"
    if atol == rtol == 0.0:
        diff = (got.double() - want.double()).abs().max().item()
        assert torch.equal(got, want), f"{where}: differs by up to {diff:.3g}"
    else:
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{where}: {m}")


# Every case with epsilon; the four named samplers (and the SDXL default) with v_prediction too.
VARIANTS = [(case, "epsilon") for case in CASES] + [
    (case, "v_prediction") for case in ("default", "euler_a", "dpmpp_2m_karras", "dpmpp_2m_sigma_min", "ddim")]


@pytest.mark.parametrize("steps", [1, 2, 7, 20])
@pytest.mark.parametrize("case, prediction", VARIANTS)
def test_tracks_diffusers_exactly(case, prediction, steps):
    make = CASES[case]
    scheduler = make(prediction)
    assert vectorizable(scheduler), unsupported_reason(scheduler)
    # Three requests of one sampler: 1 joins a step after 0, 2 three steps after; other step counts.
    counts = [steps, steps + 1, max(1, steps - 1)]
    calls = track([lambda: make(prediction)] * 3, counts, starts=[0, 1, 3])
    assert calls >= max(counts)


def test_mixed_samplers_in_one_batch():
    """Rows of different samplers interleave (runs of one method are computed together); DPM++
    rows keep their own history across calls where the batch changes around them."""
    names = ["euler_a", "dpmpp_2m_karras", "dpmpp_2m_karras", "ddim", "default", "euler_a", "dpmpp_2m_karras"]
    makers = [(lambda n=n: CASES[n]("epsilon")) for n in names]
    track(makers, steps=[7, 20, 5, 9, 12, 3, 14], starts=[0, 2, 0, 1, 4, 6, 3])


def test_v_prediction_mixed_with_epsilon():
    makers = [lambda: CASES["euler"]("v_prediction"), lambda: CASES["euler"]("epsilon"),
              lambda: CASES["dpmpp_2m_karras"]("v_prediction"), lambda: CASES["dpmpp_2m_karras"]("epsilon")]
    track(makers, steps=[6, 6, 9, 9], starts=[0, 1, 0, 2])


def test_cuda_divides_by_reciprocals(monkeypatch):
    """The CUDA form (multiply by float32 reciprocals, as PyTorch divides by a CPU scalar there)
    runs on the CPU too; here diffusers divides, so the two may differ in the last bit of a
    division: 1e-5 relative after 20 steps is that, not a wrong formula (which would be ~1e-1)."""
    monkeypatch.setattr(samplers, "_kernels", lambda device: samplers._Kernels(recip=True, round_left=False))
    for case in ("default", "euler_a", "dpmpp_2m_karras", "ddim"):
        for prediction in ("epsilon", "v_prediction"):
            make = CASES[case]
            track([lambda: make(prediction)] * 3, [20, 7, 13], starts=[0, 1, 3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", ["default", "euler_a", "dpmpp_2m_karras", "dpmpp_2m_heun", "ddim", "ddim_clip"])
def test_half_precision_tracks_diffusers_exactly(case, dtype):
    """In half precision the dtypes and roundings follow diffusers too: Euler, Euler a and DPM++
    upcast the sample and cast back, DDIM stays in the half dtype, and each coefficient times a
    half tensor rounds as diffusers' 0-d float32 one does on this device."""
    make = CASES[case]
    for prediction in ("epsilon", "v_prediction"):
        track([lambda: make(prediction)] * 3, [7, 5, 6], starts=[0, 1, 2], dtype=dtype)


def test_a_step_reads_no_device_value():
    """On the meta device tensors have no values: any .item(), bool() or comparison of a device
    tensor in a step would raise. Scaling and stepping all four kinds (DPM++ in both orders) runs."""
    makers = [CASES[n]("epsilon") for n in ("default", "euler_a", "dpmpp_2m_karras", "ddim")]
    plans = [SamplerPlan.from_scheduler(s, 10, generator=torch.Generator().manual_seed(0)) for s in makers]
    sample = torch.empty((len(plans), *SHAPE[1:]), device="meta")
    for i in range(3):
        indices = [i, i + 1, i, i + 2]
        assert model_timesteps(plans, indices, "meta").device.type == "meta"
        x = scale_model_input(sample, plans, indices)
        sample = step(x, sample, plans, indices)
        assert sample.device.type == "meta" and sample.shape == (4, *SHAPE[1:])
    assert plans[2].prev_x0.device.type == "meta"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_add_noise_is_diffusers_from_a_begin_index(case, dtype):
    """An edit's start (strength: the schedule from step `start`) and its blend after each step:
    add_noise at the plan's step k is diffusers' add_noise with its begin index set, before any
    step (k = 0) and after k steps, bit for bit."""
    steps, start = 12, 4
    g = torch.Generator().manual_seed(5)
    original, noise = torch.randn(SHAPE, generator=g).to(dtype), torch.randn(SHAPE, generator=g).to(dtype)
    plan = SamplerPlan.from_scheduler(CASES[case]("epsilon"), steps, torch.Generator(), start=start)
    sched = CASES[case]("epsilon")
    sched.set_timesteps(steps)
    indexed = hasattr(sched, "set_begin_index")  # (DDIM reads the timestep given)
    if indexed:
        sched.set_begin_index(start)
    for k in range(steps - start):
        if k and indexed:  # diffusers reads its step index, which each step advances
            sched._step_index = start + k
        want = sched.add_noise(original, noise, sched.timesteps[start + k:start + k + 1])
        got = samplers.add_noise(original, noise, plan, k)
        assert got.dtype == want.dtype and torch.equal(got, want), (case, k)
    assert samplers.add_noise(torch.empty(SHAPE, device="meta"), torch.empty(SHAPE, device="meta"), plan, 1).is_meta


def test_noise_comes_from_each_requests_generator():
    plans = [SamplerPlan.from_scheduler(CASES["euler_a"]("epsilon"), 5, generator=torch.Generator().manual_seed(s))
             for s in (7, 8)] + [SamplerPlan.from_scheduler(CASES["ddim"]("epsilon"), 5)]
    noise = draw_noise(plans, torch.empty((3, *SHAPE[1:]), dtype=torch.float16))
    assert noise.dtype == torch.float16
    for b, s in enumerate((7, 8)):
        assert torch.equal(noise[b:b + 1], torch.randn(SHAPE, generator=torch.Generator().manual_seed(s),
                                                        dtype=torch.float16))
    assert not noise[2].any()  # ddim's row draws nothing
    assert draw_noise(plans[2:], noise[2:]) is None


def test_plan_leaves_the_scheduler_alone():
    scheduler = CASES["dpmpp_2m_karras"]("epsilon")
    plan = SamplerPlan.from_scheduler(scheduler, 12)
    assert scheduler.num_inference_steps is None and plan.num_steps == 12


@pytest.mark.parametrize("scheduler, why", [
    (PNDMScheduler.from_config(SDXL), "PNDMScheduler"),
    (DDIMScheduler.from_config(SDXL, thresholding=True), "thresholding"),
    (DPMSolverMultistepScheduler.from_config(SDXL, algorithm_type="sde-dpmsolver++"), "algorithm_type"),
    (DPMSolverMultistepScheduler.from_config(SDXL, solver_order=3), "solver_order"),
    (EulerDiscreteScheduler.from_config(SDXL, prediction_type="sample"), "prediction_type"),
])
def test_unsupported_configs_fall_back(scheduler, why):
    assert not vectorizable(scheduler)
    assert why in unsupported_reason(scheduler)
    with pytest.raises(ValueError, match=why):
        SamplerPlan.from_scheduler(scheduler, 10)


def test_bad_batches_are_refused():
    plan = SamplerPlan.from_scheduler(CASES["euler"]("epsilon"), 4)
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match="outside"):
        step(x, x, [plan], [4])
    with pytest.raises(ValueError, match="one row per request"):
        step(torch.zeros(2, *SHAPE[1:]), torch.zeros(2, *SHAPE[1:]), [plan], [0])
    with pytest.raises(ValueError, match="Generator"):
        SamplerPlan.from_scheduler(CASES["euler_a"]("epsilon"), 4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["default", "euler_a", "dpmpp_2m_karras", "ddim"])
def test_tracks_diffusers_exactly_on_cuda(case, dtype):
    """On CUDA, in the denoiser's dtypes, against diffusers stepping device tensors as the
    denoiser does; the batched calls must not synchronize with the device."""
    make = CASES[case]
    for prediction in ("epsilon", "v_prediction"):
        track([lambda: make(prediction)] * 3, [20, 7, 13], starts=[0, 1, 3], device="cuda", dtype=dtype,
              forbid_syncs=True)


@pytest.mark.parametrize("name", ["default", "euler", "euler_a", "dpmpp_2m_karras", "ddim"])
def test_scheduler_prototypes_give_what_a_fresh_scheduler_gives(name):
    """The denoiser's schedulers are copies of a prototype per (name, steps): each steps exactly as one
    built and set up afresh, and stepping one (multistep history, step index) leaves the next alone."""
    from backends.core.engine.diffusers_schedulers import SchedulerPrototypes

    base = EulerDiscreteScheduler.from_config(SDXL)
    prototypes = SchedulerPrototypes(base, torch.device("cpu"), size=2)

    def run(sched, seed: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(seed)
        latents = randn_tensor(SHAPE, generator=generator) * sched.init_noise_sigma
        for t in sched.timesteps:
            noise = torch.sin(sched.scale_model_input(latents, t) + t / 1000)  # any deterministic "UNet"
            latents = sched.step(noise, t, latents, generator=generator, return_dict=False)[0]
        return latents

    def fresh(steps: int):
        sched = make_scheduler(name, base)
        sched.set_timesteps(steps)
        if hasattr(sched, "set_begin_index"):
            sched.set_begin_index(0)
        return sched

    for steps, seed in ((12, 0), (12, 1), (7, 2), (5, 3), (12, 4)):  # size 2: (12) is evicted, then rebuilt
        assert torch.equal(run(prototypes.fresh(name, steps), seed), run(fresh(steps), seed)), (steps, seed)
    assert list(prototypes._prototypes) == [(name, 5), (name, 12)]
    assert prototypes.shared(name, 12) is prototypes.shared(name, 12)
    assert prototypes.fresh(name, 12) is not prototypes.shared(name, 12)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["default", "euler_a", "dpmpp_2m_karras", "ddim"])
def test_add_noise_on_cuda_is_diffusers_without_a_sync(case):
    """An edit's blend on the device (fp16): diffusers' add_noise to the bit, and no host sync
    (diffusers' own copies its table to the device and indexes it on every call)."""
    steps, start = 12, 4
    g = torch.Generator().manual_seed(6)
    original, noise = (torch.randn(SHAPE, generator=g).to("cuda", torch.float16) for _ in range(2))
    plan = SamplerPlan.from_scheduler(CASES[case]("epsilon"), steps, torch.Generator(), start=start)
    sched = CASES[case]("epsilon")
    sched.set_timesteps(steps, device="cuda")
    if hasattr(sched, "set_begin_index"):
        sched.set_begin_index(start)
        sched._step_index = start + 3
    want = sched.add_noise(original, noise, sched.timesteps[start + 3:start + 4])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = samplers.add_noise(original, noise, plan, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got, want)
