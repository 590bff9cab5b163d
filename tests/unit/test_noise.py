"""Seeded noise (backends/core/engine/noise.py): whatever recipe this build picks, the values and
the generator's state are torch.randn's, bit for bit; the fp16 tables recipe is checked against
an element-by-element transcription of torch 2.11's CPU normal_fill for c10::Half."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.core.engine import noise

SHAPES = [(1, 4, 32, 32), (1, 4, 5, 7), (1, 3, 3, 3), (2, 4, 16, 16), (1, 5), (1, 16)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_randn_is_torch_randn_and_leaves_the_generator_as_it_does(shape, dtype):
    for seed in (0, 7, 2**40 + 3):
        want_gen, got_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        want = torch.randn(shape, generator=want_gen, dtype=dtype)
        got = noise.cpu_randn(shape, got_gen, dtype)
        assert torch.equal(_bits(got), _bits(want))
        assert torch.equal(got_gen.get_state(), want_gen.get_state())


def _normal_fill_16(d: list, libm, maths: str) -> None:
    """aten/src/ATen/native/cpu/DistributionTemplates.h, normal_fill_16<c10::Half>, std 1, mean 0;
    `maths` "half": each libm call's result (and -2 * log) rounded to fp16."""
    f = (lambda x: np.float32(np.float16(x))) if maths == "half" else np.float32
    for j in range(8):
        u1 = np.float16(np.float32(1) - np.float32(d[j]))
        u2 = d[j + 8]
        radius = np.float16(libm.sqrtf(f(np.float32(-2) * f(libm.logf(float(u1))))))
        theta = np.float16(2.0 * math.pi * float(u2))
        d[j] = np.float16(np.float32(radius) * f(libm.cosf(float(theta))) + np.float32(0))
        d[j + 8] = np.float16(np.float32(radius) * f(libm.sinf(float(theta))) + np.float32(0))


def _normal_fill_half(shape, seed, maths):
    """normal_fill<c10::Half> element by element: every uniform (k / 2048, one 32-bit draw each),
    the whole 16-chunks transformed, then 16 new uniforms for the last 16 elements."""
    libm = noise.libm()
    generator = torch.Generator().manual_seed(seed)
    size = math.prod(shape)
    k = torch.randint(0, 2048, (size + (16 if size % 16 else 0),), generator=generator).tolist()
    data = [np.float16(x / 2048) for x in k[:size]]
    for i in range(0, size - 15, 16):
        chunk = data[i:i + 16]
        _normal_fill_16(chunk, libm, maths)
        data[i:i + 16] = chunk
    if size % 16:
        chunk = [np.float16(x / 2048) for x in k[size:]]
        _normal_fill_16(chunk, libm, maths)
        data[size - 16:] = chunk
    return np.array(data, dtype=np.float16).reshape(shape), generator


@pytest.mark.parametrize("maths", noise.MATHS)
@pytest.mark.parametrize("shape", [(1, 4, 8, 8), (1, 4, 5, 7), (1, 3, 3, 3), (1, 16), (1, 17)])
def test_fp16_tables_are_normal_fill_element_by_element(shape, maths):
    for seed in (0, 3):
        want, want_gen = _normal_fill_half(shape, seed, maths)
        got_gen = torch.Generator().manual_seed(seed)
        got = noise.half_by_tables(shape, got_gen, maths).numpy()
        assert np.array_equal(got.view(np.int16), want.view(np.int16))
        assert torch.equal(got_gen.get_state(), want_gen.get_state())


def test_the_half_maths_tables_give_what_torch_2_11_drew_on_the_gpu_image():
    """torch.randn((1, 4, 128, 128), dtype=torch.float16) of seeds 0 and 1 under the GPU image's
    torch 2.11 (its first 4096 values, which a draw of (1, 4, 32, 32) shares: every uniform is
    drawn before any is transformed), recorded there; the float maths differ from it."""
    recorded = np.load(Path(__file__).parent / "data" / "torch_2_11_randn_fp16.npz")
    for seed in (0, 1):
        got = noise.half_by_tables((1, 4, 32, 32), torch.Generator().manual_seed(seed), "half")
        assert np.array_equal(got.numpy().view(np.int16).reshape(-1), recorded[f"seed{seed}"])
        other = noise.half_by_tables((1, 4, 32, 32), torch.Generator().manual_seed(seed), "float")
        assert not np.array_equal(other.numpy().view(np.int16).reshape(-1), recorded[f"seed{seed}"])


def test_a_recipe_is_kept_only_when_values_and_generator_state_both_match():
    def right(shape, generator):
        return torch.randn(shape, generator=generator, dtype=torch.float16)

    def spares_the_generator(shape, generator):  # same values, generator not advanced
        return torch.randn(shape, generator=torch.Generator().set_state(generator.get_state()), dtype=torch.float16)

    def one_off(shape, generator):
        out = torch.randn(shape, generator=generator, dtype=torch.float16)
        out.view(-1)[-1] += 1
        return out

    assert noise.matches(right, torch.float16)
    assert not noise.matches(spares_the_generator, torch.float16)
    assert not noise.matches(one_off, torch.float16)


def test_only_fp16_has_a_faster_recipe():
    assert noise.choose(torch.float32) is None
    assert noise.choose(torch.float16) in (None, *noise.RECIPES)


def test_a_generator_on_a_device_is_refused():
    class OnDevice:
        device = torch.device("cuda")

    with pytest.raises(ValueError, match="CPU generator"):
        noise.randn_like_diffusers((1, 4, 8, 8), OnDevice(), "cpu", torch.float16)


@pytest.mark.gpu
def test_the_gpu_images_torch_takes_the_tables_recipe():
    """The GPU image's torch 2.11 draws fp16 noise by a scalar normal_fill that one of the tables
    recipes transcribes; 64 seeds against torch.randn there, beyond what `choose` checks at load."""
    if not torch.__version__.startswith("2.11."):
        pytest.skip(f"the tables transcribe torch 2.11's fp16 normal; this is torch {torch.__version__}")
    name = noise.choose(torch.float16)
    assert name is not None
    assert noise.matches(noise.RECIPES[name], torch.float16, seeds=range(64))
