"""The web console's browser: Debian's chromium (installed with apt-get when missing) driven by
Playwright through `executable_path` (Playwright cannot download its own browsers here).

Helpers: log in through the login page, record every request a page makes, and match each
against the server's OpenAPI schema."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync",
]
APT_TIMEOUT_S = 900


def ensure_chromium() -> str:
    """Debian's chromium, installed with apt-get if it is missing; skips (saying why) only when
    the install itself fails."""
    if os.path.exists(CHROMIUM) and shutil.which("chromedriver"):
        return CHROMIUM
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(f"{CHROMIUM} is missing and cannot be installed here (needs apt-get as root): "
                    "apt-get install chromium chromium-driver")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    lock = ["-o", "DPkg::Lock::Timeout=300"]
    for cmd in (["apt-get", *lock, "update"],
                ["apt-get", *lock, "install", "-y", "--no-install-recommends", "chromium", "chromium-driver"]):
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=APT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.skip(f"{' '.join(cmd)} did not finish in {APT_TIMEOUT_S} s")
        if done.returncode != 0:
            pytest.skip(f"chromium could not be installed: {' '.join(cmd)} exited {done.returncode}: "
                        f"{(done.stderr or done.stdout)[-600:]}")
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"apt-get installed chromium but {CHROMIUM} does not exist")
    return CHROMIUM


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    path = ensure_chromium()
    from playwright.sync_api import expect, sync_playwright

    # Playwright's 5 s default for an expectation is tight where another test file trains beside this one
    # on the same 2 cores (`make test` runs two at a time): a check-as-you-type answer took over 5 s there.
    # An expectation still returns as soon as it holds.
    expect.set_options(timeout=20_000)
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=path, args=FLAGS, headless=True)
        try:
            yield b
        finally:
            b.close()


def screenshot(page: Any, path: Path, *, full_page: bool = True) -> None:
    """A picture of the page for people to look at, not a check: Playwright's 30 s default for an action
    ran out on a full-page screenshot beside two training test files on these 2 cores (2026-12-08), so
    it gets longer."""
    page.screenshot(path=str(path), full_page=full_page, timeout=120_000)


@dataclass
class Recorder:
    """Every request the console's scripts make (fetch/XHR/event streams), by method and path."""

    base: str
    calls: list[tuple[str, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def attach(self, page: Any) -> None:
        page.on("request", self._request)
        page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        page.on("console", self._console)

    def _console(self, msg: Any) -> None:
        # A refused request (422 while typing, a 404 page) is logged by the browser itself: expected.
        if msg.type == "error" and not msg.text.startswith("Failed to load resource"):
            self.errors.append(f"console {msg.type}: {msg.text}")

    def _request(self, req: Any) -> None:
        if req.resource_type in ("fetch", "xhr", "eventsource", "websocket"):
            parts = urlsplit(req.url)
            self.calls.append((req.method, parts.path if f"{parts.scheme}://{parts.netloc}" == self.base else req.url))


def undocumented(calls: list[tuple[str, str]], openapi: dict[str, Any]) -> list[tuple[str, str]]:
    """The (method, path) pairs that no /v1 operation of the OpenAPI schema describes."""
    ops = []
    for template, item in openapi["paths"].items():
        pattern = re.compile("^" + re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)) + "$")
        ops.append((pattern, {m.upper() for m in item}, template))
    bad = []
    for method, path in calls:
        ok = any(p.match(path) and method in methods and t.startswith("/v1/") for p, methods, t in ops)
        if not ok:
            bad.append((method, path))
    return bad


def openapi_of(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/openapi.json", timeout=30).json()


def login(page: Any, url: str, token: str, *, next_path: str = "/ui/jobs") -> None:
    """Log in through the login page (as a user would), landing on `next_path`."""
    page.goto(f"{url}{next_path}")
    page.wait_for_url("**/ui/login**")
    page.get_by_label("API token").fill(token)
    page.get_by_role("button", name="Log in").click()
    page.wait_for_url(f"**{next_path}")


def nav(page: Any, name: str) -> None:
    """Follow a link of the console's navigation bar."""
    page.get_by_role("navigation", name="Console").get_by_role("link", name=name).click()


def no_secret_in(page: Any, *secrets: str) -> None:
    html = page.content()
    for s in secrets:
        assert s not in html, f"a secret appears in {page.url}"
