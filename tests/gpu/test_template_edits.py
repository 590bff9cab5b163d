"""Template edits (runtime/token_subsets.py) on the GPU's fast runtime, which records on its eager
fallback and reuses through CUDA graphs of the static token subsets: a recorded edit and the same
edit reusing the recording both match the eager runtime's exact edit (fp32, 1e-4 relative,
test_fast_runtime.py's whole-request tolerance), and the reused one computed a subset of the block
tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from backends.core.engine.builder import template_batch
from backends.core.engine.requests import DenoiseJob, EditInputs
from backends.core.request.params import Limits, validate
from backends.core.runtime.config import RuntimeConfig
from backends.core.runtime.placement import Placement
from backends.core.stages.vae_encoding import EditEncoder
from tests.gpu.test_fast_runtime import eager_and_graphs_denoisers, no_tf32, rel_err, repo  # noqa: F401  (fixtures)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind,streamed,convs", [("graphs", False, False), ("graphs", True, False),
                                                ("compiled", False, False), ("graphs", False, True),
                                                ("compiled", False, True)])
def test_a_reused_template_edit_on_the_fast_runtime_matches_the_exact_edit(repo, kind, streamed, convs):  # noqa: F811
    """`streamed`: the recording is over the device's budget, kept in pinned host memory and
    copied to the device a step ahead on the load stream (engine/template_stream.py).
    `compiled`: the reusing steps' graphs are of the compiled halves, compiled at warmup.
    `convs`: the ResNet blocks on the mask's box too (RuntimeConfig.conv_subsets), in the graphs."""
    import numpy as np

    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.template_cache import TemplateCache

    where = Placement("cuda:0", "fp32")
    eager, fast, fast_runtime, encoder = eager_and_graphs_denoisers(
        repo, RuntimeConfig(kind=kind, warmup_template_edits=kind == "compiled", conv_subsets=convs))
    if kind == "compiled":  # as a server warms up at load (64 px: an 8 x 8 latent)
        fast_runtime.warmup(template_batch(fast_runtime.weights_module, torch.device("cuda:0"), torch.float32),
                            [(8, 8)])
    if streamed:
        fast = TorchDenoiser(repo / "denoiser" / "1", where, runtime=fast_runtime,
                             templates=TemplateCache("cuda:0", device_bytes=1, host_bytes=1 << 30))
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
    graph_steps = fast_runtime.stats.graph_steps
    reused, use = run(fast, "door")
    assert use == "reused" and rel_err(reused, want) <= 1e-4
    assert fast_runtime.stats.graph_steps - graph_steps == 5  # every reusing step a graph's replay
    reusing = [b for b in fast_runtime.buckets.values() if b.subsets is not None]
    assert reusing and all(fast_runtime._halves(b)[2] == (kind == "compiled") for b in reusing)
    context = fast_runtime.eager.subsets
    assert 0 < context.computed_tokens < context.all_tokens
    assert all((b.subsets.box is not None) == convs for b in reusing)
    if convs:
        assert 0 < context.conv_computed < context.conv_all
    again, use = run(fast, "door")  # the captured graphs again, refilled
    assert use == "reused" and rel_err(again, want) <= 1e-4
    if streamed:
        assert fast.templates.stats.hits["host"] == 2 and fast.templates.nbytes("device") == 0
        torch.cuda.synchronize()
        stalls = fast.templates.read_stalls()  # the compute stream's waits for the copies, GPU time
        print(f"streamed edits: {stalls * 1e3:.3f} ms of stall over 10 steps")
        assert 0 <= stalls < 1.0 and not fast.templates._waits  # every wait read once its events ended


def test_a_block_serving_reusing_rows_never_waits_for_the_device():
    """The gather indices are made once per step and copied from pinned memory: a block that runs a
    recording row beside a reusing one issues no synchronizing call (each block used to copy its
    row indices from pageable memory, a wait for the stream at every block of every step)."""
    from diffusers.models.attention import BasicTransformerBlock

    from backends.core.runtime.token_subsets import (RECORD, REUSE, TemplateActivations, TokenLayout, TokenRow,
                                                     computed_tokens, install)

    g = torch.Generator("cuda").manual_seed(0)
    block = BasicTransformerBlock(64, 2, 32, cross_attention_dim=32).cuda().eval()
    context = install(block)
    x = torch.randn(2, 64, 64, device="cuda", generator=g)  # an 8x8 token grid
    text = torch.randn(2, 7, 32, device="cuda", generator=g)
    mask = torch.zeros(1, 1, 8, 8, device="cuda")
    mask[..., 2:5, 3:6] = 1
    template, recording = TemplateActivations(1), TemplateActivations(1)
    with torch.inference_mode():
        template.put(0, 0, 0, BasicTransformerBlock.forward(block, x[:1], encoder_hidden_states=text[:1])[0])
        layout = TokenLayout((TokenRow(RECORD, recording, 0, 0), TokenRow(REUSE, template, 0, 0,
                                                                            computed_tokens(mask, 1))))
        torch.cuda.synchronize()
        context.layout = layout
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = block(x, encoder_hidden_states=text)
            again = block(x, encoder_hidden_states=text)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            context.layout = None
    assert torch.equal(out, again) and context.computed_tokens == 2 * 9
    # The reusing row: the recording outside its 9 masked tokens, the recording row its own output.
    keep = mask.reshape(-1) == 0
    assert torch.equal(out[1][keep], template.get(0, 0, 0)[keep])
    assert torch.equal(recording.get(0, 0, 0), out[0])


def test_reusing_buckets_past_the_limit_let_go_of_their_graphs_and_are_captured_again(repo):  # noqa: F811
    """With room for one reusing bucket, edits of two mask sizes take turns: each capture releases
    the other's graphs (RuntimeConfig.subset_graph_limit), and an edit captured again computes what
    it did the first time (fp32, 1e-5 relative: the same kernels, captured anew), the encoder's
    outputs shared by both buckets."""
    import numpy as np

    eager, fast, fast_runtime, encoder = eager_and_graphs_denoisers(
        repo, RuntimeConfig(kind="graphs", subset_graph_limit=1))
    params = validate({"prompt": "a red door", "steps": 3, "width": 64, "height": 64, "seed": 4, "strength": 1.0},
                      Limits())
    embeds, pooled = encoder.encode(params)
    image = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    vae = EditEncoder(repo / "vae_decoder" / "1", Placement("cuda:0", "fp32"))

    def run(side):
        mask = np.zeros((64, 64), np.uint8)
        mask[8:8 + side, 8:8 + side] = 255
        edit = EditInputs(**vae.encode(image, mask), scaling_factor=vae.scaling_factor, strength=1.0,
                          template="door")
        with fast.on_stream():
            state = fast.start(DenoiseJob("r", params, embeds, pooled, workflow="inpaint", edit=edit))
            while state.index < len(state.timesteps):
                fast.step([state])
        return torch.from_numpy(fast.result(state)), state.template_use

    assert run(16)[1] == "recorded"
    small, use = run(16)
    assert use == "reused" and fast_runtime.stats.released == 0
    large, use = run(40)  # another token share: its bucket takes the only room
    assert use == "reused" and fast_runtime.stats.released == 1
    again, use = run(16)
    assert use == "reused" and fast_runtime.stats.released == 2
    assert len([b for b in fast_runtime.buckets.values() if b.subsets is not None]) == 1
    assert rel_err(again, small) <= 1e-5 and rel_err(large, small) > 1e-5
