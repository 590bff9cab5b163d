"""`easel bench --configs 0C/0L,1C/0L` with both diffusers baselines skipped, on CPU with the tiny
model: the two configurations share one real tritonserver, exported for one ControlNet. Each
configuration's server figures are deltas over its own requests: 1C/0L's called the ControlNet,
0C/0L's did not, on the same server. `--shared-compile-cache` keeps it to one tritonserver launch
(no second, warm start), which keeps the test near a minute on two cores."""

from __future__ import annotations

import json
import logging

from clients.bench.harness import main


def test_configurations_share_one_server_and_read_their_own_metrics(tmp_path, caplog):
    out = tmp_path / "out"
    caplog.set_level(logging.INFO, logger="easel.bench")
    assert main(["--cpu-smoke", "--work", str(tmp_path / "work"), "--out", str(out), "--configs", "0C/0L,1C/0L",
                 "--skip-diffusers-eager", "--skip-diffusers-compiled", "--shared-compile-cache",
                 "--runs", "1", "--concurrency", "1", "--throughput-rounds", "1"]) == 0

    starts = [r for r in caplog.records if r.getMessage().startswith("Easel start(s) for")]
    assert len(starts) == 1, [r.getMessage() for r in starts]
    results = json.loads((out / "results.json").read_text())
    first, second = (next(e for e in results["configs"] if e["name"] == name) for name in ("0C/0L", "1C/0L"))
    a, b = first["easel"], second["easel"]
    assert a["server"]["id"] == b["server"]["id"] and b["server"]["earlier_configs"] == ["0C/0L"]
    assert a["export_options"]["max_controlnets"] >= 1 and a["export_options"]["adapters"]  # sized for 1C/0L
    assert first["served"] == "1C/0L" and second["served"] is None
    assert "cold_start_s" in a and "export_s" in a and "cold_start_s" not in b and "export_s" not in b
    for entry in (first, second):
        assert len(entry["easel"]["latency_s"]) == 1 and entry["throughput_img_s"]["1"]["easel"] > 0
        assert entry["easel"]["counters"]["steps"] > 0
    assert a["counters"]["controlnet_calls"] == 0 and a["controlnet_per_call"] is None
    assert b["counters"]["controlnet_calls"] > 0 and b["controlnet_per_call"]["calls"] > 0
    # 1C/0L's steps are its own: a server total would hold 0C/0L's as well.
    assert b["counters"]["steps"] == a["counters"]["steps"]
    assert (first["easel_server_shared_with"], second["easel_server_shared_with"]) == (["1C/0L"], ["0C/0L"])
    report = (out / "results.md").read_text()
    assert "| 0C/0L | eager | shared with 1C/0L |" in report and "| 1C/0L | eager | shared with 0C/0L |" in report
