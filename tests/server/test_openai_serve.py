"""`easel serve --openai-port` (`make serve OPENAI_PORT=...`): the OpenAI images API
started beside the server once it is ready, answering the official client and aiperf's
image-generation benchmark (from its own venv, `make aiperf`), then drained and stopped with the
server on SIGTERM. One `easel serve` process of its own on the tiny models."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest
from openai import OpenAI
from PIL import Image

from clients import procs
from clients.serve import free_port
from clients.triton_install import project_root
from tests.server.test_lifecycle import START_S, EaselServe, repo  # noqa: F401  (repo: a fixture)

AIPERF = project_root() / ".venv-aiperf" / "bin" / "aiperf"
AIPERF_REQUESTS = 4
SMALL = {"steps": 2, "seed": 1}


class Serving(EaselServe):
    @property
    def openai_url(self) -> str:
        return re.search(r"openai (http://\S+/v1)\)", self.text)[1]

    def api_pid(self) -> int:
        pids = [p for p in procs.children(self.proc.pid) if "openai" in procs.cmdline(p)]
        assert len(pids) == 1, pids
        return pids[0]


@pytest.fixture(scope="module")
def serving(repo):  # noqa: F811
    s = Serving(repo, extra=("--openai-port", str(free_port())))
    try:
        s.wait_for(r"easel serve: ready .*openai http://localhost:\d+/v1")
        yield s
    finally:
        s.close()


def test_the_api_answers_the_openai_client_once_serve_says_ready(serving):
    client = OpenAI(base_url=serving.openai_url, api_key="unused", max_retries=0, timeout=300)
    assert [m.id for m in client.models.list()] == ["easel"]
    res = client.images.generate(prompt="a yellow car", size="64x64", response_format="b64_json",
                                 extra_body=SMALL)
    with Image.open(io.BytesIO(base64.b64decode(res.data[0].b64_json))) as img:
        assert img.format == "PNG" and img.size == (64, 64)
    assert res.data[0].model_extra["info"]["seed"] == 1


def test_aiperf_image_generation(serving, tiny_model, tmp_path):
    if not AIPERF.is_file():
        message = f"{AIPERF} is missing: `make aiperf` installs it (make test does)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # The access log reaches serving.text a little after each answer: count once earlier tests'
    # lines have all arrived, or a late one is counted as aiperf's.
    before = -1
    while before != (before := serving.text.count("images/generations n=1 size=64x64: 200")):
        time.sleep(1.0)
    argv = [str(AIPERF), "profile", "--model", "easel", "--endpoint-type", "image-generation",
            "--url", serving.openai_url.removesuffix("/v1"),
            # aiperf counts prompt tokens: the tiny model's own CLIP tokenizer, a local folder (no hub).
            "--tokenizer", str(tiny_model / "tokenizer"), "--isl", "12",
            "--extra-inputs", "size:64x64", "--extra-inputs", f"steps:{SMALL['steps']}",
            "--request-count", str(AIPERF_REQUESTS), "--concurrency", "2",
            "--no-server-metrics", "--no-gpu-telemetry", "--ui", "none", "--artifact-dir", str(tmp_path)]
    start = time.monotonic()
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    took = time.monotonic() - start
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]

    # aiperf's own account: its JSON summary and one record per request.
    summary = json.loads((tmp_path / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] and not summary["was_cancelled"], summary.get("error_summary")
    assert summary["error_summary"] == []
    assert summary["request_count"]["avg"] == AIPERF_REQUESTS
    assert summary["request_error_rate"]["avg"] == 0
    records = [json.loads(line) for line in (tmp_path / "profile_export.jsonl").read_text().splitlines()]
    assert len(records) == AIPERF_REQUESTS and not [r["error"] for r in records if r.get("error")]
    # Each answer carried an image: a 64x64 PNG is a few KB of base64.
    assert all(r["metrics"]["http_req_data_received"]["value"] > 1 for r in records), records[0]["metrics"]
    # ... and the API served them (its access log goes to easel serve's stderr).
    serving.wait_for("images/generations n=1 size=64x64: 200", 10)
    assert serving.text.count("images/generations n=1 size=64x64: 200") - before == AIPERF_REQUESTS
    latency = summary["request_latency"]
    print(f"\naiperf: {AIPERF_REQUESTS} requests in {took:.1f} s (its benchmark "
          f"{summary['benchmark_duration']['avg']:.1f} s), latency p50 {latency['p50'] / 1000:.2f} s")


def test_a_dead_api_is_started_again(serving):
    api = serving.api_pid()
    mark = len(serving.lines)
    os.kill(api, signal.SIGKILL)
    serving.wait_for(r"easel openai exited with code -9; starting it again", 30, after=mark)
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{serving.openai_url}/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, serving.text[-3000:]
        time.sleep(0.5)
    assert serving.api_pid() != api and serving.ready()


def test_sigterm_drains_the_api_requests_then_stops_it(serving):
    api = serving.api_pid()
    port = int(re.search(r":(\d+)/v1$", serving.openai_url)[1])
    url = f"{serving.openai_url}/images/generations"
    answer: dict = {}

    def in_flight():
        answer["response"] = httpx.post(url, timeout=300, json={
            "prompt": "in flight", "size": "256x256", "steps": 50, "seed": 5})

    before = serving.steps_run()
    thread = threading.Thread(target=in_flight, daemon=True)
    thread.start()
    serving.wait_for_steps(2, before)
    assert thread.is_alive(), f"the request finished before the signal: make it longer ({answer.get('response') and answer['response'].text})"
    serving.proc.send_signal(signal.SIGTERM)
    serving.wait_for(r"stopping: draining", 10)

    # New requests through the API are refused at once, as the server's own are.
    late = httpx.post(url, timeout=30, json={"prompt": "too late", "size": "64x64", **SMALL})
    assert late.status_code == 503, late.text
    assert "draining" in late.json()["error"]["message"], late.text

    thread.join(240)
    response = answer.get("response")
    assert response is not None and response.status_code == 200, response and response.text
    assert response.json()["data"][0]["info"]["steps"] == 50
    assert serving.proc.wait(60) == 0, serving.text[-3000:]
    assert serving.wait_for(r"drain (complete|timed out)", 5)[1] == "complete"
    assert not procs.pid_alive(api) and not procs.port_in_use(port)
