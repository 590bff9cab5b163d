"""perf_analyzer (plain unary, no --streaming) drives `easel` with the input file we ship."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from clients.tools import perf_analyzer_path, perf_env

INPUT = Path(__file__).resolve().parents[2] / "clients" / "perf" / "txt2img.json"


@pytest.mark.parametrize("inputs", ["txt2img.json", "inpaint.json"])  # inpaint: edits, files as b64
def test_perf_analyzer_runs_against_easel(server, tmp_path, inputs):
    report = tmp_path / "perf.csv"
    data = INPUT.with_name(inputs)
    argv = [str(perf_analyzer_path()), "-m", "easel", "-u", server.url_http, "--input-data", str(data),
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
    assert json.loads(data.read_text())["data"]


def test_readme_command_runs_as_written(server):
    """The load-testing command of clients/perf/README.md, from the checkout, with no library path
    set by hand: only the server's address and the measurement windows change."""
    root = INPUT.parents[2]
    text = (root / "clients" / "perf" / "README.md").read_text()
    block = re.search(r"```sh\n(.*?)```", text, re.S)[1].replace("\\\n", " ")
    argv = shlex.split(block)
    assert argv[0] == ".venv/bin/perf_analyzer", argv
    argv = [server.url_http if a == "localhost:8000" else a for a in argv]
    i = argv.index("--measurement-interval")  # time windows are too short on a shared 2-core host
    argv[i:i + 2] = ["--measurement-mode", "count_windows", "--measurement-request-count", "4"]
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run([*argv, "--stability-percentage", "900", "--max-trials", "10"], cwd=root, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Throughput" in done.stdout
