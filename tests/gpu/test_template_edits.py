"""Template edits (runtime/token_subsets.py) on the GPU's fast runtime, which serves their steps on
its eager fallback: a recorded edit and the same edit reusing the recording both match the eager
runtime's exact edit (fp32, 1e-4 relative, test_fast_runtime.py's whole-request tolerance), and
the reused one computed a subset of the block tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.core.engine.requests import DenoiseJob, EditInputs
from backends.core.request.params import Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.vae_encoding import EditEncoder
from tests.gpu.test_fast_runtime import eager_and_graphs_denoisers, no_tf32, rel_err, repo  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


def test_a_reused_template_edit_on_the_fast_runtime_matches_the_exact_edit(repo):  # noqa: F811
    import numpy as np

    where = Placement("cuda:0", "fp32")
    eager, fast, fast_runtime, encoder = eager_and_graphs_denoisers(repo)
    params = validate({"prompt": "a red door", "steps": 5, "width": 64, "height": 64, "seed": 4, "strength": 1.0},
                      Limits())
    embeds, pooled = encoder.encode(params)
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 8:40] = 255
    vae = EditEncoder(repo / "vae_decoder" / "1", where)
    edit = EditInputs(**vae.encode(image, mask), scaling_factor=vae.scaling_factor, strength=1.0)

    def run(engine, template):
        job = DenoiseJob("r", params, embeds, pooled, workflow="inpaint",
                         edit=dataclasses.replace(edit, template=template))
        with engine.on_stream():
            state = engine.start(job)
            while state.index < len(state.timesteps):
                engine.step([state])
        return torch.from_numpy(engine.result(state)), state.template_use

    want, _ = run(eager, None)
    recorded, use = run(fast, "door")
    assert use == "recorded" and rel_err(recorded, want) <= 1e-4
    reused, use = run(fast, "door")
    assert use == "reused" and rel_err(reused, want) <= 1e-4
    context = fast_runtime.eager.subsets
    assert 0 < context.computed_tokens < context.all_tokens
