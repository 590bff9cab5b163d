"""Template edits (runtime/token_subsets.py, engine/template_cache.py) on the tiny models, CPU fp32:
the first edit of a template records its blocks' outputs, a later one computes only its masked
tokens in the transformer blocks and takes the rest from the recording.

- The same request again reproduces the exact edit (1e-4, the inpainting tests' tolerance: the
  masked tokens' queries run as a subset, the same dot products) while computing fewer tokens.
- Another prompt reuses the recording: approximate; its deviation from its own exact edit is
  measured and bounded here (the final latents' largest difference within 25% of their largest
  magnitude on random tiny weights; real weights are measured on the GPU).
- Another seed is another key: it records instead, and equals its exact edit.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.step_batcher import BatcherConfig
from backends.core.runtime.placement import Placement
from export.repository import ExportOptions, export_repository
from tests.export.test_inpaint_engine import SIZE, TOL, edit_job
from tests.unit.test_denoise_loop import run

ANY_SHARES = BatcherConfig(max_share_ratio=None)  # reusing edits of any token shares in one step

APPROXIMATE = 0.25  # the deviation bound of a reused recording, of the exact latents' largest magnitude


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    import torch
    from diffusers import StableDiffusionXLInpaintPipeline

    from backends.core.stages.text_encoding import PromptEncoder

    folder = tmp_path_factory.mktemp("template")
    repo = export_repository(tiny_model, folder / "repo", ExportOptions())
    exact = TorchDenoiser(repo / "denoiser" / "1", Placement())
    cached = TorchDenoiser(repo / "denoiser" / "1", Placement())
    encoder = PromptEncoder(repo / "text_encoder" / "1", Placement())
    pipe = StableDiffusionXLInpaintPipeline.from_pretrained(tiny_model, torch_dtype=torch.float32)
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (SIZE, SIZE, 3), dtype=np.uint8)
    mask = np.zeros((SIZE, SIZE), np.uint8)
    mask[16:48, 8:40] = 255
    return exact, cached, encoder, pipe, image, mask


def job(setup, rid, seed=3, prompt=None, template="shop-front"):
    exact, cached, encoder, pipe, image, mask = setup
    j = edit_job((cached, encoder, pipe, image, mask), rid, "euler", 1.0, seed=seed)
    if prompt is not None:
        params = dataclasses.replace(j.params, prompt=prompt)
        j = dataclasses.replace(j, params=params, **dict(zip(("prompt_embeds", "pooled_embeds"), encoder.encode(params))))
    return dataclasses.replace(j, edit=dataclasses.replace(j.edit, template=template))


def latents(engine, j):
    (result,) = run(engine, [j])
    assert result.error is None, result.error
    return result.latents


def test_a_template_is_recorded_once_and_its_edits_compute_their_masked_tokens(setup):
    exact, cached, *_ = setup
    want = latents(exact, dataclasses.replace(job(setup, "x"), edit=dataclasses.replace(job(setup, "x").edit,
                                                                                       template=None)))
    recorded = latents(cached, job(setup, "record"))
    assert cached.templates.stats.misses == 1 and cached.templates.nbytes("device") > 0
    assert np.abs(recorded - want).max() <= TOL  # recording runs every token
    context = cached.runtime.subsets
    before = (context.computed_tokens, context.all_tokens)
    again = latents(cached, job(setup, "reuse"))
    assert cached.templates.stats.hits["device"] == 1
    computed, whole = context.computed_tokens - before[0], context.all_tokens - before[1]
    assert 0 < computed < whole, (computed, whole)  # only the masked tokens ran in the blocks
    print(f"template reuse: {computed} of {whole} block tokens computed ({computed / whole:.0%})")
    assert np.abs(again - want).max() <= TOL


def test_a_reusing_edit_and_text_to_image_share_a_step(setup):
    """The runner gives each workflow its own rows of one UNet batch: a text-to-image request runs
    every token beside an edit that computes its masked tokens only, and each equals itself alone
    (the reusing edit its exact edit: the same request as its recording's)."""
    import torch

    from backends.core.engine.requests import DenoiseJob
    from backends.core.request.params import Limits, validate

    exact, cached, encoder, *_ = setup
    edit = job(setup, "reuse", template="window")
    want = latents(exact, dataclasses.replace(edit, edit=dataclasses.replace(edit.edit, template=None)))
    latents(cached, job(setup, "record", template="window"))
    params = validate({"prompt": "a cat", "steps": edit.params.steps, "width": edit.params.width,
                       "height": edit.params.height, "seed": 1}, Limits())
    text = DenoiseJob("t2i", params, *encoder.encode(params))
    (text_alone,) = run(cached, [text])
    context = cached.runtime.subsets
    before = (context.computed_tokens, context.all_tokens)
    states = [cached.start(text), cached.start(edit)]
    assert states[1].template_use == "reused"
    with torch.inference_mode():
        while states[0].index < len(states[0].timesteps):
            assert not cached.step(states)
    assert 0 < context.computed_tokens - before[0] < context.all_tokens - before[1]
    assert np.abs(cached.result(states[1]) - want).max() <= TOL
    assert np.abs(cached.result(states[0]) - text_alone.latents).max() <= TOL


def test_a_recording_over_the_device_budget_is_streamed_from_host_memory(setup):
    """A recording larger than the device's budget moves to host memory once recorded; an edit
    that reuses it reads it step by step (engine/template_stream.py) and gets what the edit
    reusing it from the device gets (the same request: its exact edit), its every byte counted."""
    from backends.core.engine.template_cache import TemplateCache

    exact, cached, *_ = setup
    folder = cached.folder
    streaming = TorchDenoiser(folder, Placement(), templates=TemplateCache("cpu", device_bytes=1, host_bytes=1 << 30))
    edit = job(setup, "reuse", template="gable")
    want = latents(exact, dataclasses.replace(edit, edit=dataclasses.replace(edit.edit, template=None)))
    latents(streaming, job(setup, "record", template="gable"))
    cache = streaming.templates
    assert cache.nbytes("device") == 0 and cache.nbytes("host") > 0  # moved down at once
    got = latents(streaming, edit)
    assert cache.stats.hits["host"] == 1 and cache.stats.loaded_bytes["host"] == cache.nbytes("host")
    assert np.abs(got - want).max() <= TOL


def test_a_streamed_recording_copies_only_the_blocks_its_plan_takes(setup, tmp_path):
    """With a block profile whose odd transformer blocks load too slowly to hide
    (runtime/cache_plan.py), a streamed edit copies the even ones' outputs only (and the ResNet
    blocks'), takes the recording there and runs the odd ones whole: still its exact edit (the same
    request), fewer bytes over the link."""
    import shutil

    from backends.core.engine.template_cache import TemplateCache
    from backends.core.runtime.cache_plan import BlockProfile, ProfiledBlock
    from backends.core.runtime.conv_subsets import is_block_key

    exact, cached, *_ = setup
    folder = tmp_path / "denoiser"
    shutil.copytree(cached.folder, folder)
    cached.runtime.subset_context()  # (installs the blocks, if no step has yet)
    blocks = sum(1 for m in cached.runtime.weights_module.modules() if hasattr(m, "_subset_index"))
    assert blocks > 1
    BlockProfile(SIZE, (0.0, 1.0), tuple(ProfiledBlock(i, 1.0, (0.1, 1.0), 1000.0 * (i % 2))
                                         for i in range(blocks))).write(folder)
    streaming = TorchDenoiser(folder, Placement(), templates=TemplateCache("cpu", device_bytes=1, host_bytes=1 << 30))
    edit = job(setup, "reuse", template="bay")
    want = latents(exact, dataclasses.replace(edit, edit=dataclasses.replace(edit.edit, template=None)))
    latents(streaming, job(setup, "record", template="bay"))
    cache = streaming.templates
    context = streaming.runtime.subsets
    before = (context.computed_tokens, context.all_tokens)
    got = latents(streaming, edit)
    assert np.abs(got - want).max() <= TOL
    (recording,) = cache._tiers["host"].values()
    copied = sum(t.numel() * t.element_size() for (_, key), t in recording.outputs.items()
                 if not is_block_key(key) or key % 2 == 0)  # (the ResNet blocks' outputs always)
    assert cache.stats.loaded_bytes["host"] == copied < cache.nbytes("host")
    assert 0 < context.computed_tokens - before[0] < context.all_tokens - before[1]


def test_another_prompt_reuses_the_recording_within_the_measured_deviation(setup):
    exact, cached, *_ = setup
    latents(cached, job(setup, "record", template="porch"))
    other = job(setup, "other", prompt="a green door", template="porch")
    want = latents(exact, dataclasses.replace(other, edit=dataclasses.replace(other.edit, template=None)))
    hits = cached.templates.stats.hits["device"]
    got = latents(cached, other)
    assert cached.templates.stats.hits["device"] == hits + 1
    deviation = np.abs(got - want).max() / np.abs(want).max()
    print(f"template reuse, another prompt: deviation {deviation:.4f} of the exact latents' largest magnitude")
    assert 0 < deviation <= APPROXIMATE, deviation


def test_another_seed_is_another_recording(setup):
    exact, cached, *_ = setup
    latents(cached, job(setup, "first", seed=11, template="gate"))
    misses = cached.templates.stats.misses
    seeded = job(setup, "second", seed=12, template="gate")
    got = latents(cached, seeded)
    assert cached.templates.stats.misses == misses + 1  # recorded, not reused
    want = latents(exact, dataclasses.replace(seeded, edit=dataclasses.replace(seeded.edit, template=None)))
    assert np.abs(got - want).max() <= TOL


def recording(rows=2, steps=3, blocks=2, tokens=16, width=8, seed=0):
    import torch

    from backends.core.runtime.token_subsets import TemplateActivations

    g = torch.Generator().manual_seed(seed)
    r = TemplateActivations(rows)
    for step in range(steps):
        for block in range(blocks):
            for row in range(rows):
                r.put(step, block, row, torch.randn(tokens, width, generator=g))
    return r


def test_recordings_move_down_the_tiers_and_survive_a_restart(tmp_path):
    """Past the device budget a recording goes to the host tier, past the host budget it is
    dropped there but its file stays; a new cache on the same folder (a restart) finds it."""
    import torch

    from backends.core.engine.template_cache import TemplateCache
    from backends.core.runtime.token_subsets import TemplateActivations

    one = recording().nbytes  # 2 rows x 3 steps x 2 blocks x 16 x 8 floats
    cache = TemplateCache("cpu", device_bytes=one, host_bytes=one, disk_bytes=10 * one, folder=tmp_path / "t")
    made = {}
    for name in ("a", "b", "c"):
        reuse, r = cache.take((name, 1), 2)
        assert not reuse
        made[name] = recording(seed=ord(name))
        r.outputs.update(made[name].outputs)
        cache.completed(r, (name, 1))
    assert cache.stats.evictions["device"] == 2 and cache.stats.evictions["host"] == 1
    assert len(list((tmp_path / "t").glob("*.safetensors"))) == 3
    reuse, r = cache.take(("b", 1), 2)  # in the host tier: loaded by the cache's loader thread
    r = r.result()
    assert reuse and cache.stats.hits["host"] == 1 and torch.equal(r.get(2, 1, 1), made["b"].get(2, 1, 1))
    reuse, r = cache.take(("a", 1), 2)  # dropped from memory: its file
    r = r.result()
    assert reuse and cache.stats.hits["disk"] == 1 and torch.equal(r.get(0, 0, 0), made["a"].get(0, 0, 0))
    assert cache.take(("a", 1), 2) == (True, r) and cache.stats.hits["device"] == 1  # on the device now

    (tmp_path / "t" / "stray.safetensors").write_bytes(b"not a recording")
    restarted = TemplateCache("cpu", device_bytes=one, disk_bytes=10 * one, folder=tmp_path / "t")
    restarted.prefetch(("c", 1))  # a request with this key was submitted
    reuse, r = restarted.take(("c", 1), 2)
    r = r if isinstance(r, TemplateActivations) else r.result()
    # (read from its file by the prefetch: a hit of the disk tier, or of the device one where the
    # prefetch's load ended before the take)
    assert reuse and restarted.stats.loaded_bytes["disk"] >= one and torch.equal(r.get(1, 0, 1), made["c"].get(1, 0, 1))
    assert restarted.stats.loaded_bytes["disk"] > 0 and restarted.stats.load_seconds > 0
    assert not restarted.take(("d", 1), 2)[0]

    small = TemplateCache("cpu", device_bytes=one, disk_bytes=one * 3 // 2, folder=tmp_path / "t")
    _, r = small.take(("e", 1), 2)
    r.outputs.update(recording(seed=5).outputs)
    small.completed(r, ("e", 1))
    assert small.stats.evictions["disk"] >= 1 and small.nbytes("disk") <= one * 3 // 2


def test_the_export_flag_sizes_each_tier():
    import argparse

    from backends.core.engine.config import DenoiserConfig
    from export.cli import gib_triple

    assert gib_triple("8,16.5,100") == (8.0, 16.5, 100.0)
    for bad in ("8,16", "a,b,c", "1,-1,0"):
        with pytest.raises(argparse.ArgumentTypeError, match="--template-cache-gib"):
            gib_triple(bad)
    config = DenoiserConfig.from_json(DenoiserConfig(template_cache_mib=(1024, 2048, 0)).to_json())
    assert config.template_cache_mib == (1024, 2048, 0)
    with pytest.raises(ValueError, match="denoiser.template_cache_mib"):
        DenoiserConfig(template_cache_mib=(1, 2))


def test_the_share_ratio_of_reusing_steps_is_an_export_option():
    import argparse

    from backends.core.engine.config import DenoiserConfig
    from export.cli import _share_ratio

    assert _share_ratio("3") == 3.0 and _share_ratio("none") is None
    for bad in ("0.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="--edit-share-ratio"):
            _share_ratio(bad)
    assert DenoiserConfig.from_json(DenoiserConfig(edit_share_ratio=None).to_json()).edit_share_ratio is None
    with pytest.raises(ValueError, match="denoiser.edit_share_ratio: 0.5 is below 1"):
        DenoiserConfig(edit_share_ratio=0.5)


def test_edits_of_different_masks_share_a_step(setup):
    """Two reusing edits with masks of different sizes in one step (their tokens padded to the
    longer's; the batcher told to join them whatever their shares) give what each gives alone, and
    the loop prices each such step by its wider mask, which every row is padded to."""
    from backends.core.engine.loop import DenoiseLoop
    from tests.unit.test_denoise_loop import Results

    exact, cached, encoder, pipe, image, mask = setup
    small = np.zeros_like(mask)
    small[8:24, 40:56] = 255
    latents(cached, job(setup, "record", template="bench"))
    wide = job(setup, "wide", template="bench")
    narrow = job(setup, "narrow", prompt="a blue window", template="bench")
    arrays = encoded(pipe, image, small)
    narrow = dataclasses.replace(narrow, edit=dataclasses.replace(narrow.edit, **arrays))
    alone = [latents(cached, j) for j in (wide, narrow)]
    results = Results()
    loop = DenoiseLoop(cached, results, ANY_SHARES)
    steps, select = [], loop.batcher.policy.select
    loop.batcher.policy.select = lambda runnable, rows: steps.append(select(runnable, rows)) or steps[-1]
    loop.start()
    for j in (wide, narrow):
        loop.submit(j)
    together = results.wait(["wide", "narrow"])
    loop.shutdown()
    assert all(r.error is None for r in together)
    for got, want in zip(together, alone):
        assert np.abs(got.latents - want).max() <= TOL
    shared = [s for s in steps if len(s) == 2]
    assert shared and len({s.token_share for s in shared[0]}) == 2  # two shares, one step
    shares = sorted(s.token_share for s in shared[0])
    # (each step priced at its widest row: the wider share where both stepped, never their mean)
    assert all(any(r.token_units / r.units == pytest.approx(s) for s in shares) for r in loop.stats.take())


def test_resnet_blocks_on_the_masks_box(setup):
    """With RuntimeConfig.conv_subsets (runtime/conv_subsets.py) reusing edits also run the ResNet
    blocks on their mask's box: the same request again is still its exact edit, fewer ResNet
    positions are computed, another prompt stays within the measured deviation, and two masks in
    one step each give what they give alone (each keeps its own box of the shared one)."""
    from backends.core.runtime.artifacts import load_unet_halves
    from backends.core.runtime.torch_eager import EagerUNetRuntime

    exact, cached, encoder, pipe, image, mask = setup
    convs = TorchDenoiser(cached.folder, Placement(),
                          runtime=EagerUNetRuntime(*load_unet_halves(cached.folder, Placement()), conv_subsets=True))
    edit = job(setup, "reuse", template="arch")
    want = latents(exact, dataclasses.replace(edit, edit=dataclasses.replace(edit.edit, template=None)))
    latents(convs, job(setup, "record", template="arch"))
    context = convs.runtime.subsets
    assert context.conv_all == 0  # recording computes every position
    assert np.abs(latents(convs, edit) - want).max() <= TOL
    print(f"template reuse, ResNet blocks on the box: {context.conv_computed} of {context.conv_all} positions")
    assert 0 < context.conv_computed < context.conv_all
    other = job(setup, "other", prompt="a green door", template="arch")
    want = latents(exact, dataclasses.replace(other, edit=dataclasses.replace(other.edit, template=None)))
    deviation = np.abs(latents(convs, other) - want).max() / np.abs(want).max()
    print(f"template reuse with the ResNet blocks on the box, another prompt: deviation {deviation:.4f}")
    assert 0 < deviation <= APPROXIMATE
    small = np.zeros_like(mask)
    small[8:24, 40:56] = 255
    narrow = job(setup, "narrow", prompt="a blue window", template="arch")
    narrow = dataclasses.replace(narrow, edit=dataclasses.replace(narrow.edit, **encoded(pipe, image, small)))
    alone = [latents(convs, j) for j in (edit, narrow)]
    together = run(convs, [edit, narrow], ANY_SHARES)
    for got, want in zip(together, alone):
        assert got.error is None and np.abs(got.latents - want).max() <= TOL


def encoded(pipe, image, mask) -> dict:
    """EditInputs' arrays of another template or mask."""
    from backends.core.stages.vae_encoding import encode_edit

    return encode_edit(pipe.vae, image, mask, pipe.vae_scale_factor)


def test_a_recording_over_the_device_budget_goes_down_at_once(tmp_path):
    from backends.core.engine.template_cache import TemplateCache

    one = recording().nbytes
    cache = TemplateCache("cpu", device_bytes=one // 2, host_bytes=2 * one)
    _, r = cache.take(("big", 1), 2)
    r.outputs.update(recording().outputs)
    cache.completed(r, ("big", 1))
    assert cache.nbytes("device") == 0 and cache.nbytes("host") == one
    assert cache.take(("big", 1), 2)[0] and cache.stats.hits["host"] == 1


def test_a_name_given_to_another_template_records_anew(setup):
    exact, cached, encoder, pipe, image, mask = setup
    latents(cached, job(setup, "first", template="sign"))
    other = job(setup, "other", template="sign")
    arrays = encoded(pipe, image[::-1].copy(), mask)
    other = dataclasses.replace(other, edit=dataclasses.replace(other.edit, **arrays))
    misses = cached.templates.stats.misses
    latents(cached, other)
    assert cached.templates.stats.misses == misses + 1


def test_a_reusing_edit_is_priced_by_its_share_of_tokens(setup):
    """What the routers read is mask-aware: the loop tells its cost model (engine/step_cost.py)
    each step's work weighted by the share of block tokens its rows compute; a reusing edit's
    share is its mask's, a recording edit's whole. The step batcher sees the reusing edit's share
    (it groups such edits by it), and none for the recording one."""
    from backends.core.engine.loop import DenoiseLoop
    from tests.unit.test_denoise_loop import Results

    _, cached, *_ = setup
    for rid, share in (("record-priced", 1.0), ("reuse-priced", None)):
        results = Results()
        loop = DenoiseLoop(cached, results, publish_load=lambda load: None)
        seen, select = [], loop.batcher.policy.select
        loop.batcher.policy.select = lambda runnable, rows: seen.extend(s.token_share for s in runnable) or \
            select(runnable, rows)
        loop.start()
        loop.submit(job(setup, rid, seed=21))
        (result,) = results.wait([rid])
        loop.shutdown()
        assert result.error is None, result.error
        records = loop.stats.take()
        assert records and all(r.units > 0 for r in records)
        shares = {r.token_units / r.units for r in records}
        if share is None:  # the tiny UNet's coarse token grids widen a 25% mask to about 60% of tokens
            assert len(shares) == 1 and set(seen) == shares and 0.1 < shares.pop() < 0.9, shares
        else:
            assert shares == {share} and set(seen) == {None}


def test_an_edit_whose_recording_loads_is_held_while_others_step(setup, tmp_path):
    """A recording in a lower tier is loaded by the cache's thread, never on the loop: the edit
    that needs it waits before its first step (its wait counted) while a text-to-image request
    beside it steps, then reuses it and equals the same edit served from the device."""
    import threading

    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.engine.loop import DenoiseLoop
    from backends.core.engine.template_cache import TemplateCache
    from backends.core.runtime.placement import Placement
    from tests.unit.test_denoise_loop import Results, job as txt2img_job

    _, cached, encoder, *_ = setup
    latents(cached, job(setup, "record-on-device", seed=31))
    served = latents(cached, job(setup, "reuse-from-device", seed=31, prompt="a green door"))
    folder = tmp_path / "templates"
    writer = TorchDenoiser(cached.folder, Placement(),
                           templates=TemplateCache("cpu", disk_bytes=1 << 30, folder=folder))
    latents(writer, job(setup, "record-to-disk", seed=31))  # the same recording, written to the folder
    gate = threading.Event()
    restarted = TemplateCache("cpu", disk_bytes=1 << 30, folder=folder)
    load = restarted._load
    restarted._load = lambda *a: (gate.wait(60), load(*a))[1]  # the file read lasts until the gate opens
    engine = TorchDenoiser(cached.folder, Placement(), templates=restarted)
    results = Results()
    loop = DenoiseLoop(engine, results)
    loop.start()
    try:
        loop.submit(job(setup, "loaded", seed=31, prompt="a green door"))
        loop.submit(txt2img_job(encoder, "beside", steps=4))
        (beside,) = results.wait(["beside"])  # it finished while the edit waited for its recording
        assert beside.error is None and "loaded" not in results.done
        gate.set()
        (loaded,) = results.wait(["loaded"])
    finally:
        gate.set()
        loop.shutdown()
        restarted.close()
    assert loaded.error is None and loaded.template_use == "reused"
    assert restarted.stats.hits["disk"] == 1 and restarted.stats.wait_seconds > 0
    np.testing.assert_allclose(loaded.latents, served, atol=TOL)


def test_a_replaced_adapter_file_keys_a_recording_anew(setup, tiny_model, tmp_path):
    """A template's key holds its LoRAs' and ControlNets' file versions: a LoRA file replaced
    under the same name (new content, a new inode) gives another key, so the recording made with
    the old weights is not reused; the same files again give the same key."""
    import shutil

    from backends.core.adapters.store import AdapterStore
    from backends.core.engine.builder import Denoiser
    from backends.core.engine.workflows.inpaint import template_key
    from backends.core.request.params import ControlParams, LoraParams

    root = tmp_path / "adapters"
    shutil.copytree(tiny_model / "adapters", root)
    denoiser = Denoiser(config=None, engine=None, loop=None, store=AdapterStore(root), lora_loader=None)
    edit = job(setup, "versions")
    params = dataclasses.replace(edit.params, loras=(LoraParams("papercut"),), controls=(ControlParams("canny"),))

    def key():
        versions = denoiser.adapter_versions(params)
        return template_key(dataclasses.replace(edit, params=params, adapter_versions=versions), 2)

    before = key()
    assert key() == before and len(denoiser.adapter_versions(params)) == 2
    replacement = tmp_path / "papercut.new"
    shutil.copy(root / "loras" / "inkwash.safetensors", replacement)
    replacement.replace(root / "loras" / "papercut.safetensors")  # as an operator updates a LoRA: aside, renamed over
    assert key() != before


def test_a_profile_leaves_whole_the_blocks_where_reuse_does_not_pay(setup, tmp_path):
    """With a measured profile (runtime/cache_plan.py) in which no block's masked run is faster,
    a reusing edit runs every block whole: its latents are its own exact edit's and every token
    counts as computed; with one in which every block's is faster, it reuses as without a profile."""
    import shutil

    from backends.core.engine.denoiser import TorchDenoiser
    from backends.core.runtime.cache_plan import BlockProfile, ProfiledBlock
    from backends.core.runtime.conv_subsets import is_block_key
    from backends.core.runtime.placement import Placement

    from diffusers.models.attention import BasicTransformerBlock

    exact, cached, *_ = setup
    count = sum(isinstance(m, BasicTransformerBlock) for m in cached.unet.modules())  # (install's indices)
    outcomes = {}
    for name, with_s in (("slower", 2.0), ("faster", 0.5)):
        folder = tmp_path / name
        shutil.copytree(cached.folder, folder)
        BlockProfile(SIZE, (0.1, 0.5), tuple(ProfiledBlock(i, 1.0, (with_s, with_s), 0.0) for i in range(count))
                     ).write(folder)
        engine = TorchDenoiser(folder, Placement())
        engine.runtime.conv_subsets = False  # the transformer blocks' plan alone
        latents(engine, job(setup, f"record-{name}", seed=41))
        before = (engine.runtime.subsets.computed_tokens, engine.runtime.subsets.all_tokens)
        outcomes[name] = latents(engine, job(setup, f"reuse-{name}", seed=41, prompt="a green door"))
        computed = engine.runtime.subsets.computed_tokens - before[0]
        whole = engine.runtime.subsets.all_tokens - before[1]
        assert (computed == whole) == (name == "slower"), (name, computed, whole)
    want = latents(exact, dataclasses.replace(job(setup, "exact-green", seed=41, prompt="a green door"),
                                              edit=dataclasses.replace(job(setup, "e", seed=41).edit, template=None)))
    assert np.abs(outcomes["slower"] - want).max() <= TOL
    assert np.abs(outcomes["faster"] - want).max() > TOL  # approximate: it reused

