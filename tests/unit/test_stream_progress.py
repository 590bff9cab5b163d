"""Progress for easel_stream, below Triton: the loop reports each step of a request that asks (the
latents every N steps), before its result and without changing it; previews are the latent-to-RGB
approximation at the latent grid's size."""

from __future__ import annotations

import io
import threading

import numpy as np
from PIL import Image

from backends.core.engine.requests import StepProgress
from backends.core.engine.loop import DenoiseLoop, DenoiseResult
from backends.core.stages.preview import SDXL_RGB_BIAS, preview_pixels, preview_png
from tests.unit.test_denoise_loop import engines, job  # noqa: F401  (engines: a fixture)


def ask(event) -> None:
    """A job's on_step that asks for progress: run_in_order puts its recorder in its place."""


def run_in_order(engine, jobs) -> list:
    """Every progress event and result the loop hands out, in the order it does."""
    events: list = []
    done = threading.Condition()

    def record(event) -> None:
        with done:
            events.append(event)
            done.notify_all()

    for j in jobs:
        if j.on_step is not None:
            j.on_step = record
    loop = DenoiseLoop(engine, record)
    loop.start()
    for j in jobs:
        loop.submit(j)
    with done:
        assert done.wait_for(lambda: sum(isinstance(e, DenoiseResult) for e in events) == len(jobs), 120)
    loop.shutdown()
    return events


def test_progress_comes_per_step_before_the_result_and_changes_nothing(engines):  # noqa: F811
    engine, encoder = engines
    plain = job(encoder, "plain", steps=5, seed=2)
    streamed = job(encoder, "streamed", steps=5, seed=2, on_step=ask, preview_every=2)
    events = run_in_order(engine, [plain, streamed])
    mine = [e for e in events if e.request_id == "streamed"]
    *progress, result = mine
    assert all(isinstance(p, StepProgress) for p in progress) and isinstance(result, DenoiseResult)
    assert [(p.step, p.steps) for p in progress] == [(i, 5) for i in range(1, 6)]
    assert [p.step for p in progress if p.latents is not None] == [2, 4]
    assert not any(isinstance(e, StepProgress) for e in events if e.request_id == "plain")
    assert result.error is None
    (other,) = [e for e in events if e.request_id == "plain" and isinstance(e, DenoiseResult)]
    np.testing.assert_allclose(result.latents, other.latents, atol=5e-5)  # batched together: same maths
    snapshot = progress[3].latents.numpy()
    assert snapshot.shape == result.latents.shape and not np.array_equal(snapshot, result.latents)


def test_the_last_step_snapshot_is_the_result(engines):  # noqa: F811
    engine, encoder = engines
    events = run_in_order(engine, [job(encoder, "a", steps=3, on_step=ask, preview_every=1)])
    *progress, result = events
    assert [p.step for p in progress] == [1, 2, 3]
    np.testing.assert_array_equal(progress[-1].latents.numpy(), result.latents)


def test_preview_is_the_linear_approximation_at_latent_size():
    zeros = np.zeros((1, 4, 8, 16), np.float32)  # h=8, w=16
    pixels = preview_pixels(zeros)
    assert pixels.shape == (8, 16, 3) and pixels.dtype == np.uint8
    expected = np.round((SDXL_RGB_BIAS + 1) * 127.5).astype(np.uint8)
    assert (pixels == expected).all(), (pixels[0, 0], expected)
    image = Image.open(io.BytesIO(preview_png(zeros)))
    assert image.format == "PNG" and image.size == (16, 8) and image.mode == "RGB"
    assert (np.asarray(image) == pixels).all()
    # the first channel drives brightness: a large positive one saturates white
    bright = zeros.copy()
    bright[0, 0] = 10.0
    assert (preview_pixels(bright) == 255).all()


def test_preview_of_other_latent_channels_stretches_three():
    latents = np.arange(2 * 6 * 5, dtype=np.float32).reshape(1, 6, 2, 5)
    pixels = preview_pixels(latents)
    assert pixels.shape == (2, 5, 3) and pixels.min() == 0 and pixels.max() == 255
