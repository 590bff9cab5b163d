"""`easel bench --edit --cpu-smoke` end to end (clients/bench/edits.py): a real tritonserver on the
tiny model records a template, then measures exact and reusing edits at every mask ratio and
concurrency, an open-loop load on two denoisers routed by predicted seconds and by row-steps,
then diffusers' inpaint pipeline does the same edits. The server runs the ResNet blocks of reusing
edits on their mask's box too (--conv-subsets; tests/server/test_inpaint.py serves edits without),
and takes the recording where `easel profile-template`'s profile says it pays (--profile-template).
Each reusing edit is checked to have reused (the script refuses otherwise) and to stay near its
exact twin: PSNR >= 20 dB, whole and masked (the tiny model at 64 px measured 27-89 dB with the
boxes, whose 8 x 8, 4 x 4 and 2 x 2 grids a box widened by a token covers much of, and 42-47 dB
without; a recording that fed the wrong tokens lands near 10 dB)."""

from __future__ import annotations

import json

from clients.bench.edits import RATIOS
from clients.bench.harness import main

MIN_PSNR = 20.0


def test_the_edit_benchmark_measures_every_mask_ratio_and_concurrency(tmp_path):
    out = tmp_path / "out"
    assert main(["--cpu-smoke", "--edit", "--work", str(tmp_path / "work"), "--out", str(out), "--runs", "2",
                 "--concurrency", "1,2", "--load-rates", "4,8", "--load-requests", "8", "--conv-subsets",
                 "--profile-template"]) == 0
    results = json.loads((out / "edits.json").read_text())
    exported = json.loads((tmp_path / "work" / "repo-edits-seconds" / "easel_export.json").read_text())
    assert results["conv_subsets"] and exported["options"]["conv_subsets"]
    assert set(results["latency"]) == {str(r) for r in RATIOS}
    for row in results["latency"].values():
        assert len(row["exact_s"]) == len(row["reuse_s"]) == 2 and row["speedup"] > 0 and row["reuse_first_s"] > 0
        assert all(q["psnr"] >= MIN_PSNR and q["masked_psnr"] >= MIN_PSNR for q in row["quality"]), row["quality"]
        for path in ("exact", "reuse"):  # where the seconds went, as the responses say
            stages = row["stages_p50_s"][path]
            assert stages["vae_encoder_s"] > 0 and 0 < stages["denoise_s"] < stages["total_s"], stages
    for c in ("1", "2"):
        entry = results["throughput"][c]
        assert entry["exact"]["img_s"] > 0 and set(entry["reuse"]["template_use"]) == {"reused"}
        assert set(entry["exact"]["template_use"]) == {None}
        assert 0.05 <= min(entry["mask_ratios"]) <= max(entry["mask_ratios"]) <= 0.5
    for routing in ("seconds", "work"):  # the same arrivals on two denoisers, routed each way
        for rate in ("4.0", "8.0"):
            load = results["load"][routing][rate]
            assert load["count"] == 8 and load["template_use"] == {"reused": 8} and load["p95_s"] >= load["p50_s"] > 0
    cache = results["template_cache"]  # the server's metrics: recorded once, reused from the device
    assert cache["misses"] >= 1 and cache["hits"]["device"] >= 2 * len(RATIOS) and cache["stall_s"] == 0
    assert 2 * len(RATIOS) <= results["template_cache_after_latency"]["hits"]["device"] < cache["hits"]["device"]
    # --profile-template: the profile the denoisers planned with, kept beside the results
    assert json.loads((out / "template_blocks.json").read_text())["blocks"]
    for routing in ("seconds", "work"):  # each server's log, kept
        assert "successfully loaded" in (out / f"server-{routing}.log").read_text()
    diffusers = results["diffusers_eager"]  # the same edits through StableDiffusionXLInpaintPipeline
    assert set(diffusers["latency"]) == {str(r) for r in RATIOS} and diffusers["throughput"]["2"]["img_s"] > 0
    assert "diffusers_compiled" not in results  # --cpu-smoke: no torch.compile
    table = (out / "edits.md").read_text()
    assert "| 0.25 |" in table and "| 8.0 | work |" in table  # the 20% mask at 64 px; a load row
    assert "steps stalled for streamed copies" in table and "| 0.25 | reuse |" in table  # (the stages' rows)
    assert (out / "edits_latency.png").stat().st_size > 0 and (out / "edits_load.png").stat().st_size > 0
