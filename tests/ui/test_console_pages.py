"""The console's pages in Debian's chromium against a real store-only server holding 10,000 jobs:
the jobs list pages by cursor and filters exactly as the API does, and updates live; the submit
page shows field errors beside the spec with their line, submits, and the job page deletes with
a confirmation; the plan and cluster pages render; every page is keyboard-usable, labelled,
readable (contrast) and fits a narrow window; every request the pages make is a documented /v1
route; no secret appears in any page."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from api.app import create_app
from api.server import BackgroundServer
from service.spec import parse_spec
from service.store import JobStore
from tests.benchmarks.api_bench import populate
from tests.ui.conftest import Recorder, login, nav, no_secret_in, openapi_of, screenshot, undocumented

N_JOBS = 10_000
SECRET = "pages-secret-value-5b7e"
WIDE = {"width": 1280, "height": 900}
NARROW = {"width": 390, "height": 844}

# Text whose contrast is below WCAG AA (4.5:1, 3:1 for large text) against its backdrop.
LOW_CONTRAST_JS = """() => {
  const parse = (c) => { const m = c.match(/rgba?\\(([^)]+)\\)/); if (!m) return null;
    const p = m[1].split(/[ ,\\/]+/).filter(Boolean).map(Number); return {r: p[0], g: p[1], b: p[2], a: p.length > 3 ? p[3] : 1}; };
  const lum = ({r, g, b}) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : Math.pow((v + 0.055) / 1.055, 2.4); };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b); };
  const backdrop = (el) => { for (let e = el; e; e = e.parentElement) { const c = parse(getComputedStyle(e).backgroundColor);
    if (c && c.a > 0.5) return c; } return {r: 255, g: 255, b: 255, a: 1}; };
  const bad = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  while (walk.nextNode()) {
    const t = walk.currentNode; const el = t.parentElement;
    if (!t.textContent.trim() || el.closest('[hidden], .visually-hidden, .skip, button:disabled, script')) continue;
    const r = el.getBoundingClientRect(); if (!r.width || !r.height) continue;
    const cs = getComputedStyle(el); const L1 = lum(parse(cs.color)); const L2 = lum(backdrop(el));
    const ratio = (Math.max(L1, L2) + 0.05) / (Math.min(L1, L2) + 0.05);
    const size = parseFloat(cs.fontSize); const large = size >= 24 || (parseInt(cs.fontWeight) >= 700 && size >= 18.66);
    if (ratio < (large ? 3 : 4.5)) bad.push(`${el.tagName}: "${t.textContent.trim().slice(0, 40)}" ${ratio.toFixed(2)}`);
  }
  return bad;
}"""

# Form controls without a label, and buttons or links without a name.
UNLABELLED_JS = """() => {
  const bad = [];
  for (const e of document.querySelectorAll('input:not([type=hidden]), select, textarea')) {
    if (!(e.labels && e.labels.length) && !e.getAttribute('aria-label') && !e.getAttribute('aria-labelledby')) bad.push(e.outerHTML.slice(0, 80));
  }
  for (const e of document.querySelectorAll('button, a[href]')) {
    if (!e.textContent.trim() && !e.getAttribute('aria-label')) bad.push(e.outerHTML.slice(0, 80));
  }
  return bad;
}"""


@dataclass
class Site:
    url: str
    store: JobStore
    admin: str
    user: str  # user3's token: one of populate()'s owners
    secret_job: str


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    store = JobStore(f"sqlite:///{tmp_path_factory.mktemp('pages') / 'jobs.db'}")
    populate(store, N_JOBS)
    job, _ = store.create_job(parse_spec({"name": "with-secret", "runtime_env": {"secret_env_vars": {"TOKEN": SECRET}}}),
                              "user3", min_world=1, max_world=1)
    # Rows as a supervisor writes them, some with an evaluation loss.
    store.add_metrics(job.id, [{"step": s, "loss": 4.0 - s / 10, "dp": 1, "generation": 0, "tokens_per_s": 900.0,
                                "step_time_s": 0.2, **({"eval_loss": 4.1 - s / 10} if s % 5 == 0 else {})}
                               for s in range(1, 21)])
    srv = BackgroundServer(create_app(store, None, cluster_total={"CPU": 4.0})).start()
    try:
        yield Site(srv.url, store, store.create_token("root", "admin"), store.create_token("user3"), job.id)
    finally:
        srv.stop()
        store.close()


def row_ids(page: Any) -> list[str]:
    return page.eval_on_selector_all("#jobs-table tbody tr[data-job-id]", "rs => rs.map(r => r.dataset.jobId)")


def wait_rows(page: Any, want: list[str], timeout_s: float = 20.0) -> float:
    t0 = time.monotonic()
    while row_ids(page) != want:
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"the list shows {row_ids(page)[:3]}..., want {want[:3]}...")
        page.wait_for_timeout(50)
    return time.monotonic() - t0


def check_page(page: Any, shots: Path, name: str, rec: Recorder, *secrets: str) -> None:
    """Labels, contrast, no overflow at both widths, no secret; a screenshot of each width."""
    assert page.evaluate(UNLABELLED_JS) == [], name
    assert page.evaluate(LOW_CONTRAST_JS) == [], name
    no_secret_in(page, *secrets)
    screenshot(page, shots / f"{name}.png")
    page.set_viewport_size(NARROW)
    page.wait_for_timeout(300)
    overflow = page.evaluate("() => document.documentElement.scrollWidth - window.innerWidth")
    assert overflow <= 1, f"{name} is {overflow}px wider than a {NARROW['width']}px window"
    screenshot(page, shots / f"{name}-narrow.png")
    page.set_viewport_size(WIDE)


def test_pages_with_10000_jobs(browser: Any, site: Site, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    ctx = browser.new_context(viewport=WIDE)
    page = ctx.new_page()
    rec = Recorder(site.url)
    rec.attach(page)
    secrets = (SECRET, site.admin, site.user)
    login(page, site.url, site.admin)

    # Keyboard: the skip link comes first and moves focus to the content; focus is visible.
    page.keyboard.press("Tab")
    assert page.evaluate("document.activeElement.className") == "skip"
    outline = page.evaluate("getComputedStyle(document.activeElement).outlineStyle")
    assert outline not in ("none", ""), "focus must be visible"
    page.keyboard.press("Enter")
    assert page.evaluate("document.activeElement.id") == "main"

    # 1. The list: each page equals the API's page; Older/Newer follow the cursors.
    pages = []
    cursor = None
    for _ in range(4):
        got, cursor = site.store.list_jobs(limit=50, cursor=cursor)
        pages.append([j.id for j in got])
    wait_rows(page, pages[0])
    timings = []
    for k in (1, 2, 3):
        page.get_by_role("button", name="Older").click()
        timings.append(wait_rows(page, pages[k]))
    expect(page.locator("#page-no")).to_have_text("Page 4")
    page.get_by_role("button", name="Newer").click()
    wait_rows(page, pages[2])
    print(f"\njobs list with {N_JOBS} jobs: page turns shown in {', '.join(f'{t * 1000:.0f}' for t in timings)} ms")

    # Filters (kept in the address): status and name, with their own cursor pages.
    page.get_by_label("Failed").check()
    page.get_by_label("Name", exact=True).fill("bench-6")
    page.get_by_role("button", name="Apply").click()
    want, nxt = site.store.list_jobs(status=["FAILED"], name="bench-6", limit=50)
    assert len(want) == 50
    wait_rows(page, [j.id for j in want])
    assert "status=FAILED" in page.url and "name=bench-6" in page.url
    assert nxt is not None
    page.get_by_role("button", name="Older").click()
    wait_rows(page, [j.id for j in site.store.list_jobs(status=["FAILED"], name="bench-6", limit=50, cursor=nxt)[0]])
    page.get_by_role("button", name="Clear").click()
    wait_rows(page, pages[0])

    # Live: a change in the store shows up without a reload.
    newest = pages[0][0]
    site.store.set_status(newest, "CANCELLED", "cancelled for the live-update check")
    expect(page.locator(f'tr[data-job-id="{newest}"] .badge')).to_have_text("CANCELLED", timeout=15_000)
    check_page(page, tmp_path, "jobs", rec, *secrets)

    # 2. Plan: ranked layouts with their memory breakdown, and the rejected ones.
    nav(page, "Plan")
    expect(page.locator("#candidates tbody tr").first).to_be_visible(timeout=30_000)
    assert page.locator("#rejected tbody tr").count() > 0
    page.locator("#candidates details summary").first.click()
    expect(page.locator("#candidates details table").first).to_be_visible()
    check_page(page, tmp_path, "plan", rec, *secrets)

    # 3. Cluster (store only: no nodes, the queue in admission order).
    nav(page, "Cluster")
    expect(page.locator("#cluster-summary")).to_contain_text("store only")
    expect(page.locator("#queue tbody tr").first).to_be_visible()
    first = page.locator("#queue tbody tr").first.locator("td").first.inner_text()
    assert first == "1"
    check_page(page, tmp_path, "cluster", rec, *secrets)
    ctx.close()

    # 4. As a user: only its own jobs; submit with errors beside the spec, then delete.
    ctx = browser.new_context(viewport=WIDE)
    page = ctx.new_page()
    rec_user = Recorder(site.url)
    rec_user.attach(page)
    login(page, site.url, site.user)
    expect(page.locator("#jobs-table tbody tr[data-job-id]")).to_have_count(50)
    owners = page.eval_on_selector_all("#jobs-table tbody tr td:nth-child(3)", "tds => tds.map(t => t.textContent)")
    assert set(owners) == {"user3"}
    assert page.locator(".admin-only").is_hidden()
    page.goto(f"{site.url}/ui/jobs/{site.secret_job}")
    expect(page.locator("#spec")).to_contain_text("**********")
    expect(page.locator("#loss-chart")).to_have_attribute("data-points", "20")
    expect(page.locator("#loss-chart .u-legend")).to_contain_text("eval loss")
    check_page(page, tmp_path, "job-store-only", rec_user, *secrets)

    nav(page, "Submit")
    editor = page.get_by_label("Job spec (YAML)")
    editor.fill("name: ui-sub\nmodel:\n  preset: tiny\ntraining:\n  steps: 0\n  seq_len: 32\n")
    err = page.locator('#spec-errors li[data-field="training.steps"]')
    expect(err).to_contain_text("(line 5)")
    expect(err).to_contain_text("greater than or equal to 1")
    assert editor.get_attribute("aria-invalid") == "true"
    err.get_by_role("button").click()
    assert page.evaluate("document.activeElement.id") == "spec-text"
    check_page(page, tmp_path, "submit-errors", rec_user, *secrets)
    # A layout of the spec's own that cannot work: shown as you type, and named by the submission.
    editor.fill("name: ui-sub\nmodel:\n  preset: tiny\ntraining:\n  steps: 5\nparallelism:\n  tp: 3\n")
    expect(page.locator('#spec-errors li[data-field="parallelism"]').first).to_contain_text("(line 6)")
    expect(page.locator('#spec-errors li[data-field="parallelism"]').first).to_contain_text("does not divide")
    page.get_by_role("button", name="Submit job").click()
    refused = page.locator('#spec-errors li[data-field="parallelism.tp"]').first
    expect(refused).to_contain_text("(line 7)")
    expect(refused).to_contain_text("pick a tp that divides")
    editor.fill("name: ui-sub\nmodel:\n  preset: tiny\ntraining:\n  steps: 5\nresources:\n  cpus_per_worker: 1\n")
    expect(page.locator("#spec-state")).to_contain_text("valid", timeout=15_000)
    page.get_by_role("button", name="Submit job").click()
    page.wait_for_url("**/ui/jobs/*")
    job_id = page.url.rsplit("/", 1)[1]
    assert site.store.get_job(job_id).owner == "user3"  # type: ignore[union-attr]
    # Store only: cancelling is immediate; then delete, each after a confirmation.
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Keep the job").click()
    page.wait_for_timeout(300)
    assert site.store.get_job(job_id).status == "PENDING"  # type: ignore[union-attr]
    page.get_by_role("button", name="Cancel job").click()
    page.get_by_role("button", name="Cancel the job").click()
    expect(page.locator("#job-status")).to_have_text("CANCELLED", timeout=15_000)
    page.get_by_role("button", name="Delete job").click()
    page.get_by_role("button", name="Delete the job").click()
    page.wait_for_url("**/ui/jobs")
    assert site.store.get_job(job_id) is None

    # Another user's job page: 404.
    other = site.store.list_jobs(owner="user4", limit=1)[0][0].id
    resp = page.goto(f"{site.url}/ui/jobs/{other}")
    assert resp is not None and resp.status == 404
    ctx.close()

    openapi = openapi_of(site.url)
    for r in (rec, rec_user):
        assert r.calls and not undocumented(r.calls, openapi), undocumented(r.calls, openapi)
        assert not r.errors, r.errors
