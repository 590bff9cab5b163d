"""The admin surface is closed by default: client shared memory, logging,
tracing and the model repository need the admin key on HTTP and gRPC; the stubs' /dev/shm
regions are private to the server's user."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from clients import procs
from clients.serve import ADMIN_HEADER, GRPC_ADMIN_HEADER


@pytest.fixture(params=["http", "grpc"])
def triton(request, server):
    module = httpclient if request.param == "http" else grpcclient
    url = server.url_http if request.param == "http" else server.url_grpc
    client = module.InferenceServerClient(url)
    yield client, {ADMIN_HEADER if request.param == "http" else GRPC_ADMIN_HEADER: server.admin_key}
    client.close()


def _refused(call) -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value)
    assert "restricted" in message, message
    return message


def _stub_region(server) -> Path:
    regions = sorted(procs.SHM_DIR.glob(f"{server.region_prefix}*"))
    assert regions, f"no region named {server.region_prefix}*"
    return regions[0]


def test_client_shared_memory_needs_the_key(triton, server):
    client, admin = triton
    # The attack: a stub's own region registered as a client's input region.
    key = "/" + _stub_region(server).name
    _refused(lambda: client.register_system_shared_memory("stolen", key, 1024))
    _refused(lambda: client.get_system_shared_memory_status())
    _refused(lambda: client.register_cuda_shared_memory("stolen", b"\0" * 64, 0, 1024))
    _refused(lambda: client.get_cuda_shared_memory_status())
    # An operator with the key can still use the API (here: on a region of its own).
    own = f"easel-test-shm-{os.getpid()}"
    fd = os.open(f"/dev/shm/{own}", os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 1024)
        client.register_system_shared_memory("mine", f"/{own}", 1024, headers=admin)
        client.unregister_system_shared_memory("mine", headers=admin)
    finally:
        os.close(fd)
        os.unlink(f"/dev/shm/{own}")


def test_logging_and_tracing_need_the_key(triton):
    client, admin = triton
    _refused(lambda: client.update_log_settings({"log_verbose_level": 1}))
    _refused(lambda: client.get_log_settings())
    _refused(lambda: client.get_trace_settings())
    _refused(lambda: client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]}))
    settings = client.get_log_settings(headers=admin)
    verbose = settings["log_verbose_level"] if isinstance(settings, dict) else settings.settings["log_verbose_level"].uint32_param
    assert int(verbose) == 0


def test_model_repository_needs_the_key(triton):
    client, admin = triton
    _refused(lambda: client.get_model_repository_index())
    _refused(lambda: client.unload_model("easel"))
    _refused(lambda: client.load_model("easel"))
    index = client.get_model_repository_index(headers=admin)
    names = [m["name"] for m in index] if isinstance(index, list) else [m.name for m in index.models]
    assert "easel" in names
    assert client.is_model_ready("easel")  # the refused unload did nothing


def test_inference_metadata_and_statistics_stay_open(triton):
    client, _ = triton
    assert client.is_server_ready()
    assert client.get_model_metadata("easel")
    assert client.get_model_config("easel")
    assert client.get_inference_statistics("easel")  # perf_analyzer reads them


def _server_shm_files(server) -> set[Path]:
    pids = [server.pid, *procs.descendants(server.pid)]
    files = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        files |= {Path(line.split(None, 5)[5]) for line in maps.splitlines()
                  if " /dev/shm/" in line and len(line.split(None, 5)) == 6}
    return files


def test_server_shared_memory_is_private(server, http_client):
    http_client.generate("a private prompt", width=64, height=64, steps=2, seed=1)
    files = {f for f in _server_shm_files(server) if f.exists()}
    assert any(f.name.startswith(server.region_prefix) for f in files), files
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
    assert all(mode == 0o600 for mode in modes.values()), modes


def _preloaded(server) -> None:
    if server._guard is not None:
        pytest.skip("no C compiler on this host: the server runs without its preload (clients/server_preload.py)")


def test_regions_are_private_without_a_guard(server):
    """The preloaded library (clients/server_preload.c) makes them so from their creation: no
    guard chmods them afterwards (test_server_shared_memory_is_private checks the modes)."""
    _preloaded(server)
    assert server._guard is None


def test_the_admin_key_is_on_no_command_line_nor_in_a_stub(server):
    from clients.server_preload import KEY_ENV, KEY_PLACEHOLDER

    _preloaded(server)
    key = server.admin_key.encode()
    cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
    assert KEY_PLACEHOLDER.encode() in cmdline and key not in cmdline
    assert key not in Path(f"/proc/{server.pid}/environ").read_bytes()  # (erased in place)
    stubs = procs.descendants(server.pid)
    assert stubs
    for pid in stubs:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:  # (gone meanwhile)
            continue
        assert key not in environ and KEY_ENV.encode() not in environ, pid
