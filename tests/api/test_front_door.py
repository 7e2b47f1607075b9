"""The front door: tokens that expire and are revoked (API, CLI and console sessions), the audit log,
rate limiting of failed authentications, body/YAML structure limits, and `unbroken serve` over TLS."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from api.app import create_app
from api.auth_limits import FailedAuthLimiter
from api.body_limits import MAX_DEPTH, MAX_YAML_ALIASES, MAX_YAML_NODES
from api.cli import app as cli
from api.server import BackgroundServer
from service.store import JobStore
from tests.ui.test_console_security import log_in
from workers.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
MAX_FAILURES = 5


@dataclass
class Door:
    url: str
    store: JobStore
    admin: str
    alice: str


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Door]:
    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('door') / 'jobs.db'}")
    limiter = FailedAuthLimiter(max_failures=100, window_s=60)  # the rate limit has a test of its own
    srv = BackgroundServer(create_app(store, None, cluster_total={"CPU": 4.0}, auth_limiter=limiter)).start()
    try:
        yield Door(srv.url, store, store.create_token("root", "admin"), store.create_token("alice"))
    finally:
        srv.stop()
        store.close()


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def test_tokens_are_created_listed_expire_and_are_revoked_by_admins(door: Door) -> None:
    c = httpx.Client(base_url=door.url, timeout=30)
    # Only admins manage tokens or read the audit log.
    for method, path in (("GET", "/v1/tokens"), ("POST", "/v1/tokens"), ("DELETE", "/v1/tokens/1"),
                         ("GET", "/v1/audit")):
        r = c.request(method, path, headers=_h(door.alice), json={"principal": "x"} if method == "POST" else None)
        assert r.status_code == 403 and "not an admin" in r.json()["message"], (method, path, r.text)

    r = c.post("/v1/tokens", headers=_h(door.admin), json={"principal": "bob", "expires_in_s": 1.5, "label": "ci"})
    assert r.status_code == 201, r.text
    short = r.json()
    assert short["token"].startswith("ubk_") and short["created_by"] == "root"
    assert short["expires_at"] == pytest.approx(short["created_at"] + 1.5)
    r = c.post("/v1/tokens", headers=_h(door.admin), json={"principal": "bob"})
    lasting = r.json()
    assert lasting["expires_at"] is None
    listed = c.get("/v1/tokens", headers=_h(door.admin), params={"principal": "bob"}).json()["items"]
    assert [t["id"] for t in listed] == [short["id"], lasting["id"]]
    assert all("token" not in t for t in listed)  # never the text again

    assert c.get("/v1/jobs", headers=_h(short["token"])).status_code == 200
    time.sleep(max(0.0, short["expires_at"] - time.time()) + 0.2)
    r = c.get("/v1/jobs", headers=_h(short["token"]))
    assert r.status_code == 401 and "expired" in r.json()["message"]

    assert c.get("/v1/jobs", headers=_h(lasting["token"])).status_code == 200
    r = c.delete(f"/v1/tokens/{lasting['id']}", headers=_h(door.admin))
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert c.get("/v1/jobs", headers=_h(lasting["token"])).status_code == 401
    assert c.delete(f"/v1/tokens/{lasting['id']}", headers=_h(door.admin)).status_code == 404
    assert c.get("/v1/tokens", headers=_h(door.admin), params={"principal": "bob"}).json()["items"] == [
        t for t in listed if t["id"] == short["id"]]  # revoked ones only with include_revoked
    everything = c.get("/v1/tokens", headers=_h(door.admin), params={"include_revoked": True}).json()["items"]
    assert lasting["id"] in {t["id"] for t in everything}

    bad = c.post("/v1/tokens", headers=_h(door.admin), json={"principal": "bob", "expires_in_s": -1})
    assert bad.status_code == 422 and bad.json()["fields"][0]["field"].endswith("expires_in_s")


def test_console_sessions_end_with_their_token(door: Door) -> None:
    for end in ("revoke", "expire"):
        rec, token = door.store.issue_token("carol", expires_in_s=2.0 if end == "expire" else None)
        browser, csrf = log_in(door.url, token)
        assert browser.get("/v1/jobs").status_code == 200
        if end == "revoke":
            assert door.store.revoke_token(rec.id)
        else:
            time.sleep(max(0.0, (rec.expires_at or 0) - time.time()) + 0.2)
        r = browser.get("/v1/jobs")
        assert r.status_code == 401 and "session has ended" in r.json()["message"], (end, r.text)
        page = browser.get("/ui/jobs")
        assert page.status_code == 303 and page.headers["location"].startswith("/ui/login"), end


def test_every_mutating_request_is_audited(door: Door) -> None:
    c = httpx.Client(base_url=door.url, timeout=30)
    before = c.get("/v1/audit", headers=_h(door.admin), params={"limit": 1000}).json()["items"]
    after_id = before[-1]["id"] if before else 0
    job = c.post("/v1/jobs", headers=_h(door.alice), json={"name": "audited"}).json()
    c.post(f"/v1/jobs/{job['id']}/cancel", headers=_h(door.alice))
    c.delete("/v1/jobs/nope", headers=_h(door.alice))
    c.get("/v1/jobs", headers=_h(door.alice))  # a read: not audited
    c.post("/v1/jobs", json={"name": "anonymous"})  # no token
    page = c.get("/v1/audit", headers=_h(door.admin), params={"after_id": after_id}).json()
    got = [(e["principal"], e["method"], e["path"], e["status"]) for e in page["items"]]
    assert got == [
        ("alice", "POST", "/v1/jobs", 201),
        ("alice", "POST", f"/v1/jobs/{job['id']}/cancel", 200),
        ("alice", "DELETE", "/v1/jobs/nope", 404),
        ("-", "POST", "/v1/jobs", 401),
    ], got
    assert all(e["client"] == "127.0.0.1" and e["ts"] > time.time() - 60 for e in page["items"])
    only = c.get("/v1/audit", headers=_h(door.admin), params={"after_id": after_id, "principal": "-"}).json()
    assert [e["status"] for e in only["items"]] == [401]


def test_failed_authentications_are_rate_limited_per_client(tmp_path: Path) -> None:
    store = JobStore(f"sqlite:///{tmp_path / 'jobs.db'}")
    good = store.create_token("dave")
    srv = BackgroundServer(create_app(store, None, auth_limiter=FailedAuthLimiter(MAX_FAILURES, 60))).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=30)
        assert c.get("/v1/jobs", headers=_h(good)).status_code == 200
        for _ in range(MAX_FAILURES):
            assert c.get("/v1/jobs", headers=_h("ubk_guess")).status_code == 401
        r = c.get("/v1/jobs", headers=_h("ubk_guess"))
        assert r.status_code == 429 and 50 <= int(r.headers["Retry-After"]) <= 60, r.headers
        assert "too many failed authentications" in r.json()["message"]
        # The client is refused whatever it sends now, a good token too (no oracle for guessing).
        assert c.get("/v1/jobs", headers=_h(good)).status_code == 429
        assert c.get("/healthz").status_code == 200  # unauthenticated routes still answer
    finally:
        srv.stop()
        store.close()


def test_yaml_bombs_and_deep_bodies_are_refused_before_parsing(door: Door) -> None:
    c = httpx.Client(base_url=door.url, timeout=30, headers=_h(door.alice))
    yaml_type = {"Content-Type": "application/yaml"}
    # Billion laughs: nine levels of nine aliases, 387M values if expanded.
    levels = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    levels += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    bomb = ("name: bomb\nextra:\n" + "\n".join("  " + x for x in levels)).encode()
    t0 = time.perf_counter()
    r = c.post("/v1/jobs", content=bomb, headers=yaml_type)
    took = time.perf_counter() - t0
    assert r.status_code == 413, r.text
    assert str(MAX_YAML_NODES) in r.json()["message"] and r.json()["fields"][0]["field"] == "body"
    print(f"YAML bomb ({len(bomb)} bytes) refused in {took * 1000:.1f} ms")

    many = "name: x\nanchor: &v 1\nlist: [" + ",".join(["*v"] * (MAX_YAML_ALIASES + 1)) + "]\n"
    r = c.post("/v1/jobs", content=many.encode(), headers=yaml_type)
    assert r.status_code == 422 and f"more than {MAX_YAML_ALIASES} aliases" in r.json()["message"], r.text
    deep_yaml = "name: x\nextra: " + "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1) + "\n"
    r = c.post("/v1/jobs", content=deep_yaml.encode(), headers=yaml_type)
    assert r.status_code == 422 and f"deeper than {MAX_DEPTH}" in r.json()["message"], r.text
    deep_json = '{"name": "x", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = c.post("/v1/jobs", content=deep_json.encode(), headers={"Content-Type": "application/json"})
    assert r.status_code == 422 and f"deeper than {MAX_DEPTH}" in r.json()["message"], r.text
    # An ordinary spec with a few anchors still passes the limits (and is judged on its fields).
    fine = "name: anchored\ntraining: &t {steps: 3}\n"
    assert c.post("/v1/jobs", content=fine.encode(), headers=yaml_type).status_code == 201
    assert c.post("/v1/jobs", json={"name": "x", "training": {"steps": 2}}).status_code == 201


def test_cli_token_create_list_revoke_through_the_api(door: Door) -> None:
    env = {"UNBROKEN_URL": door.url, "UNBROKEN_TOKEN": door.admin}
    runner = CliRunner()
    r = runner.invoke(cli, ["token", "create", "erin", "--expires-in", "1d", "--label", "laptop"], env=env)
    assert r.exit_code == 0, r.output
    text = r.output.strip()
    assert text.startswith("ubk_")
    r = runner.invoke(cli, ["token", "list", "--principal", "erin"], env=env)
    assert r.exit_code == 0 and "erin" in r.output and "laptop" in r.output and text not in r.output
    token_id = int(r.output.strip().splitlines()[-1].split()[0])
    assert httpx.get(f"{door.url}/v1/jobs", headers=_h(text)).status_code == 200
    r = runner.invoke(cli, ["token", "revoke", str(token_id)], env=env)
    assert r.exit_code == 0 and f"revoked token {token_id}" in r.output
    assert httpx.get(f"{door.url}/v1/jobs", headers=_h(text)).status_code == 401
    r = runner.invoke(cli, ["token", "create", "erin", "--expires-in", "soon"], env=env)
    assert r.exit_code == 2 and "--expires-in" in r.output
    r = runner.invoke(cli, ["token", "list"], env={**env, "UNBROKEN_TOKEN": door.alice})
    assert r.exit_code == 1 and "not an admin" in r.output


def test_serve_over_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    port = free_port()
    env = {**os.environ, "UNBROKEN_HOME": str(tmp_path / "home")}
    cmd = [sys.executable, "-c", "from api.cli import main; main()", "serve", "--no-ray", "--port", str(port), "--db",
           f"sqlite:///{tmp_path / 'jobs.db'}", "--tls-cert", str(cert), "--tls-key", str(key)]
    bad = subprocess.run([*cmd[:-2]], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "--tls-cert and --tls-key go together" in bad.stderr
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"https://127.0.0.1:{port}"
        trust = ssl.create_default_context(cafile=str(cert))
        deadline = time.monotonic() + 60
        while True:
            try:
                r = httpx.get(f"{url}/healthz", verify=trust, timeout=5)
                break
            except httpx.TransportError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
                time.sleep(0.2)
        assert r.status_code == 200
        token = re.search(r'"token": "([^"]+)"', (tmp_path / "home" / "token").read_text())
        assert token and '"url": "https://' in (tmp_path / "home" / "token").read_text()
        assert httpx.get(f"{url}/v1/jobs", verify=trust, headers=_h(token.group(1))).status_code == 200
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served
            httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
    finally:
        proc.terminate()
        proc.wait(30)
