"""perf_analyzer (plain unary, no --streaming) drives `easel` with the input file we ship."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from clients.tools import perf_analyzer_path, perf_env

INPUT = Path(__file__).resolve().parents[2] / "clients" / "perf" / "txt2img.json"


def test_perf_analyzer_runs_against_easel(server, tmp_path):
    report = tmp_path / "perf.csv"
    argv = [str(perf_analyzer_path()), "-m", "easel", "-u", server.url_http, "--input-data", str(INPUT),
            "--concurrency-range", "1:2", "--measurement-mode", "count_windows",
            # A loose stability bound: the point is that perf_analyzer drives easel, not a benchmark on a
            # shared 2-core machine.
            "--measurement-request-count", "4", "--max-trials", "10", "--stability-percentage", "900",
            "-f", str(report)]
    done = subprocess.run(argv, env=perf_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Throughput" in done.stdout
    rows = report.read_text().strip().splitlines()
    assert rows[0].startswith("Concurrency") and len(rows) == 3  # header + concurrency 1 and 2
    throughput = [float(r.split(",")[1]) for r in rows[1:]]
    assert all(t > 0 for t in throughput)
    assert json.loads(INPUT.read_text())["data"]
