"""One list of job statuses and one revealer of secrets, read by everyone who needs them."""

from __future__ import annotations

import json
from typing import get_args

from api import schemas
from service import statuses, store
from service.spec import parse_spec, reveal_secrets, spec_to_private_json
from service.state_machine import STORE_STATUS, TERMINAL, JobState


def test_every_status_comes_from_service_statuses() -> None:
    assert get_args(schemas.JobStatus) == statuses.STATUSES
    assert set(STORE_STATUS.values()) <= set(statuses.STATUSES)
    assert {s.value for s in TERMINAL} == statuses.TERMINAL  # the supervisor's final states are the store's
    assert all(STORE_STATUS[s] == s.value for s in JobState if s.value in statuses.STATUSES)
    assert store.TERMINAL is statuses.TERMINAL and store.STATUSES is statuses.STATUSES
    done = schemas.Job(id="x", name="n", owner="o", status="CANCELLED", priority=0, min_world=1,
                       created_at=0, updated_at=0, progress=schemas.Progress())
    assert done.terminal and not done.model_copy(update={"status": "RECOVERING"}).terminal


def test_secrets_are_masked_for_the_api_and_revealed_for_the_workers() -> None:
    spec = parse_spec({"runtime_env": {"secret_env_vars": {"HF_TOKEN": "hunter2"}},
                       "checkpoint": {"uri": "s3://b/p", "s3": {"access_key_id": "AK", "secret_access_key": "SK"}}})
    assert "hunter2" not in json.dumps(spec.public_dict()) and "SK" not in json.dumps(spec.public_dict())
    private = json.loads(spec_to_private_json(spec))
    assert private["runtime_env"]["secret_env_vars"] == {"HF_TOKEN": "hunter2"}
    assert private["checkpoint"]["s3"]["secret_access_key"] == "SK"
    assert parse_spec(private).model_dump(mode="python") == spec.model_dump(mode="python")
    assert reveal_secrets(spec.model_dump(mode="python")) == private
