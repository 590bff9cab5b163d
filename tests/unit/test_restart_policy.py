"""`easel serve`'s restart policy (clients/supervise.RestartPolicy) on its own clock: a crash loop
costs a growing wait, never the service itself, unless the operator caps it (--max-restarts)."""

from __future__ import annotations

from clients import cli
from clients.supervise import RESTART_BACKOFF_S, RESTART_WINDOW_S, RestartPolicy


def test_restarts_go_on_with_a_growing_backoff():
    policy = RestartPolicy()
    now, delays = 0.0, []
    for _ in range(12):  # a client crashing the server as fast as it comes back (30 s a start)
        delay = policy.next_delay(now)
        delays.append(delay)
        now += delay + 30.0
    assert delays[:len(RESTART_BACKOFF_S)] == list(RESTART_BACKOFF_S)
    assert all(d == RESTART_BACKOFF_S[-1] for d in delays[len(RESTART_BACKOFF_S):])  # never None: no giving up
    # A quiet window later, the backoff starts over.
    assert policy.next_delay(now + RESTART_WINDOW_S + 1) == RESTART_BACKOFF_S[0]


def test_an_operator_cap_gives_up_within_the_window_only():
    policy = RestartPolicy(max_restarts=2)
    assert policy.next_delay(0.0) == 0.0 and policy.next_delay(10.0) == 0.0
    assert policy.next_delay(20.0) is None
    assert policy.next_delay(RESTART_WINDOW_S + 11.0) == 0.0  # the first two left the window


def test_max_restarts_reaches_the_options(tmp_path, capsys):
    assert cli.build_parser().parse_args(["serve", "--repo", "r", "--max-restarts", "3"]).max_restarts == 3
    assert cli.build_parser().parse_args(["serve", "--repo", "r"]).max_restarts is None
    assert cli.main(["serve", "--repo", str(tmp_path), "--max-restarts", "-1"]) == 2
    assert "--max-restarts must be 0 or more" in capsys.readouterr().err
