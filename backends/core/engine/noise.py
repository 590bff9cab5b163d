"""A request's seeded noise, the values diffusers draws (`randn_tensor` on the request's CPU
generator), drawn faster where this torch build allows it.

Why: torch 2.11's CPU normal for fp16 (the GPU image's torch) runs one scalar Box-Muller step
per pair of elements: 2.1 ms for SDXL's 1x4x128x128 latents on the H200 host, two thirds of a
request's admission on the denoise loop's thread (`bench/micro/admission_micro.py`), and euler_a draws
that again every step. Its arithmetic has only 2048 possible inputs per factor (the uniforms are
11-bit: k / 2048), so the draw is the generator's raw integers (`torch.randint`, which takes the
same 32-bit draws in the same order) looked up in tables of that arithmetic.

Exactness is not assumed: `choose` compares each fast recipe with `torch.randn` itself, values
and the generator's state afterwards, on this build, and keeps the first that matches (none on a
build whose fp16 normal is already fast and different, e.g. torch 2.13, where `torch.randn` runs).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
from typing import Callable

import numpy as np
import torch

from backends.core.runtime.host_copies import to_device

log = logging.getLogger(__name__)

CHUNK = 16  # torch's normal_fill transforms 16 uniforms at a time (8 pairs)
UNIFORM_BITS = 11  # std::numeric_limits<Half>::digits: the uniforms are k / 2048


@functools.lru_cache(maxsize=None)
def libm() -> ctypes.CDLL:
    """The C library's float logf, sqrtf, cosf and sinf: what torch's CPU kernels call."""
    lib = ctypes.CDLL(ctypes.util.find_library("m"))
    for name in ("logf", "sqrtf", "cosf", "sinf"):
        getattr(lib, name).restype = ctypes.c_float
        getattr(lib, name).argtypes = [ctypes.c_float]
    return lib


# How normal_fill_16<c10::Half>'s libm calls round: "half" rounds every call's result (and -2 *
# log) to fp16, as c10's overloads for reduced-precision types return the type itself; "float"
# keeps each result in float until a named fp16 intermediate (older c10, through float's overload).
MATHS = ("half", "float")  # "half" is torch 2.11's (the GPU image's)


@functools.lru_cache(maxsize=None)
def half_tables(maths: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each 11-bit uniform k: the pair's radius as fp16 (from u1 = 1 - k/2048) and cos/sin of
    its angle (theta rounded to fp16, from u2 = k/2048), as float32, computed as torch's
    `normal_fill_16<c10::Half>` does under `maths` (see MATHS)."""
    if maths not in MATHS:
        raise ValueError(f"noise: maths {maths!r} is not one of {MATHS}")

    def call(name: str, x: np.ndarray) -> np.ndarray:
        fn = getattr(libm(), name)
        out = np.array([fn(float(v)) for v in x.astype(np.float32)], dtype=np.float32)
        return out.astype(np.float16).astype(np.float32) if maths == "half" else out

    n = 1 << UNIFORM_BITS
    u = np.arange(n, dtype=np.float32) / np.float32(n)  # exact in fp16
    u1 = np.float32(1) - u  # exact in fp16: 1 - k/2048 is representable
    minus_two_log = np.float32(-2) * call("logf", u1)
    if maths == "half":
        minus_two_log = minus_two_log.astype(np.float16).astype(np.float32)
    radius = call("sqrtf", minus_two_log).astype(np.float16).astype(np.float32)
    theta = (2.0 * math.pi * u.astype(np.float64)).astype(np.float16).astype(np.float32)
    return radius, call("cosf", theta), call("sinf", theta)


def _transform_chunks(k: np.ndarray, maths: str) -> np.ndarray:
    """normal_fill_16 over rows of 16 uniforms' integers [n, 16] -> fp16 [n, 16]: element j < 8
    pairs with j + 8, whose uniform gives the angle; (radius * cos(theta)) * std + mean in float,
    with std 1 (exact) and mean 0, kept since -0.0 + 0.0 is +0.0."""
    radius, cos, sin = half_tables(maths)
    r, angle = radius[k[:, :8]], k[:, 8:]
    out = np.empty(k.shape, dtype=np.float16)
    out[:, :8] = r * cos[angle] + np.float32(0)
    out[:, 8:] = r * sin[angle] + np.float32(0)
    return out


def half_by_tables(shape: tuple[int, ...], generator: torch.Generator, maths: str) -> torch.Tensor:
    """`torch.randn(shape, generator=generator, dtype=torch.float16)` on the CPU where torch runs
    normal_fill<c10::Half>: every uniform drawn first, the whole 16-chunks transformed, then, when
    the size is not a multiple of 16, 16 new uniforms for the last 16 elements."""
    size = math.prod(shape)
    if size < CHUNK:  # torch's serial path (double Box-Muller with a cached second value)
        return torch.randn(shape, generator=generator, dtype=torch.float16)
    k = torch.randint(0, 1 << UNIFORM_BITS, (size + (CHUNK if size % CHUNK else 0),), generator=generator,
                      dtype=torch.int32).numpy()
    whole = size // CHUNK * CHUNK
    out = np.empty(size, dtype=np.float16)
    out[:whole] = _transform_chunks(k[:whole].reshape(-1, CHUNK), maths).reshape(-1)
    if size % CHUNK:
        out[size - CHUNK:] = _transform_chunks(k[size:].reshape(1, CHUNK), maths).reshape(-1)
    return torch.from_numpy(out).reshape(shape)


Recipe = Callable[[tuple[int, ...], torch.Generator], torch.Tensor]
RECIPES: dict[str, Recipe] = {f"fp16_tables_{maths}_maths": functools.partial(half_by_tables, maths=maths)
                               for maths in MATHS}
# Shapes the check draws: a latent's, sizes that are not multiples of 16, and a small one.
CHECK_SHAPES = ((1, 4, 128, 128), (1, 4, 97, 75), (1, 4, 3, 5), (1, 3), (2, 4, 16, 16))
CHECK_SEEDS = (0, 1, 12345, 2**31 - 1, 2**63 + 7)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def matches(recipe: Recipe, dtype: torch.dtype, shapes=CHECK_SHAPES, seeds=CHECK_SEEDS) -> bool:
    """Whether `recipe` gives torch.randn's values bit for bit and leaves the generator as it does."""
    for seed in seeds:
        for shape in shapes:
            want_gen = torch.Generator("cpu").manual_seed(seed)
            got_gen = torch.Generator("cpu").manual_seed(seed)
            want = torch.randn(shape, generator=want_gen, dtype=dtype)
            got = recipe(shape, got_gen)
            if got.dtype != dtype or got.shape != want.shape:
                return False
            if not torch.equal(_bits(got), _bits(want)):  # -0.0 is not 0.0 here
                return False
            if not torch.equal(got_gen.get_state(), want_gen.get_state()):
                return False
    return True


@functools.lru_cache(maxsize=None)
def choose(dtype: torch.dtype) -> str | None:
    """The fast recipe for `dtype` on this torch build, or None (torch.randn itself)."""
    if dtype != torch.float16:
        return None
    for name, recipe in RECIPES.items():
        try:
            if matches(recipe, dtype):
                log.info("seeded fp16 noise: %s (checked against torch.randn on torch %s)", name, torch.__version__)
                return name
        except Exception:  # a recipe that cannot run here is one that does not match
            log.exception("seeded noise recipe %s failed its check", name)
    log.info("seeded fp16 noise: torch.randn (no faster recipe matches torch %s)", torch.__version__)
    return None


def cpu_randn(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """`torch.randn(shape, generator=generator, dtype=dtype)` on the CPU, by the fastest recipe
    that gives the same values and generator state on this build."""
    name = choose(dtype)
    if name is None:
        return torch.randn(shape, generator=generator, dtype=dtype)
    return RECIPES[name](tuple(shape), generator)


def randn_like_diffusers(shape: tuple[int, ...], generator: torch.Generator, device: torch.device | str,
                         dtype: torch.dtype) -> torch.Tensor:
    """diffusers' `randn_tensor(shape, generator=<a CPU generator>, device=device, dtype=dtype)`."""
    if generator.device.type != "cpu":
        raise ValueError("noise: the request's generator must be a CPU generator (as diffusers seeds it)")
    return to_device(cpu_randn(shape, generator, dtype), device)
