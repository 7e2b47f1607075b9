// The jobs list: GET /v1/jobs with the filters of the form (kept in the address, so a view can be
// shared), cursor pages (Older follows next_cursor; Newer goes back), refreshed every few seconds
// while the tab is visible.
import { api, ago, badge, el, isAdmin, replaceRows, showError } from "./common.js";

const REFRESH_MS = 4000;
const form = document.getElementById("filters");
const tbody = document.querySelector("#jobs-table tbody");
const statusLine = document.getElementById("jobs-status");
const prevBtn = document.getElementById("prev");
const nextBtn = document.getElementById("next");
const pageNo = document.getElementById("page-no");
const live = document.getElementById("live");

const cursors = [null]; // cursors[i] opens page i+1
let nextCursor = null;
let seq = 0; // only the newest request's answer is shown

if (isAdmin) for (const n of document.querySelectorAll(".admin-only")) n.hidden = false;

function fromAddress() {
  const q = new URLSearchParams(location.search);
  const statuses = new Set(q.getAll("status").flatMap((s) => s.split(",")));
  for (const box of form.querySelectorAll('input[name="status"]')) box.checked = statuses.has(box.value);
  form.elements.name.value = q.get("name") ?? "";
  form.elements.owner.value = q.get("owner") ?? "";
  form.elements.limit.value = q.get("limit") ?? "50";
}

function filters() {
  const q = new URLSearchParams();
  const statuses = [...form.querySelectorAll('input[name="status"]:checked')].map((b) => b.value);
  if (statuses.length) q.set("status", statuses.join(","));
  if (form.elements.name.value.trim()) q.set("name", form.elements.name.value.trim());
  if (isAdmin && form.elements.owner.value.trim()) q.set("owner", form.elements.owner.value.trim());
  q.set("limit", form.elements.limit.value);
  return q;
}

function progressCell(job) {
  const p = job.progress;
  if (p.step === null || p.step === undefined) return el("td", {}, "—");
  const total = p.total_steps;
  const label = total ? `${p.step} / ${total}` : `${p.step}`;
  return el("td", {},
    total ? el("progress", { max: total, value: Math.min(p.step, total), "aria-label": `step ${label}` }) : null,
    " ", label);
}

function row(job) {
  return el("tr", { "data-job-id": job.id },
    el("td", {}, el("a", { href: `/ui/jobs/${encodeURIComponent(job.id)}` }, job.name),
      el("div", { class: "muted" }, job.id)),
    el("td", {}, badge(job.status), job.cancel_requested && job.status !== "CANCELLED" ? " (cancelling)" : ""),
    el("td", {}, job.owner),
    progressCell(job),
    el("td", { class: "num" }, job.progress.dp ?? "—"),
    el("td", { class: "num" }, job.progress.recoveries),
    el("td", { title: new Date(job.created_at * 1000).toLocaleString() }, ago(job.created_at)),
  );
}

async function load(pageIndex) {
  const mine = ++seq;
  const q = filters();
  const cursor = cursors[pageIndex];
  if (cursor) q.set("cursor", cursor);
  try {
    const page = await api(`/v1/jobs?${q}`);
    if (mine !== seq) return;
    replaceRows(tbody, page.items.map(row), "No jobs match these filters.", 7);
    nextCursor = page.next_cursor;
    cursors.length = pageIndex + 1;
    prevBtn.disabled = pageIndex === 0;
    nextBtn.disabled = !nextCursor;
    pageNo.textContent = `Page ${pageIndex + 1}`;
    statusLine.textContent = `${page.items.length} job(s) on this page · updated ${new Date().toLocaleTimeString()}`;
    live.hidden = false;
  } catch (err) {
    if (mine !== seq) return;
    showError(statusLine, err);
    live.hidden = true;
  }
}

form.addEventListener("submit", (ev) => {
  ev.preventDefault();
  history.replaceState(null, "", `?${filters()}`);
  cursors.length = 1;
  load(0);
});
form.addEventListener("reset", () => {
  setTimeout(() => {
    history.replaceState(null, "", location.pathname);
    cursors.length = 1;
    load(0);
  });
});
nextBtn.addEventListener("click", () => {
  if (!nextCursor) return;
  cursors.push(nextCursor);
  load(cursors.length - 1);
});
prevBtn.addEventListener("click", () => {
  if (cursors.length > 1) load(cursors.length - 2);
});

fromAddress();
load(0);
setInterval(() => {
  if (document.visibilityState === "visible") load(cursors.length - 1);
}, REFRESH_MS);
