"""export/repository.py: the Triton model repository written from a diffusers SDXL folder.

Configs are parsed with Triton's own ModelConfig protobuf; the denoiser's artifacts are loaded by
the serving engine and must reproduce diffusers' StableDiffusionXLPipeline latents.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from google.protobuf import text_format
from safetensors import safe_open
from tritonclient.grpc import model_config_pb2

from backends.core.engine.config import DenoiserConfig
from backends.core.request import contract
from backends.core.runtime.artifacts import DECODER_FILE, ENCODER_FILE, UNET_DIR
from backends.core.engine.denoiser import TorchDenoiser
from backends.core.engine.requests import DenoiseJob
from backends.core.request.params import Limits, validate
from backends.core.runtime.placement import Placement
from backends.core.stages.text_encoding import PromptEncoder
from backends.core.runtime.unet_split import split_unet
from clients.serve import TritonServer
from export.repository import ExportOptions, export_repository

MODELS = ("easel", "easel_stream", "preprocess", "text_encoder", "vae_decoder")
PUBLIC_MODELS = ("easel", "easel_stream")
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"}
Config = model_config_pb2.ModelConfig


@pytest.fixture(scope="module")
def cpu_repo(tiny_model, tmp_path_factory):
    return export_repository(tiny_model, tmp_path_factory.mktemp("export") / "cpu", ExportOptions(device="cpu"))


@pytest.fixture(scope="module")
def alt_repo(alt_model, tmp_path_factory):
    return export_repository(alt_model, tmp_path_factory.mktemp("export") / "alt", ExportOptions(device="cpu"))


@pytest.fixture(scope="module")
def cuda_repo(tiny_model, tmp_path_factory):
    # Writing a cuda repository needs no GPU: only the configs and the fp16 weights differ.
    return export_repository(tiny_model, tmp_path_factory.mktemp("export") / "cuda",
                             ExportOptions(device="cuda", gpus=(0, 1)))


@pytest.fixture(params=["cpu", "alt", "cuda"])
def repo(request):
    return request.getfixturevalue(f"{request.param}_repo")


def configs(repo: Path) -> dict[str, Config]:
    """Every config.pbtxt of the repository, parsed by Triton's protobuf (a failure to parse raises)."""
    out = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        out[path.parent.name] = text_format.Parse(path.read_text(), Config())
    return out


def params_of(config: Config) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


# --- configs ---


def test_every_config_parses_and_is_named_after_its_folder(repo):
    parsed = configs(repo)
    assert set(MODELS) <= set(parsed)
    for name, config in parsed.items():
        assert config.name == name
        assert (repo / name / "1").is_dir()
        component = "denoiser" if name.startswith("denoiser") else "pipeline" if name in PUBLIC_MODELS else name
        assert config.backend == f"easel_{component}"
        assert (Path(__file__).parents[2] / "backends" / config.backend / "model.py").is_file()


def test_configs_declare_the_contract(cpu_repo):
    parsed = configs(cpu_repo)
    decls = dict(easel=contract.PUBLIC, easel_stream=contract.STREAM, preprocess=contract.PREPROCESS,
                 text_encoder=contract.TEXT_ENCODER, denoiser=contract.DENOISER, vae_decoder=contract.VAE_DECODER)
    for name, decl in decls.items():
        config = parsed[name]
        assert [t.name for t in config.input] == [t.name for t in decl.inputs]
        assert [t.name for t in config.output] == [t.name for t in decl.outputs]
        for tensor, t in zip([*config.input, *config.output], [*decl.inputs, *decl.outputs]):
            wanted = "TYPE_STRING" if t.dtype == "BYTES" else f"TYPE_{t.dtype}"
            assert model_config_pb2.DataType.Name(tensor.data_type) == wanted, (name, t.name)
            assert tuple(tensor.dims) == t.dims, (name, t.name)
        assert [t.optional for t in config.input] == [t.optional for t in decl.inputs]


def test_public_models_run_the_pipeline_on_the_denoisers(repo):
    """`easel` and `easel_stream` call the other models by BLS (backends/triton/bls_pipeline.py): one
    instance each, which runs many requests at once, over every denoiser of the repository."""
    parsed = configs(repo)
    denoisers = sorted(name for name in parsed if name.startswith("denoiser"))
    for name in PUBLIC_MODELS:
        config = parsed[name]
        assert config.backend == "easel_pipeline"
        (group,) = config.instance_group
        assert (model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind), group.count) == ("KIND_CPU", 1)
        params = params_of(config)
        assert sorted(params["denoisers"].split(",")) == denoisers
        assert int(params["max_in_flight"]) == 56
        assert params["limits"] == params_of(parsed["preprocess"])["limits"]
    assert [o.name for o in parsed["easel"].output] == ["image", "info"]


@pytest.mark.parametrize("public", ["easel", "easel_stream"])
def test_public_models_serve_one_version_and_have_a_spare_for_draining(repo, public):
    # `easel serve` drains by switching the public models to their spare version (clients/serve.py,
    # TritonServer.drain): Triton keeps version 1 UNLOADING until its requests finish.
    config = configs(repo)[public]
    assert list(config.version_policy.specific.versions) == [1]
    assert sorted(p.name for p in (repo / public).iterdir() if p.is_dir()) == ["1", "2"]
    assert TritonServer(repo).public_models() == ["easel", "easel_stream"]


def test_only_the_denoisers_and_the_stream_are_decoupled(repo):
    for name, config in configs(repo).items():
        assert config.model_transaction_policy.decoupled == (name.startswith("denoiser") or name == "easel_stream"), name


def test_the_stream_takes_easels_inputs(repo):
    parsed = configs(repo)
    assert [t.name for t in parsed["easel_stream"].input] == [t.name for t in parsed["easel"].input] + ["preview_every"]


def test_preprocess_limits_follow_the_model(cpu_repo, alt_repo):
    # default size = UNet sample_size x VAE scale factor (16 x 8 for tiny, 12 x 8 for alt)
    for repo, size in ((cpu_repo, 128), (alt_repo, 96)):
        limits = Limits.from_json(params_of(configs(repo)["preprocess"])["limits"])
        assert (limits.default_width, limits.default_height, limits.size_multiple) == (size, size, 8)
        assert (limits.max_width, limits.max_steps, limits.default_steps) == (2048, 150, 30)


# --- weights ---


def test_only_safetensors_weights_are_written(repo):
    files = [p for p in repo.rglob("*") if p.is_file()]
    pickles = [p for p in files if p.suffix in PICKLE_SUFFIXES]
    assert not pickles, pickles
    weights = {p.relative_to(repo).as_posix() for p in files if p.suffix == ".safetensors"}
    denoiser = "denoiser_gpu0" if (repo / "denoiser_gpu0").exists() else "denoiser"
    assert {f"{denoiser}/1/{UNET_DIR}/{ENCODER_FILE}", f"{denoiser}/1/{UNET_DIR}/{DECODER_FILE}",
            "text_encoder/1/text_encoder/model.safetensors", "text_encoder/1/text_encoder_2/model.safetensors",
            "vae_decoder/1/vae/diffusion_pytorch_model.safetensors"} == weights


def test_unet_halves_are_written_under_the_unet_key_names(cpu_repo, tiny_model):
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    encoder, decoder = split_unet(unet)
    for half, file in ((encoder, ENCODER_FILE), (decoder, DECODER_FILE)):
        with safe_open(str(cpu_repo / "denoiser" / "1" / UNET_DIR / file), "pt") as f:
            assert set(f.keys()) == set(half.state_dict())
            for key in f.keys():
                assert torch.equal(f.get_tensor(key), half.state_dict()[key]), key


def test_cpu_export_is_fp32_on_cpu(cpu_repo):
    parsed = configs(cpu_repo)
    assert not any(name.startswith("denoiser_gpu") for name in parsed)
    for name in ("text_encoder", "denoiser", "vae_decoder"):
        assert params_of(parsed[name])["dtype"] == "fp32"
    for name in ("text_encoder", "vae_decoder"):
        assert params_of(parsed[name])["graphs"] == "false"
    assert params_of(parsed["vae_decoder"])["attention_dtype"] == "fp32"  # exact on eager
    for name, config in parsed.items():
        for group in config.instance_group:
            assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_CPU" and not group.gpus
    assert params_of(parsed["easel"])["denoisers"] == "denoiser"
    with safe_open(str(cpu_repo / "denoiser" / "1" / UNET_DIR / ENCODER_FILE), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F32"}


def test_denoiser_config_is_typed_and_strict(tiny_model, tmp_path):
    repo = export_repository(tiny_model, tmp_path / "repo")
    config = DenoiserConfig.from_json(params_of(configs(repo)["denoiser"])["denoiser"])
    assert config.runtime.kind == "eager" and config.runtime.warmup_sizes == ()  # the default on CPU
    assert config.limits == Limits.from_json(params_of(configs(repo)["preprocess"])["limits"])
    data = json.loads(config.to_json())
    with pytest.raises(ValueError, match=r"denoiser: unknown keys \['max_runing'\]"):
        DenoiserConfig.from_json(json.dumps({**data, "max_runing": 3}))
    with pytest.raises(ValueError, match=r"runtime: unknown keys \['graph'\]"):
        DenoiserConfig.from_json(json.dumps({**data, "runtime": {"graph": True}}))
    with pytest.raises(ValueError, match="runtime.kind: 'tensorrt' is not one of"):
        DenoiserConfig.from_json(json.dumps({**data, "runtime": {"kind": "tensorrt"}}))
    with pytest.raises(ValueError, match="runtime: 'graphs' needs --device cuda"):
        ExportOptions(runtime="graphs")
    assert config.max_queue == 48  # the default bound of waiting requests
    with pytest.raises(ValueError, match="denoiser.max_queue: -1 is negative"):
        DenoiserConfig.from_json(json.dumps({**data, "max_queue": -1}))


def test_every_model_that_reads_params_gets_the_limits(tiny_model, tmp_path):
    """Internal models re-check params against them (Triton cannot hide those models)."""
    repo = export_repository(tiny_model, tmp_path / "repo", ExportOptions(max_queue=5, max_in_flight=13,
                                                                          controlnet_row_split=True))
    parsed = configs(repo)
    limits = params_of(parsed["preprocess"])["limits"]
    for name in ("text_encoder", "easel", "easel_stream", "vae_decoder"):
        assert params_of(parsed[name])["limits"] == limits, name
    denoiser = DenoiserConfig.from_json(params_of(parsed["denoiser"])["denoiser"])
    assert denoiser.max_queue == 5 and denoiser.controlnet_row_split
    # the public models' requests in flight are bounded too (past it: UNAVAILABLE at once)
    for name in PUBLIC_MODELS:
        assert params_of(parsed[name])["max_in_flight"] == "13"


def test_an_export_over_an_older_one_removes_retired_models(tiny_model, tmp_path):
    """A stale `generate` (the ensemble's step, its backend gone) would keep tritonserver from starting."""
    for name in ("generate", "postprocess"):  # (postprocess: the image encoder, now the pipeline's own)
        stale = tmp_path / "repo" / name / "1"
        stale.mkdir(parents=True)
        (stale.parent / "config.pbtxt").write_text(f'name: "{name}"\nbackend: "easel_{name}"\n')
    repo = export_repository(tiny_model, tmp_path / "repo")
    assert not (repo / "generate").exists() and not (repo / "postprocess").exists()
    assert set(MODELS) <= set(configs(repo))


def test_cuda_export_writes_one_denoiser_per_gpu(cuda_repo):
    parsed = configs(cuda_repo)
    assert "denoiser" not in parsed
    assert {"denoiser_gpu0", "denoiser_gpu1"} <= set(parsed)
    for gpu in (0, 1):
        config = parsed[f"denoiser_gpu{gpu}"]
        (group,) = config.instance_group
        assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_GPU"
        assert list(group.gpus) == [gpu]
        params = params_of(config)
        assert params["dtype"] == "fp16"
        denoiser = DenoiserConfig.from_json(params["denoiser"])
        assert (denoiser.max_running, denoiser.max_batch_rows) == (16, 16)
        assert denoiser.runtime.kind == "compiled"  # the fast runtime is the default on a GPU
        size = denoiser.limits.default_width // denoiser.limits.size_multiple
        assert denoiser.runtime.warmup_sizes == ((size, size),)  # and it warms up the model's own size
    # the second denoiser reads the first one's artifacts and holds no weights of its own
    assert "artifacts" not in params_of(parsed["denoiser_gpu0"])
    assert params_of(parsed["denoiser_gpu1"])["artifacts"] == "denoiser_gpu0/1"
    assert (cuda_repo / "denoiser_gpu0/1" / UNET_DIR / ENCODER_FILE).is_file()
    assert [p for p in (cuda_repo / "denoiser_gpu1").rglob("*") if p.is_file()] == [
        cuda_repo / "denoiser_gpu1" / "config.pbtxt"]
    assert params_of(parsed["easel"])["denoisers"] == "denoiser_gpu0,denoiser_gpu1"
    for name in ("text_encoder", "vae_decoder"):
        (group,) = parsed[name].instance_group
        assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_GPU"
        # one instance on each denoiser's GPU, so that replicas scale
        assert group.count == 1 and list(group.gpus) == [0, 1] and params_of(parsed[name])["dtype"] == "fp16"
        assert params_of(parsed[name])["graphs"] == "true"  # the fast runtime's CUDA graphs there too
    assert params_of(parsed["vae_decoder"])["attention_dtype"] == "bf16"  # approximate: the fast default
    for file in (ENCODER_FILE, DECODER_FILE):
        with safe_open(str(cuda_repo / "denoiser_gpu0/1" / UNET_DIR / file), "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"F16"}


def test_cfg_parallel_export_makes_one_denoiser_per_gpu_pair(tiny_model, tmp_path):
    """`easel export --cfg-parallel 0:1,2:3`: each pair is one denoiser (on its first GPU, named by
    it), which runs the unconditional rows on the second GPU; buckets of half the rows."""
    from export.cli import main

    repo = tmp_path / "repo"
    assert main(["export", "--model", str(tiny_model), "--out", str(repo), "--device", "cuda",
                 "--cfg-parallel", "0:1,2:3", "--adapters", str(tiny_model / "adapters")]) == 0
    parsed = configs(repo)
    assert not {"denoiser_gpu1", "denoiser_gpu3"} & set(parsed)
    for first, second in ((0, 1), (2, 3)):
        config = parsed[f"denoiser_gpu{first}"]
        (group,) = config.instance_group
        assert list(group.gpus) == [first]
        denoiser = DenoiserConfig.from_json(params_of(config)["denoiser"])
        assert denoiser.cfg_parallel_device == f"cuda:{second}"
        assert denoiser.runtime.row_buckets == (1, 2, 4, 8)
    assert params_of(parsed["easel"])["denoisers"] == "denoiser_gpu0,denoiser_gpu2"
    assert params_of(parsed["controlnet"])["runtime"] == "compiled"  # ControlNets as graphs of compiled code by default
    (group,) = parsed["controlnet"].instance_group  # on every GPU of the pairs: they are called per row
    assert list(group.gpus) == [0, 1, 2, 3] and group.count == 2
    assert DenoiserConfig.from_json(params_of(parsed["denoiser_gpu0"])["denoiser"]).controlnet_instances == 8
    with pytest.raises(SystemExit):  # the pairs name the GPUs
        main(["export", "--model", str(tiny_model), "--out", str(repo), "--device", "cuda", "--gpus", "0",
              "--cfg-parallel", "0:1"])


def test_export_writes_the_eight_gpu_headline_placement(tiny_model, tmp_path):
    """The latent-parallel layout, checked without the GPUs: the base model on a latent-parallel pair
    (GPUs 0 and 1) and one ControlNet instance on each of GPUs 2-7, so that a step's 3 ControlNets x
    2 rows run as 6 calls at once, one per GPU. Every config.pbtxt's instance groups and GPU ids."""
    from export.cli import main

    repo = tmp_path / "repo"
    assert main(["export", "--model", str(tiny_model), "--out", str(repo), "--device", "cuda",
                 "--cfg-parallel", "0:1", "--controlnet-gpus", "2,3,4,5,6,7", "--controlnet-instances", "1",
                 "--adapters", str(tiny_model / "adapters")]) == 0
    parsed = configs(repo)
    placed = {name: [(model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind), g.count, list(g.gpus))
                     for g in config.instance_group] for name, config in parsed.items()}
    assert placed.pop("denoiser_gpu0") == [("KIND_GPU", 1, [0])]
    assert placed.pop("controlnet") == [("KIND_GPU", 1, [2, 3, 4, 5, 6, 7])]
    for name in ("text_encoder", "vae_encoder", "vae_decoder"):
        assert placed.pop(name) == [("KIND_GPU", 1, [0])]  # beside the pair's first GPU, which takes the text
    assert all(kind == "KIND_CPU" for groups in placed.values() for kind, _, _ in groups), placed
    denoiser = DenoiserConfig.from_json(params_of(parsed["denoiser_gpu0"])["denoiser"])
    assert denoiser.cfg_parallel_device == "cuda:1" and denoiser.controlnet_instances == 6
    assert params_of(parsed["easel"])["denoisers"] == "denoiser_gpu0"


def test_export_json_records_the_options(cuda_repo):
    info = json.loads((cuda_repo / "easel_export.json").read_text())
    assert info["options"]["device"] == "cuda" and info["options"]["gpus"] == [0, 1]
    assert Limits(**info["limits"]) == Limits.from_json(params_of(configs(cuda_repo)["preprocess"])["limits"])


@pytest.mark.parametrize("kwargs,match", [
    (dict(device="tpu"), "device"),
    (dict(dtype="int8"), "dtype"),
    (dict(device="cuda", gpus=()), "gpus"),
    (dict(device="cuda", gpus=(0,), cfg_parallel=((0, 0),)), "pairs of distinct GPU ids"),
    (dict(device="cuda", gpus=(0, 1), cfg_parallel=((0, 1),)), "first GPU of each cfg_parallel pair"),
    (dict(device="cpu", cfg_parallel=((0, 1),)), "need --device cuda"),
    (dict(device="cuda", cpu_cfg_parallel=True), "only with --device cpu"),
])
def test_bad_export_options_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ExportOptions(**kwargs)


def test_export_options_dtype_defaults():
    assert ExportOptions(device="cpu").resolved_dtype == "fp32"
    assert ExportOptions(device="cuda").resolved_dtype == "fp16"
    assert ExportOptions(device="cuda", dtype="bf16").resolved_dtype == "bf16"


# --- the exported weights run in the serving engine exactly like diffusers ---

TOL = 1e-4  # max abs difference of final latents


@pytest.fixture(scope="module")
def engines(cpu_repo, alt_repo, tiny_model, alt_model):
    from diffusers import StableDiffusionXLPipeline

    out = {}
    for name, repo, model in (("tiny", cpu_repo, tiny_model), ("alt", alt_repo, alt_model)):
        pipe = StableDiffusionXLPipeline.from_pretrained(model, add_watermarker=False)
        pipe.set_progress_bar_config(disable=True)
        out[name] = (TorchDenoiser(repo / "denoiser" / "1", Placement()),
                     PromptEncoder(repo / "text_encoder" / "1", Placement()), pipe)
    return out


def job(encoder, request_id, **request) -> DenoiseJob:
    raw = {"prompt": b"a photo of the red cat on a mountain", **request}
    params = validate(raw, Limits(default_width=128, default_height=128))
    embeds, pooled = encoder.encode(params)
    return DenoiseJob(request_id, params, embeds, pooled)


def run_alone(engine, j: DenoiseJob) -> np.ndarray:
    state = engine.start(j)
    assert len(state.timesteps) == j.params.steps
    while state.index < len(state.timesteps):
        engine.step([state])
    return engine.result(state)


def diffusers_latents(pipe, j: DenoiseJob) -> np.ndarray:
    from diffusers import DDIMScheduler, DPMSolverMultistepScheduler, EulerAncestralDiscreteScheduler

    p = j.params
    swap = {"default": None, "euler_a": EulerAncestralDiscreteScheduler.from_config,
            "ddim": DDIMScheduler.from_config,
            "dpmpp_2m_karras": lambda c: DPMSolverMultistepScheduler.from_config(
                c, use_karras_sigmas=True, algorithm_type="dpmsolver++")}[p.scheduler]
    embeds, pooled = torch.from_numpy(j.prompt_embeds), torch.from_numpy(j.pooled_embeds)
    if p.cfg:  # rows are negative first
        text = dict(prompt_embeds=embeds[1:], negative_prompt_embeds=embeds[:1],
                    pooled_prompt_embeds=pooled[1:], negative_pooled_prompt_embeds=pooled[:1])
    else:
        text = dict(prompt_embeds=embeds, pooled_prompt_embeds=pooled)
    original = pipe.scheduler
    if swap is not None:
        pipe.scheduler = swap(original.config)
    try:
        out = pipe(**text, width=p.width, height=p.height, num_inference_steps=p.steps,
                   guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                   output_type="latent")
    finally:
        pipe.scheduler = original
    return out.images.numpy()


@pytest.mark.parametrize("model,request_", [
    ("tiny", dict(seed=7, steps=4, width=128, height=128, guidance_scale=5.0)),
    ("tiny", dict(seed=8, steps=3, width=72, height=104, guidance_scale=1.0, scheduler=b"euler_a")),
    ("tiny", dict(seed=9, steps=5, width=96, height=64, guidance_scale=7.5, negative_prompt=b"blurry",
                  scheduler=b"dpmpp_2m_karras")),
    ("alt", dict(seed=10, steps=4, width=96, height=96, guidance_scale=5.0)),  # the model's DDIM
], ids=["tiny-euler-cfg", "tiny-euler_a-odd-nocfg", "tiny-dpmpp-negative", "alt-ddim"])
def test_exported_denoiser_reproduces_diffusers_latents(engines, model, request_):
    engine, encoder, pipe = engines[model]
    j = job(encoder, "r", **request_)
    got = run_alone(engine, j)
    expected = diffusers_latents(pipe, j)
    assert got.shape == expected.shape == (1, 4, j.params.height // 8, j.params.width // 8)
    assert np.isfinite(got).all()
    assert np.abs(got - expected).max() <= TOL
    # guards: the seed matters, so the comparison above is not trivially true
    other = run_alone(engine, job(encoder, "r2", **{**request_, "seed": request_["seed"] + 100}))
    assert np.abs(other - got).max() > 1e-2


def test_prompt_encoder_matches_diffusers_encode_prompt(engines):
    _, encoder, pipe = engines["tiny"]
    j = job(encoder, "r", negative_prompt=b"a dog", guidance_scale=5.0, seed=1)
    with torch.no_grad():
        pe, npe, ppe, nppe = pipe.encode_prompt("a photo of the red cat on a mountain", negative_prompt="a dog",
                                                do_classifier_free_guidance=True, device="cpu")
    np.testing.assert_array_equal(j.prompt_embeds, torch.cat([npe, pe]).numpy())
    np.testing.assert_array_equal(j.pooled_embeds, torch.cat([nppe, ppe]).numpy())


@pytest.mark.parametrize("model", ["tiny", "alt"])
def test_requests_at_different_steps_batched_together_match_each_alone(engines, model):
    engine, encoder, _ = engines[model]
    size = dict(width=72, height=104)
    a = job(encoder, "a", seed=1, steps=5, guidance_scale=5.0, scheduler=b"dpmpp_2m_karras", **size)
    b = job(encoder, "b", seed=2, steps=6, guidance_scale=1.0, scheduler=b"euler_a", **size)  # 1 row vs 2
    c = job(encoder, "c", seed=3, steps=4, guidance_scale=3.0, negative_prompt=b"city", **size)
    alone = {j.request_id: run_alone(engine, j) for j in (a, b, c)}

    sa, sb, sc = engine.start(a), engine.start(b), engine.start(c)
    engine.step([sa])
    engine.step([sa])  # a is two steps ahead when b joins
    engine.step([sa, sb])
    while sa.index < len(sa.timesteps):  # c joins late; all three share steps at different timesteps
        engine.step([sc, sa, sb])
    while sb.index < len(sb.timesteps):
        engine.step([s for s in (sb, sc) if s.index < len(s.timesteps)])
    while sc.index < len(sc.timesteps):
        engine.step([sc])
    for state in (sa, sb, sc):
        got = engine.result(state)
        assert np.abs(got - alone[state.job.request_id]).max() <= TOL, state.job.request_id


def test_vae_dtype_is_written_only_when_asked(tiny_model, tmp_path, cpu_repo):
    """--vae-dtype bf16 reaches the VAE as its own parameter; without it the VAE keeps diffusers'
    dtype (the placement's, upcast to fp32 where the VAE asks), and no vae_dtype is written."""
    assert "vae_dtype" not in params_of(configs(cpu_repo)["vae_decoder"])
    repo = export_repository(tiny_model, tmp_path / "repo", ExportOptions(device="cpu", vae_dtype="bf16"))
    params = params_of(configs(repo)["vae_decoder"])
    assert params["vae_dtype"] == "bf16" and params["dtype"] == "fp32"  # the placement's stays
    with pytest.raises(ValueError, match="vae_dtype"):
        ExportOptions(vae_dtype="int8")


def test_the_committed_repository_is_what_make_demo_exports(tmp_path, monkeypatch):
    """model_repository/ as committed is what `make demo` writes (the Makefile's own `easel tiny`
    and `easel export` lines, run in a scratch folder), so `make serve` leaves the checkout clean."""
    import re
    import shlex
    import subprocess

    from clients.cli import main as easel

    root = Path(__file__).parents[2]
    makefile = (root / "Makefile").read_text()
    values = dict(re.findall(r"^(DEMO|REPO) := (\S+)$", makefile, re.M))
    monkeypatch.chdir(tmp_path)
    for line in ("$(EASEL) tiny $(DEMO)", re.search(r"^\t(\$\(EASEL\) export .*)$", makefile, re.M).group(1)):
        argv = shlex.split(re.sub(r"\$\((DEMO|REPO)\)", lambda m: values[m.group(1)], line))[1:]
        assert easel(argv) == 0, argv
    tracked = subprocess.run(["git", "ls-files", values["REPO"]], cwd=root, capture_output=True, text=True,
                             check=True).stdout.split()
    assert tracked, "no committed repository"
    for name in tracked:
        assert (tmp_path / name).read_text() == (root / name).read_text(), f"{name} differs from what make demo writes"
