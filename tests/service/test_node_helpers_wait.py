"""A grow waits for a new node's helpers (keeper, agent) from when it is due, not from their start.

On a slow node the helpers start as slowly as the replica beside them (12 s each once, in a full
`make test`): a wait counted from their start was spent by the time the replica was ready, and the grow
paused without them. The helpers here are real Ray tasks that answer after a delay."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from service.spec import JobSpec
from service.supervisor import node_helpers
from service.supervisor.context import JobRun
from service.supervisor.node_helpers import NodeHelpersAhead, _Started


def _ahead(tmp_path: Path) -> tuple[NodeHelpersAhead, list[tuple[str, dict[str, Any]]]]:
    run = JobRun(job_id="j", spec=JobSpec.model_validate({"name": "grow"}), namespace="t", store=None,
                 restarted=False, self_handle=None, mp=1, cp_tp=1, per_worker={"CPU": 1.0}, dp_min=1, dp_max=2,
                 output_dir=tmp_path)  # fmt: skip
    events: list[tuple[str, dict[str, Any]]] = []
    return NodeHelpersAhead(run, None, lambda what, _msg, **data: events.append((what, data))), events


@ray.remote
def answer_after(s: float) -> str:
    """A helper's first answer, `s` seconds after it was asked (a keeper or agent starting slowly)."""
    time.sleep(s)
    return "pong"


def _until(check: Any, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


def test_helpers_started_long_ago_get_the_wait_from_when_the_grow_is_due(
        local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(node_helpers, "AHEAD_WAIT_S", 3.0)

    ray.get(answer_after.remote(0))  # the worker process is up: the delay below is the helper's own
    ahead, events = _ahead(tmp_path)
    # Started (with the replica) 5 s ago, longer than the wait: the node is slow, and still starting them.
    ahead._started["c"] = _Started("node-c", time.monotonic() - 5.0, pings=[answer_after.remote(1.0)],
                                   what=["snapshot keeper"])
    assert not ahead.ready(["c"]), events  # the grow is due now: it waits for them
    assert _until(lambda: ahead.ready(["c"]), 10), events
    assert [k for k, _ in events] == ["helpers_ready"], events
    assert events[0][1]["waited_s"] >= 5.0


def test_helpers_that_never_answer_are_given_up_on_after_the_wait(
        local_ray: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr(node_helpers, "AHEAD_WAIT_S", 1.0)

    ahead, events = _ahead(tmp_path)
    ahead._started["c"] = _Started("node-c", time.monotonic(), pings=[answer_after.remote(60.0)],
                                   what=["node agent"])
    t0 = time.monotonic()
    assert not ahead.ready(["c"])
    assert _until(lambda: ahead.ready(["c"]), 10)
    assert time.monotonic() - t0 >= 1.0
    assert [k for k, d in events] == ["helpers_late"] and events[0][1]["late"], events
