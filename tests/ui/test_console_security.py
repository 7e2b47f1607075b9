"""The console's session and its guards, over HTTP against a real store-only server: the cookie's
attributes, CSRF refusals (missing or wrong token, another site's Origin, a forged login or
logout), another user's job answering 404 on its page and in the API, no secret in any page,
logout and token revocation ending the session, no open redirect, and every /v1 address the
console's scripts name being a documented route."""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from api.app import create_app
from api.server import BackgroundServer
from api.ui import STATIC_DIR
from api.ui.sessions import COOKIE, CSRF_HEADER, LOGIN_COOKIE
from service.spec import parse_spec
from service.store import JobStore
from tests.ui.conftest import undocumented

SECRET = "s3cr3t-value-never-shown-8d1f"
S3_SECRET = "aws-secret-never-shown-41c2"
PAGES = ("/ui/jobs", "/ui/submit", "/ui/plan", "/ui/cluster")


@dataclass
class Server:
    url: str
    store: JobStore
    alice: str
    bob: str
    admin: str
    alice_job: str
    bob_job: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('ui') / 'jobs.db'}")
    secret_spec = parse_spec({
        "name": "secretive",
        "runtime_env": {"secret_env_vars": {"HF_TOKEN": SECRET}},
        "checkpoint": {"uri": "s3://bucket/x", "s3": {"access_key_id": "AKIAEXAMPLE", "secret_access_key": S3_SECRET}},
    })
    a, _ = store.create_job(secret_spec, "alice", min_world=1, max_world=1)
    b, _ = store.create_job(parse_spec({"name": "bobs"}), "bob", min_world=1, max_world=1)
    srv = BackgroundServer(create_app(store, None, cluster_total={"CPU": 4.0})).start()
    try:
        yield Server(srv.url, store, store.create_token("alice"), store.create_token("bob"),
                     store.create_token("root", "admin"), a.id, b.id)
    finally:
        srv.stop()
        store.close()


def log_in(url: str, token: str) -> tuple[httpx.Client, str]:
    """A client holding a console session (as a browser would) and the session's CSRF token."""
    c = httpx.Client(base_url=url, timeout=30)
    page = c.get("/ui/login")
    login_csrf = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert login_csrf, page.text
    r = c.post("/ui/login", data={"token": token, "login_csrf": login_csrf.group(1), "next": "/ui/jobs"},
               headers={"Origin": url})
    assert r.status_code == 303 and r.headers["location"] == "/ui/jobs", r.text
    home = c.get("/ui/jobs")
    assert home.status_code == 200
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)">', home.text)
    assert csrf
    return c, csrf.group(1)


def test_cookie_is_httponly_samesite_and_holds_no_token(server: Server) -> None:
    c = httpx.Client(base_url=server.url)
    page = c.get("/ui/login")
    token_field = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert token_field
    r = c.post("/ui/login", data={"token": server.alice, "login_csrf": token_field.group(1)},
               headers={"Origin": server.url})
    cookies = [h for h in r.headers.get_list("set-cookie") if h.startswith(f"{COOKIE}=")]
    assert len(cookies) == 1
    attrs = [a.strip().lower() for a in cookies[0].split(";")]
    assert "httponly" in attrs and "samesite=strict" in attrs and "path=/" in attrs
    assert server.alice not in cookies[0], "the cookie is a session id, not the API token"
    assert page.headers["content-security-policy"].startswith("default-src 'self'")
    assert page.headers["x-frame-options"] == "DENY"


def test_pages_need_a_session(server: Server) -> None:
    c = httpx.Client(base_url=server.url)
    for path in (*PAGES, f"/ui/jobs/{server.alice_job}"):
        r = c.get(path)
        assert r.status_code == 303 and r.headers["location"].startswith("/ui/login?next="), path
    # A bearer token alone opens no page: pages are for the browser's session.
    assert c.get("/ui/jobs", headers={"Authorization": f"Bearer {server.alice}"}).status_code == 303


def test_mutations_with_the_cookie_need_the_csrf_token_and_this_origin(server: Server) -> None:
    job, _ = server.store.create_job(parse_spec({"name": "target"}), "alice", min_world=1, max_world=1)
    c, csrf = log_in(server.url, server.alice)
    url = f"/v1/jobs/{job.id}/cancel"
    # Reading with the cookie works (the pages do it); changing without the CSRF token does not.
    assert c.get(f"/v1/jobs/{job.id}").status_code == 200
    r = c.post(url)
    assert r.status_code == 403 and CSRF_HEADER in r.json()["message"]
    assert c.post(url, headers={CSRF_HEADER: "wrong"}).status_code == 403
    # The right token from another site (a page there cannot read it, but even so) is refused.
    r = c.post(url, headers={CSRF_HEADER: csrf, "Origin": "http://evil.example"})
    assert r.status_code == 403 and "cross-site" in r.json()["message"]
    r = c.post(url, headers={CSRF_HEADER: csrf, "Referer": "http://evil.example/page"})
    assert r.status_code == 403
    assert c.post("/v1/jobs", content="name: x\n",
                  headers={"Content-Type": "application/yaml", "Origin": "http://evil.example"}).status_code == 403
    assert server.store.get_job(job.id).status == "PENDING"  # type: ignore[union-attr]
    r = c.post(url, headers={CSRF_HEADER: csrf, "Origin": server.url})
    assert r.status_code == 200 and r.json()["status"] == "CANCELLED"
    # Another session's CSRF token does not fit this session.
    c2, csrf2 = log_in(server.url, server.alice)
    assert csrf2 != csrf
    assert c.delete(f"/v1/jobs/{job.id}", headers={CSRF_HEADER: csrf2}).status_code == 403
    # Bearer requests are not cookie requests: no CSRF token needed.
    assert httpx.delete(f"{server.url}/v1/jobs/{job.id}",
                        headers={"Authorization": f"Bearer {server.alice}"}).status_code == 204


def test_forged_login_and_logout_are_refused(server: Server) -> None:
    c = httpx.Client(base_url=server.url)
    # No login-form token (a form posted from another site): refused, no session.
    r = c.post("/ui/login", data={"token": server.alice, "next": "/ui/jobs"})
    assert r.status_code == 403 and COOKIE not in r.headers.get("set-cookie", "")
    page = c.get("/ui/login")
    field = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert field and LOGIN_COOKIE in c.cookies
    r = c.post("/ui/login", data={"token": server.alice, "login_csrf": field.group(1)},
               headers={"Origin": "http://evil.example"})
    assert r.status_code == 403
    # A wrong token: 401, and the typed text is not echoed back.
    page = c.get("/ui/login")
    field = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert field
    r = c.post("/ui/login", data={"token": "ubk_typo-" + SECRET, "login_csrf": field.group(1)})
    assert r.status_code == 401 and SECRET not in r.text and "not valid" in r.text
    # Logout from another site (no CSRF field) leaves the session open.
    s, _ = log_in(server.url, server.alice)
    assert s.post("/ui/logout", data={}).status_code == 403
    assert s.get("/v1/jobs").status_code == 200


def test_another_users_job_is_404_and_admin_sees_all(server: Server) -> None:
    c, _ = log_in(server.url, server.alice)
    r = c.get(f"/ui/jobs/{server.bob_job}")
    assert r.status_code == 404 and "bobs" not in r.text
    assert c.get(f"/v1/jobs/{server.bob_job}").status_code == 404
    assert c.get(f"/ui/jobs/{server.alice_job}").status_code == 200
    ids = {j["id"] for j in c.get("/v1/jobs").json()["items"]}
    assert server.alice_job in ids and server.bob_job not in ids
    # The cluster view's queue names only alice's jobs, but counts all.
    cl = c.get("/v1/cluster").json()
    assert {q["id"] for q in cl["queue"]} <= ids and cl["queue_length"] >= 2
    admin, _ = log_in(server.url, server.admin)
    assert admin.get(f"/ui/jobs/{server.bob_job}").status_code == 200
    assert {server.alice_job, server.bob_job} <= {j["id"] for j in admin.get("/v1/jobs").json()["items"]}
    assert {server.alice_job, server.bob_job} <= {q["id"] for q in admin.get("/v1/cluster").json()["queue"]}


def test_no_secret_in_any_page_or_what_the_pages_read(server: Server) -> None:
    c, _ = log_in(server.url, server.alice)
    bodies = [c.get(p).text for p in (*PAGES, f"/ui/jobs/{server.alice_job}", "/ui/login")]
    bodies += [c.get(p).text for p in (f"/v1/jobs/{server.alice_job}", "/v1/jobs", "/v1/cluster")]
    for body in bodies:
        assert SECRET not in body and S3_SECRET not in body and server.alice not in body
    spec = c.get(f"/v1/jobs/{server.alice_job}").json()["spec"]
    assert spec["runtime_env"]["secret_env_vars"]["HF_TOKEN"] == "**********"


def test_logout_and_revocation_end_the_session(server: Server) -> None:
    c, csrf = log_in(server.url, server.alice)
    sid = c.cookies[COOKIE]
    r = c.post("/ui/logout", data={"csrf": csrf}, headers={"Origin": server.url})
    assert r.status_code == 303 and r.headers["location"] == "/ui/login?bye=1"
    # The old cookie, replayed, opens nothing.
    stale = httpx.Client(base_url=server.url, cookies={COOKIE: sid})
    assert stale.get("/v1/jobs").status_code == 401
    assert stale.get("/ui/jobs").status_code == 303
    # Revoking the token ends its sessions at once.
    name = "carol"
    token = server.store.create_token(name)
    c2, _ = log_in(server.url, token)
    assert c2.get("/v1/jobs").status_code == 200
    server.store.revoke_tokens(name)
    assert c2.get("/v1/jobs").status_code == 401
    assert c2.get("/ui/jobs").status_code == 303


def test_login_redirects_only_within_the_console(server: Server) -> None:
    c = httpx.Client(base_url=server.url)
    for target in ("https://evil.example/", "//evil.example/ui/", "/v1/jobs", "/ui/\\evil"):
        page = c.get("/ui/login", params={"next": target})
        field = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
        assert field
        r = c.post("/ui/login", data={"token": server.alice, "login_csrf": field.group(1), "next": target})
        assert r.headers["location"] == "/ui/jobs", target
        c.cookies.clear()


def test_every_v1_address_in_the_scripts_is_documented(server: Server) -> None:
    """The static half of the check (the browser tests record what the pages really fetch)."""
    openapi = httpx.get(f"{server.url}/openapi.json").json()
    paths: list[str] = []
    for js in sorted((STATIC_DIR / "js").glob("*.js")):
        for literal in re.findall(r"[`\"'](/v1/[^`\"'?]*)", js.read_text()):
            paths.append(re.sub(r"\$\{[^}]+\}", "x", literal))
    # ${base} in job.js is the job's own address, /v1/jobs/{id}.
    paths += ["/v1/jobs/x" + p for p in ("", "/checkpoints", "/metrics", "/logs", "/events", "/cancel")]
    assert {"/v1/jobs", "/v1/cluster", "/v1/plan"} <= set(paths)
    bad = [p for p in paths if undocumented([("GET", p)], openapi) and undocumented([("POST", p)], openapi)]
    assert not bad, f"the console names undocumented routes: {bad}"


def test_behind_a_proxy_that_ends_tls(server: Server) -> None:
    """The browser says https://host while the server sees http: same host, so allowed; the
    cookie is marked Secure when the proxy says the browser used HTTPS."""
    host = server.url.split("://", 1)[1]
    c = httpx.Client(base_url=server.url)
    page = c.get("/ui/login")
    field = re.search(r'name="login_csrf" value="([^"]+)"', page.text)
    assert field
    r = c.post("/ui/login", data={"token": server.alice, "login_csrf": field.group(1)},
               headers={"Origin": f"https://{host}", "X-Forwarded-Proto": "https"})
    assert r.status_code == 303
    cookie = next(h for h in r.headers.get_list("set-cookie") if h.startswith(f"{COOKIE}="))
    assert "secure" in [a.strip().lower() for a in cookie.split(";")]
    sid = cookie.split(";", 1)[0].split("=", 1)[1]
    s = httpx.Client(base_url=server.url, cookies={COOKIE: sid})
    csrf = re.search(r'<meta name="csrf-token" content="([^"]+)">', s.get("/ui/jobs").text)
    assert csrf
    job, _ = server.store.create_job(parse_spec({"name": "proxied"}), "alice", min_world=1, max_world=1)
    ok = s.post(f"/v1/jobs/{job.id}/cancel", headers={CSRF_HEADER: csrf.group(1), "Origin": f"https://{host}"})
    assert ok.status_code == 200
    other = s.post(f"/v1/jobs/{job.id}/cancel", headers={CSRF_HEADER: csrf.group(1), "Origin": f"https://x.{host}"})
    assert other.status_code == 403
