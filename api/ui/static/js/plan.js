// Plan: POST /v1/plan for a spec and a cluster shape; the ranked layouts that fit (each with its
// memory breakdown and step-time terms), the spec's own layout, and the rejected ones with why.
import { api, ApiError, el, fmtBytes, fmtNum, fmtSecs } from "./common.js";
import { planSummary, showFieldErrors } from "./specs.js";

const STARTER = `model:
  preset: llama3-8b
training:
  seq_len: 4096
  global_batch_size: 64
parallelism: auto
`;

const form = document.getElementById("plan-form");
const text = document.getElementById("plan-text");
const errors = document.getElementById("plan-errors");
const summary = document.getElementById("plan-summary");
const out = document.getElementById("plan-out");

function terms(title, items, unit) {
  if (!items?.length) return null;
  return el("div", {}, el("h4", {}, title), el("table", {},
    el("thead", {}, el("tr", {}, el("th", { scope: "col" }, "Term"), el("th", { scope: "col", class: "num" }, "Value"),
      el("th", { scope: "col" }, "Formula"), el("th", { scope: "col" }, "Filled in"))),
    el("tbody", {}, items.map((t) => el("tr", {}, el("td", {}, t.name),
      el("td", { class: "num" }, unit === "s" ? fmtSecs(t.value) : fmtBytes(t.value)),
      el("td", {}, el("code", {}, t.formula)), el("td", {}, el("code", {}, t.filled)))))));
}

function breakdown(c) {
  const m = c.memory ?? {};
  return el("details", {}, el("summary", {}, `Memory and time of ${c.layout}`),
    terms("Persistent memory (per device)", m.persistent, "B"),
    terms("Forward and backward", m.fwd_bwd, "B"),
    terms("Optimizer step", m.optimizer_step, "B"),
    terms("Host memory", m.host, "B"),
    terms("Step time", c.time?.terms, "s"),
    [...(m.notes ?? []), ...(c.time?.notes ?? []), ...(c.notes ?? [])].map((n) => el("p", { class: "muted" }, n)));
}

function render(plan) {
  summary.replaceChildren(planSummary(plan));
  const sections = [];
  if (plan.requested) {
    const r = plan.requested;
    sections.push(el("section", { class: "card", "aria-labelledby": "h-req" }, el("h2", { id: "h-req" }, "The spec's own layout"),
      el("p", { class: r.fits ? "ok-text" : "error" }, `${r.layout}: ${r.fits ? "fits" : "does not fit"}`),
      r.reasons?.length ? el("ul", { class: "errors" }, r.reasons.map((x) => el("li", {}, x))) : null));
  }
  sections.push(el("section", { class: "card", "aria-labelledby": "h-cand" },
    el("h2", { id: "h-cand" }, `Layouts that fit (${plan.candidates.length}), fastest first`),
    el("div", { class: "table-wrap", role: "region", "aria-labelledby": "h-cand", tabindex: 0 },
      el("table", { class: "plan-table", id: "candidates" },
        el("thead", {}, el("tr", {}, ["#", "Layout", "Tokens/s", "Step time", "MFU", "Peak memory / device"].map((h) =>
          el("th", { scope: "col" }, h)))),
        el("tbody", {}, plan.candidates.map((c, i) => el("tr", {},
          el("td", { class: "num" }, i + 1), el("td", {}, c.layout, breakdown(c)),
          el("td", { class: "num" }, fmtNum(c.tokens_per_s)), el("td", { class: "num" }, fmtSecs(c.step_time_s)),
          el("td", { class: "num" }, c.mfu === null || c.mfu === undefined ? "—" : `${(c.mfu * 100).toFixed(1)}%`),
          el("td", { class: "num" }, `${fmtBytes(c.peak_memory_bytes)} of ${fmtBytes(c.capacity_bytes)}`))))))));
  if (plan.rejected.length) {
    sections.push(el("section", { class: "card", "aria-labelledby": "h-rej" },
      el("h2", { id: "h-rej" }, `Rejected layouts (${plan.rejected.length})`),
      el("div", { class: "table-wrap", role: "region", "aria-labelledby": "h-rej", tabindex: 0 },
        el("table", { class: "plan-table", id: "rejected" },
          el("thead", {}, el("tr", {}, ["Layout", "Why", "Peak memory / device"].map((h) => el("th", { scope: "col" }, h)))),
          el("tbody", {}, plan.rejected.map((r) => el("tr", {}, el("td", {}, r.layout),
            el("td", { class: "reason" }, r.reasons.join("; ")),
            el("td", { class: "num" }, fmtBytes(r.peak_memory_bytes)))))))));
  }
  out.replaceChildren(...sections);
}

async function run() {
  const q = new URLSearchParams();
  for (const [id, key] of [["plan-gpus", "gpus"], ["plan-gpu", "gpu"], ["plan-nodes", "nodes"]]) {
    const v = document.getElementById(id).value.trim();
    if (v) q.set(key, v);
  }
  summary.replaceChildren(el("p", { class: "muted" }, "Planning…"));
  try {
    const path = q.size ? `/v1/plan?${q}` : "/v1/plan";
    const plan = await api(path, { method: "POST", body: text.value, contentType: "application/yaml" });
    showFieldErrors(errors, text, []);
    render(plan);
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    showFieldErrors(errors, text, err.fields.length ? err.fields : [{ field: "", message: err.message }]);
    summary.replaceChildren(el("p", { class: "error" }, err.message));
    out.replaceChildren();
  }
}

form.addEventListener("submit", (ev) => { ev.preventDefault(); run(); });
// The shape's defaults are in the page itself; the starter fills only an empty editor, so what was
// typed before this deferred module ran is kept (as on the submit page).
if (!text.value) text.value = STARTER;
run();
