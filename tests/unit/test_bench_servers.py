"""`easel bench`'s server sharing without a server: how many ControlNet instances a repository gets,
what a shared run's repository is sized for, which configurations the report says shared a server,
and the counters read as deltas."""

from __future__ import annotations

import dataclasses

import pytest

from clients.bench import harness, models, report, servers


def setups(*argv: str) -> list[models.Setup]:
    return models.resolve_all(models.parser().parse_args(list(argv)))


def one(*argv: str) -> models.Setup:
    (setup,) = setups(*argv)
    return setup


@pytest.mark.parametrize("argv, instances", [
    # On the denoisers' GPUs: one instance per ControlNet of a request, at least one.
    ((), 1),
    (("--controlnets", "3"), 3),
    (("--controlnets", "2", "--controlnet-row-split"), 2),
    # On GPUs of their own, the calls spread over them: 3 calls on 2 GPUs -> ceil(3/2) = 2 each.
    (("--controlnets", "3", "--controlnet-gpus", "2,3"), 2),
    (("--controlnets", "2", "--controlnet-gpus", "2,3"), 1),
    (("--controlnets", "3", "--controlnet-gpus", "2"), 3),
    # Rows called apart double the calls: 3 ControlNets x 2 rows on 2 GPUs -> 3 each.
    (("--controlnets", "3", "--controlnet-gpus", "2,3", "--controlnet-row-split"), 3),
    # Latent parallelism calls per row too: 2 x 2 on one GPU -> 4; 1 x 2 on 2 GPUs -> 1.
    (("--controlnets", "2", "--cfg-parallel", "0:1", "--controlnet-gpus", "2"), 4),
    (("--controlnets", "1", "--cfg-parallel", "0:1", "--controlnet-gpus", "2,3"), 1),
    # No ControlNet still gets one instance: ceil(1/4) = 1.
    (("--controlnet-gpus", "2,3,4,5"), 1),
])
def test_controlnet_instances_cover_the_most_concurrent_calls(argv, instances):
    setup = one(*argv)
    assert servers.controlnet_instances(setup) == instances
    assert servers.export_options(setup).controlnet_instances == instances


def test_a_shared_run_sizes_every_repository_for_its_largest_configuration():
    shared = setups("--configs", "0C/0L,3C/0L,1C/2L", "--controlnet-gpus", "2,3",
                    "--skip-diffusers-eager", "--skip-diffusers-compiled")
    assert [(s.name, s.served_name) for s in shared] == [("0C/0L", "3C/2L"), ("3C/0L", "3C/2L"), ("1C/2L", "3C/2L")]
    options = {servers.export_options(s) for s in shared}
    assert len(options) == 1 and len({servers.Servers.key(s) for s in shared}) == 1  # one repository, one server
    (o,) = options
    assert (o.max_controlnets, o.max_loras, o.adapters) == (3, 3, str(shared[0].work / "adapters"))
    assert o.controlnet_instances == 2  # 0C/0L's repository serves 3C/0L's three calls on two GPUs
    assert [s.placement()["served"] for s in shared] == ["3C/2L", "3C/2L", "3C/2L"]

    # One diffusers baseline still runs: each configuration on a repository of its own, as before.
    own = setups("--configs", "0C/0L,3C/0L", "--controlnet-gpus", "2,3", "--skip-diffusers-eager")
    assert [s.served_name for s in own] == ["0C/0L", "3C/0L"] and own[0].adapter_store is None
    assert servers.export_options(own[0]).adapters is None and servers.controlnet_instances(own[0]) == 1
    assert servers.Servers.key(own[0]) != servers.Servers.key(own[1])
    assert [s.placement()["served"] for s in own] == [None, None]
    assert servers.repo_path(own[1]).name == "repo-3C-0L"
    # Never fewer served than a configuration's own.
    assert dataclasses.replace(own[0], controlnets=2).served_controlnets == 2


def test_the_report_names_the_configurations_that_shared_a_server():
    configs = [{"name": "0C/0L", "easel": {"server": {"id": "a"}}}, {"name": "1C/0L", "easel": {"server": {"id": "a"}}},
               {"name": "2C/0L", "easel": {"server": {"id": "a"}}}, {"name": "3C/0L", "easel": {"server": {"id": "b"}}},
               {"name": "0C/1L", "easel": {"latency_s": [1.0]}}, {"name": "0C/2L"}]
    assert report.server_sharing(configs) == [["1C/0L", "2C/0L"], ["0C/0L", "2C/0L"], ["0C/0L", "1C/0L"], [], [], []]
    md = report.markdown({"gpu": "g", "configs": [{**c, "size": 64, "steps": 4, "gpus": [0]} for c in configs]})
    assert "| 1C/0L | n/a | shared with 0C/0L, 2C/0L |" in md
    assert "| 3C/0L | n/a | own |" in md and "| 0C/1L | n/a | own |" in md and "| 0C/2L | n/a | n/a |" in md


def test_counters_are_deltas_over_a_configurations_requests():
    def snap(graph, calls):
        out = {"easel_runtime_graph_steps_total": {'model="d0"': graph, 'model="d1"': graph}}
        if calls is not None:
            out["easel_controlnet_calls_total"] = {'model="d0"': calls}
        return out

    got = harness.counter_deltas(snap(100, 40), snap(130, 40))
    assert got["graph_steps"] == 60 and got["controlnet_calls"] == 0 and got["eager_steps"] is None
    assert harness.counter_deltas(snap(0, None), snap(5, None))["controlnet_calls"] is None  # no ControlNet service
