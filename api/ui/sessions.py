"""Console sessions: a login with an API token opens a session held by the server; the browser
keeps only a random session id in an HttpOnly, SameSite=Strict cookie.

Why server-side: the token never reaches the browser's storage (a stolen cookie dies with the
session, at logout or after `MAX_AGE_S`), and each request still resolves the token through the
store, so revoking the token ends its sessions at once. Sessions live in this process's memory:
a restarted server asks users to log in again.

CSRF: a cookie is sent by the browser on its own, so every mutating request (POST, PUT, PATCH,
DELETE) authenticated by the cookie must also carry the session's CSRF token in `X-CSRF-Token`
(or the `csrf` field of a console form) and, when the browser names an Origin (or a Referer),
come from this server's own origin. Bearer-token requests are not affected: a browser never
adds an Authorization header by itself.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.requests import Request

COOKIE = "unbroken_session"
LOGIN_COOKIE = "unbroken_login_csrf"  # double-submit token of the login form (against login CSRF)
CSRF_HEADER = "X-CSRF-Token"
MAX_AGE_S = 12 * 3600
MAX_SESSIONS = 10_000  # the oldest are dropped beyond this (a bound on memory, not a policy)
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True)
class Session:
    token: str  # the API token it was opened with (resolved through the store on every request)
    csrf: str
    created: float

    @property
    def expired(self) -> bool:
        return time.time() - self.created > MAX_AGE_S


def _key(session_id: str) -> str:
    # Only a hash of the id is kept: a memory dump does not hand out live cookies.
    return hashlib.sha256(session_id.encode("utf-8")).hexdigest()


class Sessions:
    """The open sessions of this server process, by hashed session id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, Session] = OrderedDict()

    def open(self, token: str) -> tuple[str, Session]:
        """A new session for `token` (already checked by the caller): (cookie value, session)."""
        sid = secrets.token_urlsafe(32)
        sess = Session(token=token, csrf=secrets.token_urlsafe(32), created=time.time())
        with self._lock:
            self._by_key[_key(sid)] = sess
            while len(self._by_key) > MAX_SESSIONS:
                self._by_key.popitem(last=False)
        return sid, sess

    def get(self, session_id: str | None) -> Session | None:
        if not session_id or len(session_id) > 128:
            return None
        key = _key(session_id)
        with self._lock:
            sess = self._by_key.get(key)
            if sess is not None and sess.expired:
                del self._by_key[key]
                return None
            return sess

    def close(self, session_id: str | None) -> None:
        if session_id:
            with self._lock:
                self._by_key.pop(_key(session_id), None)


def same_origin(request: Request) -> bool:
    """The browser's Origin (else Referer), when it sends one, names this server's host.

    The host (with its port) is compared, not the scheme: behind a proxy that ends TLS the server
    sees http while the browser says https."""
    source = request.headers.get("origin") or request.headers.get("referer")
    if not source:
        return True  # not a browser cross-site request: browsers send Origin on cross-site POSTs
    parts = urlsplit(source)
    if source == "null" or parts.scheme not in ("http", "https") or not parts.netloc:
        return False
    return parts.netloc.lower() == request.headers.get("host", "").lower()


def csrf_problem(request: Request, sess: Session, submitted: str | None) -> str | None:
    """Why a cookie-authenticated request may not change anything, or None when it may."""
    if request.method.upper() in SAFE_METHODS:
        return None
    if not same_origin(request):
        return "a cross-site request with the console's session cookie is refused (Origin is not this server)"
    if not submitted or not hmac.compare_digest(submitted.encode("utf-8"), sess.csrf.encode("utf-8")):
        return (f"missing or wrong {CSRF_HEADER}: the console sends it with every change; "
                "API clients send 'Authorization: Bearer <token>' instead of the cookie")
    return None


def cookie_secure(request: Request) -> bool:
    """Mark cookies Secure when the browser reaches the console over HTTPS (directly, or through a
    proxy that ends TLS and says so; a forged header only keeps the cookie off plain HTTP)."""
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"
