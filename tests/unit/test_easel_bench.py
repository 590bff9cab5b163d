"""`easel bench`'s report, from a synthetic results dict: summary fields, the Markdown tables, the
plots, the agreed keys. No server, no model."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from PIL import Image

from clients.bench import harness as easel_bench, models as bench_setup, report as bench_report, servers as bench_servers


def _config(name, compiled=True):
    throughput = {"easel": {"1": {"img_s": 0.4}, "4": {"img_s": 1.1}, "8": {"img_s": 1.5}},
                  "diffusers_eager": {"1": {"img_s": 0.45}, "4": {"img_s": 0.75}, "8": {"img_s": 0.8}},
                  "diffusers_compiled": {"1": {"img_s": 0.6}, "4": {"img_s": 1.0}, "8": {"img_s": 1.1}}}
    entry = {
        "name": name, "gpus": [0], "size": 1024, "steps": 50, "throughput_steps": 30,
        "easel": {"runtime": "graphs", "latency_s": [2.6, 2.5, 2.9], "export_s": 61.0,
                  "cold_start_s": {"first": 95.0, "second": 40.0},
                  "runtime_warmup_s": {"first": 12.0, "second": 11.0},
                  "stages_median_s": {"denoise_s": 2.3, "text_encoder_s": 0.02, "vae_decoder_s": 0.09},
                  "throughput": throughput["easel"]},
        "diffusers_eager": {"latency_s": [3.6, 3.5, 3.7], "load_s": 9.0, "throughput": throughput["diffusers_eager"]},
        "diffusers_compiled": ({"mode": "reduce-overhead", "compile_s": 130.0, "latency_s": [2.2, 2.1, 2.3],
                                "throughput": throughput["diffusers_compiled"]} if compiled
                               else {"skipped": "--skip-diffusers-compiled"}),
    }
    return bench_report.finalize(entry)


def test_finalize_summarizes_raw_samples():
    e = _config("0C/0L")
    assert e["easel_p50_s"] == pytest.approx(2.6)
    assert e["easel_p95_s"] == pytest.approx(np.percentile([2.5, 2.6, 2.9], 95))
    assert e["diffusers_eager_p50_s"] == pytest.approx(3.6)
    assert e["ratio_easel_over_diffusers_eager"] == pytest.approx(2.6 / 3.6)
    assert e["ratio_easel_over_diffusers_compiled"] == pytest.approx(2.6 / 2.2)
    assert e["throughput_img_s"]["4"] == {"easel": 1.1, "diffusers_eager": 0.75, "diffusers_compiled": 1.0}
    assert (e["cold_start_first_s"], e["cold_start_second_s"]) == (95.0, 40.0)
    assert e["diffusers_compile_mode"] == "reduce-overhead"

    skipped = _config("1C/0L", compiled=False)
    assert skipped["diffusers_compiled_p50_s"] is None and skipped["ratio_easel_over_diffusers_compiled"] is None
    assert skipped["throughput_img_s"]["8"]["diffusers_compiled"] is None


def test_fidelity_from_the_seed0_images(tmp_path):
    rng = np.random.default_rng(0)
    ref = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    near = ref.copy()
    near[0, 0, 0] ^= 1
    Image.fromarray(ref).save(bench_report.image_path(tmp_path, "0C/0L", "diffusers_eager"))
    Image.fromarray(near).save(bench_report.image_path(tmp_path, "0C/0L", "easel", "graphs"))
    Image.fromarray(ref).save(bench_report.image_path(tmp_path, "0C/0L", "diffusers_compiled"))
    entry = bench_report.finalize({**_config("0C/0L")}, tmp_path)
    f = entry["fidelity"]
    assert f["max_abs_diff"] == 1 and not f["identical"] and f["psnr_db"] > 60 and 0.99 < f["ssim"] <= 1
    same = entry["fidelity_compiled_vs_eager"]
    assert same["identical"] and same["psnr_db"] is None  # infinite: JSON has no infinity
    json.dumps(entry, allow_nan=False)


def test_report_markdown_and_plots(tmp_path):
    results = {"gpu": "NVIDIA H200", "driver": "570.0", "versions": {"torch": "2.11.0", "diffusers": "0.42.1"},
               "command": ["easel", "bench", "--runs", "3"], "date": "2026-11-22T10:00:00+00:00",
               "configs": [_config("0C/0L"), _config("1C/1L", compiled=False)]}
    assert bench_report.validate(results) == []
    assert "configs[0].easel_p50_s" in bench_report.validate({**results, "configs": [{"name": "x"}]})

    md = bench_report.markdown(results)
    assert "| 0C/0L | NVIDIA H200 x1 | 1024 | 50 | graphs | 2.600 / " in md
    assert "| 0C/0L (graphs) | 30 | 4 | 1.100 | 0.750 | 1.000 | 1.47x | 1.10x |" in md
    assert "| 1C/1L (graphs) | 30 | 8 | 1.500 | 0.800 | n/a | 1.88x | n/a |" in md
    assert "(reduce-overhead)" in md and "95.0" in md and "40.0" in md and "denoise_s" in md
    assert "## Image fidelity" in md

    pytest.importorskip("matplotlib")
    (tmp_path / "results.json").write_text(json.dumps(results))
    written = bench_report.plot(tmp_path / "results.json")
    assert [p.name for p in written] == ["latency.png", "throughput.png"]
    for path in written:
        with Image.open(path) as img:
            assert img.size[0] > 500 and img.size[1] > 300

    # --replot rewrites the Markdown and the plots from the JSON alone
    for path in written:
        path.unlink()
    assert easel_bench.main(["--replot", str(tmp_path)]) == 0
    assert (tmp_path / "latency.png").is_file() and (tmp_path / "results.md").read_text() == md


def test_runs_merge_by_configuration_and_runtime():
    parse = bench_setup.parser().parse_args
    graphs = bench_setup.resolve(parse(["--runtime", "graphs"]))
    results = {"configs": [{**_config("0C/0L"), "runtime": "graphs"}]}
    assert easel_bench.config_entry(results, graphs) is results["configs"][0]  # phases measured now replace
    # Another Easel runtime is its own entry; the diffusers phases it skips come from its sibling.
    compiled = bench_setup.resolve(parse(["--runtime", "compiled"]))
    entry = easel_bench.config_entry(results, compiled, {"diffusers_eager", "diffusers_compiled"})
    assert len(results["configs"]) == 2 and entry["name"] == "0C/0L"
    assert entry["diffusers_eager"]["latency_s"] == [3.6, 3.5, 3.7]
    assert entry["diffusers_eager"]["copied_from_entry_with_runtime"] == "graphs"
    assert "copied_from_entry_with_runtime" not in results["configs"][0]["diffusers_eager"]
    other = easel_bench.config_entry(results, bench_setup.resolve(parse(["--loras", "1"])))
    assert other["name"] == "0C/1L" and "diffusers_eager" not in other and len(results["configs"]) == 3


def test_setup_defaults_and_gpu_slug():
    gpu = bench_setup.resolve(bench_setup.parser().parse_args([]))
    assert (gpu.size, gpu.steps, gpu.throughput_steps, gpu.runs, gpu.concurrency) == (1024, 50, 30, 5, (1, 2, 4, 8))
    assert (gpu.device, gpu.dtype, gpu.name, gpu.easel_rounds(1), gpu.easel_rounds(8)) == (
        "cuda", "fp16", "0C/0L", 8, 2)
    smoke = bench_setup.resolve(bench_setup.parser().parse_args(["--cpu-smoke", "--loras", "2"]))
    assert (smoke.device, smoke.dtype, smoke.size, smoke.steps, smoke.runtime, smoke.name) == (
        "cpu", "fp32", 64, 4, "eager", "0C/2L")
    assert bench_setup.gpu_slug("NVIDIA H200") == "h200"
    assert bench_setup.gpu_slug("NVIDIA H100 80GB HBM3", 2) == "h100-80gb-hbm3x2"
    with pytest.raises(SystemExit):
        bench_setup.parser().parse_args(["--concurrency", "1,x"])


def test_configs_flag_measures_several_configurations_in_one_run():
    parse = bench_setup.parser().parse_args
    setups = bench_setup.resolve_all(parse(["--configs", "0C/0L, 1C/1L,3C/2L", "--gpus", "0,1",
                                            "--controlnet-gpus", "2,3"]))
    assert [s.name for s in setups] == ["0C/0L", "1C/1L", "3C/2L"]
    assert all(s.gpus == (0, 1) and s.controlnet_gpus == (2, 3) for s in setups)
    assert [s.name for s in bench_setup.resolve_all(parse(["--loras", "2"]))] == ["0C/2L"]
    assert bench_setup.resolve_all(parse([]))[0].controlnet_gpus is None
    for bad in ("1C", "1C/1L,x", ""):
        with pytest.raises(SystemExit):
            parse(["--configs", bad])
    with pytest.raises(SystemExit, match="not both"):
        bench_setup.resolve_all(parse(["--configs", "1C/1L", "--loras", "1"]))
    # Where the ControlNets run is part of a configuration: another placement is another entry.
    results = {"configs": []}
    first = easel_bench.config_entry(results, setups[1])
    elsewhere = dataclasses.replace(setups[1], controlnet_gpus=None)
    assert easel_bench.config_entry(results, setups[1]) is first
    assert easel_bench.config_entry(results, elsewhere) is not first and len(results["configs"]) == 2


def test_cfg_parallel_flag_names_the_gpu_pairs():
    parse = bench_setup.parser().parse_args
    (setup,) = bench_setup.resolve_all(parse(["--cfg-parallel", "0:1"]))
    assert setup.gpus == (0,) and setup.cfg_parallel == ((0, 1),) and setup.denoiser_gpus == (0, 1)
    with pytest.raises(SystemExit, match="not with --gpus"):
        bench_setup.resolve(parse(["--cfg-parallel", "0:1", "--gpus", "0"]))
    for bad in ("0:0", "0", "0:1:2", "a:b"):
        with pytest.raises(SystemExit):
            parse(["--cfg-parallel", bad])
    # Latent parallelism is another configuration than one GPU, and than two replicas.
    results = {"configs": []}
    single = bench_setup.resolve(parse([]))
    replicas = bench_setup.resolve(parse(["--gpus", "0,1"]))
    entries = [easel_bench.config_entry(results, s) for s in (setup, single, replicas)]
    assert len({id(e) for e in entries}) == 3
    assert entries[0]["gpus"] == [0, 1] and entries[0]["cfg_parallel"] == [[0, 1]]


def test_controlnet_breakdown_from_metric_deltas():
    def snap(calls, wall, compute, wait, steps):
        return {"easel_controlnet_calls_total": {'model="d0"': calls},
                "easel_controlnet_call_seconds_total": {'model="d0"': wall},
                "easel_controlnet_compute_seconds_total": {'instance="c0"': compute / 2, 'instance="c1"': compute / 2},
                "easel_controlnet_wait_seconds_total": {'model="d0"': wait},
                "easel_denoiser_step_rows_count": {'model="d0"': steps}}

    b = easel_bench.controlnet_breakdown(snap(2, 0.1, 0.06, 0.01, 2), snap(102, 5.1, 3.06, 0.51, 52))
    assert b["calls"] == 100 and b["bls_wall_ms"] == pytest.approx(50) and b["compute_ms"] == pytest.approx(30)
    assert b["transfer_and_overhead_ms"] == pytest.approx(20) and b["decoder_wait_ms_per_step"] == pytest.approx(10)
    assert "exec_ms" not in b  # a server from before the call's parts
    # The wall time's parts: 8 ms waiting for the inputs, 38 in the BLS request (30 of compute), 4 taking them.
    parts = {"ready": 0.8, "exec": 3.8, "outputs": 0.4}
    after = {**snap(102, 5.1, 3.06, 0.51, 52),
             **{f"easel_controlnet_call_{k}_seconds_total": {'model="d0"': v} for k, v in parts.items()}}
    b = easel_bench.controlnet_breakdown(snap(2, 0.1, 0.06, 0.01, 2), after)
    assert (b["ready_ms"], b["exec_ms"], b["outputs_ms"]) == pytest.approx((8, 38, 4))
    assert b["handoff_ms"] == pytest.approx(38 - 30)
    assert "| 8.0 | 38.0 | 30.0 | 8.0 | 4.0 |" in easel_bench.markdown(
        {"gpu": "g", "configs": [{"name": "1C/0L", "gpus": [0], "size": 1024, "steps": 50,
                                  "easel": {"controlnet_per_call": b}}]})
    assert easel_bench.controlnet_breakdown(snap(2, 0.1, 0.06, 0, 2), snap(2, 0.1, 0.06, 0, 9)) is None


def test_controlnet_ideal_from_the_same_runs_parts():
    def snap(steps, encoder, decoder, sampler, orchestration, calls, compute, wait):
        parts = {"encoder": encoder, "decoder": decoder, "sampler": sampler, "orchestration": orchestration}
        return {"easel_controlnet_calls_total": {'model="d0"': calls},
                "easel_controlnet_call_seconds_total": {'model="d0"': compute * 1.5},
                "easel_controlnet_compute_seconds_total": {'instance="c0"': compute},
                "easel_controlnet_wait_seconds_total": {'model="d0"': wait},
                "easel_denoiser_step_rows_count": {'model="d0"': steps},
                "easel_denoiser_step_seconds_sum": {f'model="d0",part="{k}"': v for k, v in parts.items()}}

    # 100 steps, per step: encoder 10 ms, decoder 12, sampler 0.5, orchestration 4.5 of which 4 is the
    # wait for one ControlNet of 14 ms a call.
    before, after = snap(0, 0, 0, 0, 0, 0, 0, 0), snap(100, 1.0, 1.2, 0.05, 0.45, 100, 1.4, 0.4)
    b = easel_bench.controlnet_breakdown(before, after)
    ideal = easel_bench.controlnet_ideal(before, after, 1, b)
    assert ideal["step_ms"] == pytest.approx(27) and ideal["rest_ms"] == pytest.approx(1)
    assert ideal["ideal_step_ms"] == pytest.approx(14 + 12 + 1) and ideal["serial_step_ms"] == pytest.approx(37)
    assert ideal["of_ideal"] == pytest.approx(1.0) and ideal["ideal_speedup"] == pytest.approx(37 / 27)
    two = easel_bench.controlnet_ideal(before, after, 2, b)  # two on GPUs of their own: the same ideal step
    assert two["ideal_step_ms"] == pytest.approx(27) and two["serial_step_ms"] == pytest.approx(51)
    assert easel_bench.controlnet_ideal(before, after, 0, b) is None


def test_shared_compile_cache_links_the_compiling_models_and_voids_cold_start(tmp_path):
    repo = tmp_path / "repo"
    for model in ("denoiser_gpu0", "denoiser_gpu2", "controlnet", "text_encoder", "vae_decoder"):
        (repo / model / "1").mkdir(parents=True)
    shared = bench_servers.share_compile_cache(repo, tmp_path / "work" / "compile-cache")
    linked = sorted(p.parent.parent.name for p in repo.glob("*/1/compile_cache"))
    assert linked == ["controlnet", "denoiser_gpu0", "denoiser_gpu2"]
    (repo / "controlnet" / "1" / "compile_cache" / "kernel").write_text("x")
    assert (shared / "kernel").read_text() == "x"  # one folder behind every link
    assert bench_servers.share_compile_cache(repo, shared) == shared  # again: the links stay
    assert bench_setup.resolve(bench_setup.parser().parse_args(["--shared-compile-cache"])).shared_compile_cache
    # Its starts are not cold starts: the report leaves them out.
    entry = _config("0C/0L")
    entry["easel"]["shared_compile_cache"] = str(shared)
    entry = bench_report.finalize(entry)
    assert entry["cold_start_first_s"] is None and entry["cold_start_second_s"] is None


def test_a_phase_boundary_waits_for_the_steps_to_be_published():
    # The denoiser publishes a step's times after the response that step belonged to: a
    # snapshot at the response lacks the last steps (the 2026-11-28 1C/0L run counted 241 of 250).
    def snap(steps, calls):
        return {"easel_denoiser_step_rows_count": {'model="d0"': steps},
                "easel_controlnet_calls_total": {'model="d0"': calls}}

    readings = iter([snap(239, 250), snap(248, 250), snap(250, 250), snap(250, 250), snap(251, 251)])
    slept = []
    got = easel_bench.settled_snapshot(lambda: next(readings), quiet_s=1.5, sleep=slept.append)
    assert got == snap(250, 250) and slept == [1.5, 1.5, 1.5]

    moving = iter(snap(i, i) for i in range(100))
    got = easel_bench.settled_snapshot(lambda: next(moving), quiet_s=1.0, timeout_s=3.0, sleep=lambda s: None)
    assert got == snap(3, 3)  # gives up (with a warning) after the timeout
