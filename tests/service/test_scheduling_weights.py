"""Fair-share weights (issue 15): a token's --weight, through the store, the REST API and the CLI; an
owner's weight is the largest among its valid tokens'. Bad weights are refused naming the field."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.store import JobStore

UNBROKEN = str(Path(sys.executable).with_name("unbroken"))


def test_owner_weight_is_the_largest_of_its_valid_tokens(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 's.db'}")
    try:
        assert store.owner_weights() == {}
        store.create_token("ana", "user")
        assert store.owner_weights() == {"ana": 1.0}
        rec, _ = store.issue_token("ana", "user", weight=3.0)
        store.issue_token("bo", "user", weight=0.5)
        assert store.owner_weights() == {"ana": 3.0, "bo": 0.5}
        assert store.get_token(rec.id).weight == 3.0  # type: ignore[union-attr]
        store.revoke_token(rec.id)  # a revoked token's weight no longer counts
        assert store.owner_weights() == {"ana": 1.0, "bo": 0.5}
        for bad in (0, -1, 1001):
            with pytest.raises(ValueError, match=r"weight=.* must be above 0 and at most 1000"):
                store.issue_token("cy", "user", weight=bad)
    finally:
        store.close()


def test_weight_through_the_api_and_the_cli(tmp_path: Path) -> None:
    db = f"sqlite:///{tmp_path / 's.db'}"
    store = JobStore(db)
    server = BackgroundServer(create_app(store, None)).start()
    try:
        admin = store.create_token("root", "admin")
        h = {"Authorization": f"Bearer {admin}"}
        r = httpx.post(f"{server.url}/v1/tokens", json={"principal": "ana", "weight": 2.5}, headers=h, timeout=30)
        assert r.status_code == 201 and r.json()["weight"] == 2.5, r.text
        r = httpx.post(f"{server.url}/v1/tokens", json={"principal": "ana", "weight": 0}, headers=h, timeout=30)
        assert r.status_code == 422 and any(f["field"].endswith("weight") for f in r.json()["fields"]), r.text
        listed = httpx.get(f"{server.url}/v1/tokens", params={"principal": "ana"}, headers=h, timeout=30).json()
        assert [t["weight"] for t in listed["items"]] == [2.5]

        env = {**os.environ, "UNBROKEN_URL": server.url, "UNBROKEN_TOKEN": admin}
        ok = subprocess.run([UNBROKEN, "token", "create", "bo", "--weight", "4"], env=env, capture_output=True,
                            text=True, timeout=120)
        assert ok.returncode == 0 and ok.stdout.strip().startswith("ubk_"), ok.stderr
        bad = subprocess.run([UNBROKEN, "token", "create", "bo", "--weight", "0", "--db", db], env=env,
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "--weight" in bad.stderr and "must be above 0" in bad.stderr, bad.stderr
        table = subprocess.run([UNBROKEN, "token", "list"], env=env, capture_output=True, text=True, timeout=120)
        assert "WEIGHT" in table.stdout and any(ln.split()[1:4] == ["bo", "user", "4"]
                                                for ln in table.stdout.splitlines()[1:]), table.stdout
        assert store.owner_weights()["bo"] == 4.0 and store.owner_weights()["ana"] == 2.5
    finally:
        server.stop()
        store.close()
