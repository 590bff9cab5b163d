"""Real tritonserver starts through clients.serve (CPU, ~2-10 s each)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from clients import serve as serve_mod
from clients.serve import ServerStartError, TritonServer, model_failures
from clients.tools import perf_analyzer_path, perf_env

START_TIMEOUT = 180.0

ADD_CONFIG = """
name: "{name}"
backend: "{backend}"
max_batch_size: 0
input [
  {{ name: "A" data_type: TYPE_FP32 dims: [ 4 ] }},
  {{ name: "B" data_type: TYPE_FP32 dims: [ 4 ] }}
]
output [ {{ name: "C" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
"""

# The stub's interpreter ignores PYTHONPATH and finds its own Python's site-packages first: like
# every model of ours, put PYTHONPATH's folders ahead, or a host whose Python has numpy 2 hands
# the stub numpy 2, with which Triton 2.51's stub builds empty output tensors (HTTP 500).
ADD_MODEL = """
import os, site, sys
_own = list(sys.path)
[site.addsitedir(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
sys.path[:] = [p for p in sys.path if p not in _own] + _own
import numpy as np
import triton_python_backend_utils as pb_utils

class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for r in requests:
            a = pb_utils.get_input_tensor_by_name(r, "A").as_numpy()
            b = pb_utils.get_input_tensor_by_name(r, "B").as_numpy()
            c = (a + b + {offset}).astype(np.float32)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("C", c)]))
        return responses
"""


def _model(repo: Path, name: str, backend: str, model_py: str | None) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ADD_CONFIG.format(name=name, backend=backend))
    if model_py is not None:
        (repo / name / "1" / "model.py").write_text(model_py)


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A fake checkout whose backends/easel_add is a Python-based backend."""
    root = tmp_path_factory.mktemp("project")
    (root / "backends" / "easel_add").mkdir(parents=True)
    (root / "backends" / "easel_add" / "model.py").write_text(ADD_MODEL.format(offset=100))
    return root


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    _model(root, "add", "python", ADD_MODEL.format(offset=0))
    # Python-based backend: code comes from the backend dir, not the version folder.
    _model(root, "add_be", "easel_add", None)
    return root


@pytest.fixture(scope="module")
def plain_repo(tmp_path_factory) -> Path:
    """Only `backend: "python"` models: servable with the real checkout's backends/."""
    root = tmp_path_factory.mktemp("plain_repo")
    _model(root, "add", "python", ADD_MODEL.format(offset=0))
    return root


@pytest.fixture(scope="module")
def server(repo, project):
    with TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0,
                      ready_timeout=START_TIMEOUT, project=project) as s:
        yield s
    assert s.proc.returncode is not None


def _infer(module, url: str, model: str) -> np.ndarray:
    a = np.arange(4, dtype=np.float32)
    b = np.ones(4, dtype=np.float32)
    client = module.InferenceServerClient(url)
    try:
        inputs = [module.InferInput("A", [4], "FP32"), module.InferInput("B", [4], "FP32")]
        inputs[0].set_data_from_numpy(a)
        inputs[1].set_data_from_numpy(b)
        return client.infer(model, inputs).as_numpy("C")
    finally:
        client.close()


def test_ready_and_infer_http_grpc(server):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    assert server.is_ready()
    expected = np.arange(4, dtype=np.float32) + 1
    np.testing.assert_array_equal(_infer(httpclient, server.url_http, "add"), expected)
    np.testing.assert_array_equal(_infer(grpcclient, server.url_grpc, "add"), expected)
    np.testing.assert_array_equal(_infer(httpclient, server.url_http, "add_be"), expected + 100)
    np.testing.assert_array_equal(_infer(grpcclient, server.url_grpc, "add_be"), expected + 100)


def test_its_stubs_are_told_apart_from_other_servers_stubs(server):
    """What stop() falls back on when the server is already gone: a pid it saw as a stub is killed
    only while it is still a stub of this server (a reused pid may be another server's stub)."""
    from clients import procs

    assert server._stubs
    for pid in server._stubs:
        assert procs.stub_of(pid, server.region_prefix)
        assert not procs.stub_of(pid, procs.region_prefix(owner=1))
    assert not procs.stub_of(os.getpid(), server.region_prefix)


def test_backend_dir_holds_real_copies(server):
    backends = server.run_dir / "backends"
    for rel in ("python/libtriton_python.so", "python/triton_python_backend_stub",
                "python/triton_python_backend_utils.py", "easel_add/model.py"):
        path = backends / rel
        assert path.is_file() and not path.is_symlink(), rel
    assert "successfully loaded 'add_be'" in server.log_text()


def test_perf_analyzer_runs(server):
    try:
        binary = perf_analyzer_path()
    except FileNotFoundError:
        pytest.skip("perf_analyzer not installed")
    proc = subprocess.run(
        [str(binary), "-m", "add", "-u", server.url_http, "--concurrency-range", "1",
         "--measurement-interval", "1000", "--stability-percentage", "999",
         "--max-trials", "3"],
        env=perf_env(), capture_output=True, text=True, timeout=120)
    if "libb64.so.0d" in proc.stderr:
        pytest.skip("libb64.so.0d missing (apt-get install libb64-0d)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Throughput" in proc.stdout


def test_stop_removes_run_dir_and_keeps_log(repo, project):
    s = TritonServer(repo, http_port=0, grpc_port=0, metrics_port=0, project=project)
    s.start()
    s.wait_ready(START_TIMEOUT)
    run_dir = s.run_dir
    assert s.stop() == 0
    assert not run_dir.exists()
    assert "successfully loaded 'add'" in s.log_text()


@pytest.fixture
def broken_repo(tmp_path) -> Path:
    _model(tmp_path, "good", "python", ADD_MODEL.format(offset=0))
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "config.pbtxt").write_text(
        'name: "broken"\nbackend: "python"\n'
        'input [ { name: "A" data_type: TYPE_NOPE dims: [ 1 ] } ]\n')
    return tmp_path


def test_broken_config_names_model(broken_repo, project):
    s = TritonServer(broken_repo, http_port=0, grpc_port=0, metrics_port=0,
                     ready_timeout=START_TIMEOUT, project=project)
    with pytest.raises(ServerStartError) as info:
        with s:
            pass
    assert "broken" in info.value.failed_models
    assert "TYPE_NOPE" in info.value.failed_models["broken"]
    assert "broken" in str(info.value)
    assert s.proc.poll() is not None


def test_failing_model_py_names_model(tmp_path, project):
    _model(tmp_path, "boom", "python", 'raise RuntimeError("kaboom")\n')
    with pytest.raises(ServerStartError) as info:
        with TritonServer(tmp_path, http_port=0, grpc_port=0, metrics_port=0,
                          ready_timeout=START_TIMEOUT, project=project):
            pass
    assert "kaboom" in info.value.failed_models["boom"]


def test_serve_detached_failure_prints_model(broken_repo, monkeypatch, capsys):
    monkeypatch.setattr(serve_mod, "project_root", lambda: broken_repo)  # no easel_* needed
    code = serve_mod.serve(broken_repo, 0, 0, 0, foreground=False, timeout=START_TIMEOUT)
    assert code == 1
    err = capsys.readouterr().err
    assert "broken" in err and "failed to load" in err
    # A failed start keeps its run dir for inspection; the message points at it.
    log_path = Path(re.search(r"\(log: (\S+)\)", err)[1])
    assert log_path.is_file()
    shutil.rmtree(log_path.parent)


def test_model_failures_parses_log():
    text = "\n".join([
        '[libprotobuf ERROR x.cc:337] Error parsing text-format inference.ModelConfig: '
        '3:43: Unknown enumeration value of "TYPE_X" for field "data_type".',
        "E1122 model_repository_manager.cc:1460] \"Poll failed for model directory 'a': "
        "failed to read text proto from /r/a/config.pbtxt\"",
        "E1122 model_lifecycle.cc:642] \"failed to load 'b' version 1: Invalid argument: "
        "unable to find backend library for backend 'easel_nope'\"",
        "| c     | 1       | UNAVAILABLE: Internal: RuntimeError: boom |",
        "| d     | 1       | READY |",
    ])
    failures = model_failures(text)
    assert set(failures) == {"a", "b", "c"}
    assert "TYPE_X" in failures["a"]
    assert "easel_nope" in failures["b"]
    assert failures["c"] == "Internal: RuntimeError: boom"


def _cli(*args: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "clients.cli", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_cli_detach_then_kill(plain_repo, tmp_path):
    pid_file = tmp_path / "server.pid"
    proc = _cli("serve", "--repo", str(plain_repo), "--http-port", "0", "--grpc-port", "0",
                "--metrics-port", "0", "--detach", "--pid-file", str(pid_file),
                "--timeout", str(START_TIMEOUT))
    out, err = proc.communicate(timeout=START_TIMEOUT + 30)
    assert proc.returncode == 0, err
    values = dict(re.findall(r"^(EASEL_SERVER_\w+)=(.*)$", out, re.M))
    pid = int(values["EASEL_SERVER_PID"])
    try:
        assert int(pid_file.read_text()) == pid
        assert Path(values["EASEL_SERVER_LOG"]).is_file()
        s = TritonServer(plain_repo, http_port=int(values["EASEL_SERVER_HTTP"].rsplit(":", 1)[1]))
        assert s.is_ready()
    finally:
        os.kill(pid, signal.SIGTERM)
    for _ in range(120):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.5)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail("detached server ignored SIGTERM")
    shutil.rmtree(Path(values["EASEL_SERVER_LOG"]).parent)


def test_cli_foreground_forwards_sigint(plain_repo):
    proc = _cli("serve", "--repo", str(plain_repo), "--http-port", "0", "--grpc-port", "0",
                "--metrics-port", "0", "--timeout", str(START_TIMEOUT))
    try:
        deadline = time.monotonic() + START_TIMEOUT
        seen = ""
        while "easel serve: ready" not in seen:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, seen
            seen += line
            assert time.monotonic() < deadline, seen
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=60)
        assert proc.returncode == 0, seen + rest
        assert "Signal (2) received" in seen + rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _gpu_model(repo: Path, name: str, gpus: str) -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(ADD_CONFIG.format(name=name, backend="python").replace(
        "{ kind: KIND_CPU count: 1 }", f"{{ kind: KIND_GPU count: 2 gpus: [ {gpus} ] }}"))


def test_cuda_pool_on_every_gpu_the_repository_names(tmp_path):
    _gpu_model(tmp_path, "denoiser_gpu0", "0")
    _gpu_model(tmp_path, "controlnet", "1, 3")
    _model(tmp_path, "on_cpu", "python", None)
    pool = f"{serve_mod.DEFAULT_CUDA_POOL_MIB * 2**20}"
    server = TritonServer(tmp_path)
    assert server.cuda_pool_args() == [f"--cuda-memory-pool-byte-size={g}:{pool}" for g in (0, 1, 3)]
    assert TritonServer(tmp_path, cuda_pool_mib=0).cuda_pool_args() == []
    # a pool the caller gives wins
    given = TritonServer(tmp_path, extra_args=("--cuda-memory-pool-byte-size=0:1024",))
    assert given.cuda_pool_args() == []


def test_cuda_pool_none_for_a_cpu_repository(tmp_path):
    _model(tmp_path, "on_cpu", "python", None)
    assert TritonServer(tmp_path).cuda_pool_args() == []
