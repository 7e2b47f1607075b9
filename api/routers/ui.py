"""/ui: the web console's pages, its login and logout, and its static files.

The pages are HTML shells; their scripts (api/ui/static/js) read and change everything through
the documented /v1 endpoints, authenticated by the session cookie that /ui/login sets (see
api/ui/sessions.py for the session and CSRF rules). A page answers only to a live session:
without one it redirects to the login page, and a job page of a job the user may not see
answers 404 like the API does.
"""

from __future__ import annotations

import html
import secrets
from string import Template
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool

from api.deps import ApiError, AppState, get_state, session_principal, visible_job
from api.ui import STATIC_DIR, TEMPLATES_DIR
from api.ui.sessions import COOKIE, LOGIN_COOKIE, MAX_AGE_S, Session, Sessions, cookie_secure, same_origin
from service.auth import Principal

router = APIRouter(prefix="/ui", include_in_schema=False)

PAGES = ("jobs", "submit", "plan", "cluster")
MAX_FORM_BYTES = 8192
# No inline script or style anywhere: the pages load only this server's files.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


def install(app: FastAPI, state: AppState) -> None:
    """Add the console to `app`: its pages, its static files and the session store."""
    state.extra["sessions"] = Sessions()
    app.include_router(router)
    app.mount("/ui/static", StaticFiles(directory=STATIC_DIR), name="ui-static")


def _read(name: str) -> str:
    return (TEMPLATES_DIR / name).read_text(encoding="utf-8")


def _template(name: str) -> Template:
    return Template(_read(name))


def _html(body: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(body, status_code=status, headers=SECURITY_HEADERS)


def _safe_next(target: str | None) -> str:
    """Only a path of this console: never another site (an open redirect)."""
    if not target or not target.startswith("/ui/") or target.startswith("//") or "\\" in target:
        return "/ui/jobs"
    return target


def _to_login(request: Request) -> RedirectResponse:
    target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
    return RedirectResponse(f"/ui/login?next={quote(target, safe='')}", status_code=303, headers=SECURITY_HEADERS)


def _session(request: Request) -> tuple[str, Session, Principal] | None:
    sid = request.cookies.get(COOKIE)
    found = session_principal(get_state(request), sid)
    return None if found is None or sid is None else (sid, *found)


def _shell(page: str, title: str, main: str, sess: Session, who: Principal, *, job_id: str = "",
           head: str = "", status: int = 200) -> HTMLResponse:
    esc = html.escape
    nav = {f"nav_{p}": ' aria-current="page"' if p == page else "" for p in PAGES}
    body = _template("shell.html").substitute(
        title=esc(title), csrf=esc(sess.csrf), user=esc(who.name), role=esc(who.role), page=esc(page),
        job_id=esc(job_id), main=main, script=f"{page}.js", head=head, **nav,
    )
    return _html(body, status)


def _error_page(sess: Session, who: Principal, status: int, heading: str, message: str) -> HTMLResponse:
    main = _template("error.html").substitute(heading=html.escape(heading), message=html.escape(message))
    return _shell("error", heading, main, sess, who, status=status)


@router.get("")
@router.get("/")
def home() -> RedirectResponse:
    return RedirectResponse("/ui/jobs", status_code=303)


def _login_page(next_path: str, notice: str = "", error: bool = False, status: int = 200) -> HTMLResponse:
    login_csrf = secrets.token_urlsafe(32)
    if notice:
        role = "alert" if error else "status"
        notice = f'<p id="login-error" role="{role}" class="{"error" if error else "notice"}">{html.escape(notice)}</p>'
    body = _template("login.html").substitute(
        login_csrf=login_csrf, next=html.escape(next_path), notice=notice,
        error_id=" login-error" if notice else "",
    )
    resp = _html(body, status)
    resp.set_cookie(LOGIN_COOKIE, login_csrf, max_age=600, path="/ui/login", httponly=True, samesite="strict")
    return resp


@router.get("/login")
def login_page(request: Request, next: str | None = None, bye: int = 0) -> Response:
    if _session(request) is not None:
        return RedirectResponse(_safe_next(next), status_code=303)
    notice = "You are logged out." if bye else ("Log in to see this page." if next else "")
    return _login_page(_safe_next(next), notice)


async def _form(request: Request) -> dict[str, str]:
    raw = await request.body()
    if len(raw) > MAX_FORM_BYTES:
        raise ApiError(413, "payload_too_large", f"a console form is at most {MAX_FORM_BYTES} bytes")
    fields = parse_qs(raw.decode("utf-8", errors="replace"), keep_blank_values=True, max_num_fields=10)
    return {k: v[0] for k, v in fields.items() if v}


@router.post("/login")
async def login(request: Request) -> Response:
    form = await _form(request)
    next_path = _safe_next(form.get("next"))
    expected = request.cookies.get(LOGIN_COOKIE) or ""
    given = form.get("login_csrf", "")
    if not same_origin(request) or not expected or not secrets.compare_digest(expected, given):
        return _login_page(next_path, "The login form expired or came from another site; log in again.",
                           error=True, status=403)
    token = form.get("token", "").strip()
    state = get_state(request)
    who = await run_in_threadpool(state.store.principal_for_token, token) if token else None
    if who is None:
        # The token is never echoed back: a typo'd secret stays out of the page.
        return _login_page(next_path, "That token is not valid (unknown or revoked).", error=True, status=401)
    sid, _ = state.extra["sessions"].open(token)
    resp = RedirectResponse(next_path, status_code=303, headers=SECURITY_HEADERS)
    resp.set_cookie(COOKIE, sid, max_age=MAX_AGE_S, path="/", httponly=True, samesite="strict",
                    secure=cookie_secure(request))
    resp.delete_cookie(LOGIN_COOKIE, path="/ui/login")
    return resp


@router.post("/logout")
async def logout(request: Request) -> Response:
    form = await _form(request)
    found = _session(request)
    if found is not None:
        sid, sess, _ = found
        if not same_origin(request) or not secrets.compare_digest(form.get("csrf", ""), sess.csrf):
            return _html("<!doctype html><title>Refused</title><p>Log out with the console's own button: "
                         "a logout from another site is refused.</p>", 403)
        get_state(request).extra["sessions"].close(sid)
    resp = RedirectResponse("/ui/login?bye=1", status_code=303, headers=SECURITY_HEADERS)
    resp.delete_cookie(COOKIE, path="/", httponly=True, samesite="strict")
    return resp


def _page(request: Request, page: str, title: str) -> Response:
    found = _session(request)
    if found is None:
        return _to_login(request)
    _, sess, who = found
    return _shell(page, title, _read(f"{page}.html"), sess, who)


@router.get("/jobs")
def jobs_page(request: Request) -> Response:
    return _page(request, "jobs", "Jobs")


@router.get("/jobs/{job_id}")
def job_page(request: Request, job_id: str) -> Response:
    found = _session(request)
    if found is None:
        return _to_login(request)
    _, sess, who = found
    try:
        job = visible_job(job_id, who, get_state(request))
    except ApiError:
        return _error_page(sess, who, 404, "No such job", f"There is no job {job_id!r} that {who.name} may see.")
    main = _template("job.html").safe_substitute(job_id=html.escape(job.id))
    head = '<link rel="stylesheet" href="/ui/static/vendor/uplot/uPlot.min.css">\n' \
           '<script src="/ui/static/vendor/uplot/uPlot.iife.min.js" defer></script>'
    return _shell("job", f"Job {job.name}", main, sess, who, job_id=job.id, head=head)


@router.get("/cluster")
def cluster_page(request: Request) -> Response:
    return _page(request, "cluster", "Cluster")


@router.get("/submit")
def submit_page(request: Request) -> Response:
    return _page(request, "submit", "Submit")


@router.get("/plan")
def plan_page(request: Request) -> Response:
    return _page(request, "plan", "Plan")
