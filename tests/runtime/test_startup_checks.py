"""Start-up errors fail a job at once, with their reason, before the gang starts (workers.probe).

Each bad job below is valid as a spec (the API cannot see the worker nodes' files or credentials),
so the supervisor's probe on a worker node must catch it: the job ends FAILED with a reason naming
the field and the fix, no generation starts, and nothing is counted as a recovery.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.runtime.jobs import JobRun, assert_no_leaks, tiny_spec
from workers.ports import free_port


def _bad_jobs(tmp: Path) -> list[tuple[str, dict[str, Any], str]]:
    latin1 = tmp / "latin1.txt"
    latin1.write_bytes("caf\xe9 au lait\n".encode("latin-1") * 50)  # not UTF-8
    blocker = tmp / "a-file"
    blocker.write_text("a file where the checkpoint root's folder would be\n")
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens: no request may leave this machine
    return [
        ("missing data path", {"data": {"kind": "text", "path": str(tmp / "nowhere")}}, "data.path="),
        ("a text file that is not UTF-8", {"data": {"kind": "text", "path": str(latin1)}}, "not UTF-8"),
        ("s3 without credentials", {"checkpoint": {"uri": "s3://bucket/runs", "persist_every": 5,
                                                   "s3": {"endpoint_url": endpoint, "max_attempts": 1}}},
         "Unable to locate credentials"),
        ("a checkpoint root that cannot be written", {"checkpoint": {"uri": (blocker / "ckpts").as_uri()}},
         "checkpoint.uri=file://" + str(blocker / "ckpts") + ": cannot be written (NotADirectoryError"),
    ]


@pytest.mark.parametrize("case", range(4), ids=["missing-data", "not-utf8", "s3-no-credentials", "ckpt-not-writable"])
def test_startup_error_fails_at_once_with_its_reason(head_cluster: Any, tmp_path: Path, case: int,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    what, change, expect = _bad_jobs(tmp_path)[case]
    spec = tiny_spec(tmp_path / "out", steps=4, dp=2)
    data = spec.model_dump(mode="python")
    for section, values in change.items():
        data[section] = {**(data.get(section) or {}), **values}
    from service.spec import parse_spec

    run = JobRun(parse_spec({k: v for k, v in data.items() if v is not None}))
    st = run.wait(timeout_s=240)
    run.finish()
    assert st["state"] == "FAILED", (what, run.events)
    assert st["reason"].startswith("the job cannot start: "), st["reason"]
    assert expect in st["reason"], (what, st["reason"])
    kinds = run.kinds()
    # Failed before the gang started: no generation, no failure handling, no recovery.
    assert "generation" not in kinds and "failure_detected" not in kinds and "recovered" not in kinds, kinds
    assert "RECOVERING" not in " ".join(e["message"] for e in run.of("state")), run.of("state")
    assert st["recoveries"] == 0
    assert_no_leaks(run.job_id)
