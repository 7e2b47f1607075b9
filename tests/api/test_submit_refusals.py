"""Bad jobs refused at submit, each with the field and the message that names the fix (a table),
and the run-time estimate with warnings in the submit answer of a very long job. Through a real
store-only server whose cluster view is 8 CPUs (tests/api/conftest.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from api.app import create_app
from api.cli import app
from api.client import Client
from api.errors import ValidationFailed
from api.server import BackgroundServer
from service.spec import SpecError, parse_spec
from tests.api.conftest import Api

BASE: dict[str, Any] = {"model": {"preset": "tiny"}, "training": {"steps": 20}}


def _job(**sections: Any) -> dict[str, Any]:
    return {**BASE, **sections}


def _kill(**kw: Any) -> dict[str, Any]:
    return {"kind": "kill_worker", **kw}


# (what, body, field, the message)
REFUSED: list[tuple[str, dict[str, Any], str, str]] = [
    ("chaos at the last step's end", _job(chaos=[_kill(step=20)]), "chaos.0.step",
     "kill_worker at step 20 on rank 0 never fires: an event fires when its rank has completed `step` steps, "
     "and this job stops at training.steps=20; pick a step below 20"),
    ("chaos far beyond the steps", _job(chaos=[_kill(step=5), _kill(step=10**9, rank=1)]), "chaos.1.step",
     "kill_worker at step 1000000000 on rank 1 never fires: an event fires when its rank has completed `step` "
     "steps, and this job stops at training.steps=20; pick a step below 20"),
    ("chaos rank beyond dp.max", _job(resources={"dp": {"min": 1, "max": 2}}, chaos=[_kill(step=3, rank=2)]),
     "chaos.0.rank",
     "kill_worker at step 3 on rank 2 never fires: this job has at most 2 workers (dp at most 2 "
     "(resources.dp.max or the parallelism's dp size) x 1 a replica), ranks 0..1; pick a rank below 2"),
    ("chaos rank beyond dp x tp", _job(parallelism={"dp_shard": 2, "tp": 2}, chaos=[_kill(step=3, rank=4)]),
     "chaos.0.rank",
     "kill_worker at step 3 on rank 4 never fires: this job has at most 4 workers (dp at most 2 "
     "(resources.dp.max or the parallelism's dp size) x 2 a replica), ranks 0..3; pick a rank below 4"),
    ("chaos rank beyond the whole cluster", _job(chaos=[_kill(step=3, rank=8)]), "chaos.0.rank",
     "kill_worker at step 3 on rank 8 never fires: this job has at most 8 workers (the whole cluster holds 8 of "
     "its workers), ranks 0..7; pick a rank below 8"),
    ("chaos rank beyond the cluster at 2 CPUs a worker",
     _job(resources={"cpus_per_worker": 2}, chaos=[{"kind": "hang_worker", "step": 1, "rank": 4}]), "chaos.0.rank",
     "hang_worker at step 1 on rank 4 never fires: this job has at most 4 workers (the whole cluster holds 4 of "
     "its workers), ranks 0..3; pick a rank below 4"),
    ("a slow worker slowed by nothing", _job(chaos=[{"kind": "slow_worker", "step": 2, "seconds": 0}]),
     "chaos.0.seconds", "slow_worker at step 2 on rank 0 with seconds: 0 slows nothing; set seconds above 0"),
    ("a fault after a kill at the same step", _job(chaos=[_kill(step=4, rank=1), {"kind": "raise_in_step", "step": 4,
                                                                                 "rank": 1}]),
     "chaos.1", "raise_in_step at step 4 on rank 1 (generation 0) never fires: chaos.0 (kill_worker) stops that "
     "worker first; move it to another step or rank, or drop it"),
    ("the same event twice", _job(chaos=[{"kind": "slow_worker", "step": 2}, {"kind": "slow_worker", "step": 2}]),
     "chaos.1", "slow_worker at step 2 on rank 0 (generation 0) never fires: chaos.0 is the same event; move it to "
     "another step or rank, or drop it"),
    ("a fault at join that cannot fire there", _job(chaos=[{"kind": "slow_worker", "at": "join", "generation": 1}]),
     "chaos.0.kind", "slow_worker cannot fire as a group connects (at: join): use one of kill_worker, "
     "sigkill_worker, hang_worker, kill_node, or at: step"),
    ("a fault at join given a step", _job(chaos=[_kill(step=3) | {"at": "join"}]), "chaos.0.step",
     "kill_worker at: join with step 3: a fault at join fires as the generation's group connects, before its "
     "first step; leave step out (or 0), and pick the generation"),
    ("a step fault after a join fault on its rank", _job(chaos=[{"kind": "sigkill_worker", "at": "join", "rank": 1},
                                                              _kill(step=4, rank=1)]),
     "chaos.1", "kill_worker at step 4 on rank 1 (generation 0) never fires: chaos.0 (sigkill_worker) stops that "
     "worker as the generation's group connects; move it to another generation or rank, or drop it"),
    ("a join fault at a rank beyond dp.max", _job(resources={"dp": {"min": 1, "max": 2}},
                                                  chaos=[{"kind": "kill_worker", "at": "join", "rank": 2}]),
     "chaos.0.rank",
     "kill_worker as its group connects on rank 2 never fires: this job has at most 2 workers (dp at most 2 "
     "(resources.dp.max or the parallelism's dp size) x 1 a replica), ranks 0..1; pick a rank below 2"),
    # Refusals that were there before, for the table's completeness (their text is owned elsewhere).
    ("an unknown field", _job(training={"stepz": 3}), "training.stepz", "Extra inputs are not permitted"),
    ("dp.max below dp.min", _job(resources={"dp": {"min": 4, "max": 2}}), "resources.dp",
     "dp.max=2 is below dp.min=4; raise max or lower min"),
    ("a gang larger than the cluster", _job(resources={"dp": {"min": 16}}), "resources.cpus_per_worker",
     "the minimum world of 16 workers needs 16 CPU but the whole cluster has 8"),
]

ACCEPTED: list[tuple[str, dict[str, Any]]] = [
    ("the last step and the last rank", _job(resources={"dp": {"min": 1, "max": 2}}, chaos=[_kill(step=19, rank=1)])),
    ("the last rank the cluster holds", _job(chaos=[_kill(step=3, rank=7)])),
    ("the same step in another generation", _job(chaos=[_kill(step=4, rank=1), _kill(step=4, rank=1, generation=1)])),
    ("a slow worker then a kill at the same step", _job(chaos=[{"kind": "slow_worker", "step": 4}, _kill(step=4)])),
    ("a rank lost as generation 1 connects, after a step fault", _job(chaos=[
        _kill(step=4, rank=3), {"kind": "sigkill_worker", "at": "join", "rank": 1, "generation": 1}])),
]


@pytest.mark.parametrize(("what", "body", "field", "message"), REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_at_submit(api: Api, what: str, body: dict[str, Any], field: str, message: str) -> None:
    _, token = api.user()
    with httpx.Client(base_url=api.url, headers={"Authorization": f"Bearer {token}"}, timeout=30) as h:
        r = h.post("/v1/jobs", json=body)
    assert r.status_code == 422, (what, r.status_code, r.text)
    fields = {f["field"]: f["message"] for f in r.json()["fields"]}
    assert field in fields, (what, fields)
    assert message in fields[field], (what, fields[field])
    assert message in r.json()["message"]


@pytest.mark.parametrize(("what", "body"), ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_accepted_at_the_bounds(api: Api, what: str, body: dict[str, Any]) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        assert c.submit(body).status == "PENDING", what


def test_step_bounds_hold_off_the_server_too() -> None:
    """`unbroken run` and `train` read a job file with the same spec: a chaos step is checked there."""
    with pytest.raises(SpecError, match=r"chaos\.0\.step: kill_worker at step 20 on rank 0 never fires"):
        parse_spec(_job(chaos=[_kill(step=20)]))


def test_a_very_long_job_gets_an_estimate_and_a_warning(api: Api, tmp_path: Path) -> None:
    _, token = api.user()
    with Client(api.url, token) as c:
        short = c.submit(_job(resources={"dp": {"min": 1, "max": 4}}))
        assert short.warnings == [] and short.estimate is not None
        assert short.estimate.duration_s == pytest.approx(short.estimate.step_time_s * 20)
        assert "4x cpu" in short.estimate.basis
        long = c.submit(_job(training={"steps": 10**12}, resources={"dp": {"min": 1, "max": 4}}))
        assert long.estimate is not None and long.estimate.duration_s > 10**9
        (text,) = long.warnings
        assert text.startswith("training.steps=1,000,000,000,000 at ~") and " years " in text
        assert "lower training.steps" in text
        # Recorded for later readers too; nothing of it in the stored job's own answer.
        warned = [e for e in c.events(long.id, follow=False) if e.kind == "warning"]
        assert [e.message for e in warned] == [text] and warned[0].data["estimate"]["duration_s"] > 10**9
        assert c.get(long.id).warnings == [] and c.get(long.id).estimate is None
        # The CLI: the id alone on stdout, the estimate and the warning on stderr.
        job_yaml = tmp_path / "long.yaml"
        job_yaml.write_text("model: {preset: tiny}\ntraining: {steps: 1000000000000}\n")
        r = CliRunner().invoke(app, ["submit", str(job_yaml), "--url", api.url, "--token", token])
        assert r.exit_code == 0, r.output
        assert len(r.stdout.split()) == 1 and "warning: training.steps=1,000,000,000,000" in r.stderr
        assert "estimate: ~" in r.stderr and "years" in r.stderr


def test_without_a_cluster_view_the_steps_alone_warn(api: Api) -> None:
    with BackgroundServer(create_app(api.store, None)) as bare:
        _, token = api.user()
        with Client(bare.url, token) as c:
            j = c.submit(_job(training={"steps": 10**12}))
            assert j.estimate is None and len(j.warnings) == 1
            assert "there is no step-time estimate for this cluster" in j.warnings[0]
            assert c.submit(_job()).warnings == []
            with pytest.raises(ValidationFailed) as info:
                c.submit(_job(chaos=[_kill(step=20)]))  # the spec's own checks need no cluster
            assert "chaos.0.step" in info.value.fields
