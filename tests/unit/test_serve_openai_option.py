"""`easel serve --openai-port` without a server (the real one: tests/server/test_openai_serve.py), and
`make bench-plots`' entry point."""
from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

import pytest
from PIL import Image

from clients import cli
from clients.supervise import OpenAIApi, ServeOptions, busy_ports

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def test_openai_port_parses_and_reaches_the_options():
    args = cli.build_parser().parse_args(["serve", "--repo", "r", "--openai-port", "9000"])
    assert args.openai_port == 9000
    assert cli.build_parser().parse_args(["serve", "--repo", "r"]).openai_port is None


def test_openai_port_needs_the_foreground(tmp_path, capsys):
    assert cli.main(["serve", "--repo", str(tmp_path), "--detach", "--openai-port", "9000"]) == 1
    assert "--openai-port needs the foreground" in capsys.readouterr().err


def test_a_busy_openai_port_stops_the_start():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        assert busy_ports(ServeOptions(Path("r"), 0, 0, 0, openai_port=port)) == [port]
    assert busy_ports(ServeOptions(Path("r"), 0, 0, 0)) == []


def test_the_api_runs_as_easel_openai_on_the_servers_grpc_port():
    api = OpenAIApi(9000, "localhost:8001")
    assert api.argv() == [sys.executable, "-m", "clients.cli", "openai", "--triton", "localhost:8001",
                          "--port", "9000"]
    assert api.url == "http://localhost:9000/v1" and api.exited() is None


def test_bench_plots_redraws_each_folder_from_its_json(tmp_path):
    pytest.importorskip("matplotlib")
    from clients.bench import report as bench_report

    folders = sorted(p.parent for p in RESULTS.glob("*/results.json"))
    assert folders, RESULTS
    copies = []
    for folder in folders:
        copies.append(tmp_path / folder.name)
        copies[-1].mkdir()
        shutil.copy(folder / "results.json", copies[-1])
    (tmp_path / "empty").mkdir()
    assert bench_report.main([*map(str, copies), str(tmp_path / "empty")]) == 0
    for copy in copies:
        assert sorted(p.name for p in copy.iterdir()) == ["latency.png", "results.json", "throughput.png"]
        for name in ("latency.png", "throughput.png"):
            with Image.open(copy / name) as img:
                assert img.size[0] >= 700 and img.size[1] >= 400
    assert not any((tmp_path / "empty").iterdir())
