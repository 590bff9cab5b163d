"""`easel bench --edit --cpu-smoke` end to end (clients/bench/edits.py): a real tritonserver on the
tiny model records a template, then measures exact and reusing edits at every mask ratio and
concurrency. Each reusing edit is checked to have reused (the script refuses otherwise) and to
stay near its exact twin: PSNR >= 30 dB (the tiny model at 64 px measured 42-47 dB; a recording
that fed the wrong tokens lands near 10 dB)."""

from __future__ import annotations

import json

from clients.bench.edits import RATIOS
from clients.bench.harness import main

MIN_PSNR = 30.0


def test_the_edit_benchmark_measures_every_mask_ratio_and_concurrency(tmp_path):
    out = tmp_path / "out"
    assert main(["--cpu-smoke", "--edit", "--work", str(tmp_path / "work"), "--out", str(out), "--runs", "2",
                 "--concurrency", "1,2"]) == 0
    results = json.loads((out / "edits.json").read_text())
    assert set(results["latency"]) == {str(r) for r in RATIOS}
    for row in results["latency"].values():
        assert len(row["exact_s"]) == len(row["reuse_s"]) == 2 and row["speedup"] > 0
        assert all(q["psnr"] >= MIN_PSNR and q["masked_psnr"] >= MIN_PSNR for q in row["quality"]), row["quality"]
    for c in ("1", "2"):
        entry = results["throughput"][c]
        assert entry["exact"]["img_s"] > 0 and set(entry["reuse"]["template_use"]) == {"reused"}
        assert set(entry["exact"]["template_use"]) == {None}
        assert 0.05 <= min(entry["mask_ratios"]) <= max(entry["mask_ratios"]) <= 0.5
