// Submit: a YAML spec pasted or opened from a file, checked as you type by POST /v1/plan (the
// server's own validation: field errors, and whether a layout fits), submitted by POST /v1/jobs.
import { api, ApiError, el } from "./common.js";
import { planSummary, showFieldErrors } from "./specs.js";

const DEBOUNCE_MS = 400;
const STARTER = `name: my-job
model:
  preset: debug
training:
  steps: 200
  seq_len: 64
  global_batch_size: 8
resources:
  cpus_per_worker: 1
  dp: {min: 1, max: 2}
checkpoint:
  in_memory_every: 1
  persist_every: 50
`;

const form = document.getElementById("submit-form");
const text = document.getElementById("spec-text");
const file = document.getElementById("spec-file");
const errors = document.getElementById("spec-errors");
const planBox = document.getElementById("spec-plan");
const stateLine = document.getElementById("spec-state");
const submitBtn = document.getElementById("submit-btn");

let seq = 0;
let timer = null;

async function validate() {
  const mine = ++seq;
  if (!text.value.trim()) {
    showFieldErrors(errors, text, []);
    stateLine.textContent = "Type or paste a spec.";
    return;
  }
  stateLine.textContent = "Checking…";
  try {
    const plan = await api("/v1/plan", { method: "POST", body: text.value, contentType: "application/yaml" });
    if (mine !== seq) return;
    // The spec's own layout (when it names one) must fit too: its reasons belong to `parallelism`.
    const own = plan.requested && !plan.requested.fits
      ? plan.requested.reasons.map((m) => ({ field: "parallelism", message: `${plan.requested.layout}: ${m}` })) : [];
    const n = showFieldErrors(errors, text, own);
    planBox.replaceChildren(planSummary(plan));
    stateLine.textContent = n ? `The spec's own layout does not fit: ${n} problem(s).`
      : plan.ok ? "The spec is valid." : "The spec is valid, but no layout fits (see the plan).";
  } catch (err) {
    if (mine !== seq) return;
    if (!(err instanceof ApiError)) throw err;
    const n = showFieldErrors(errors, text, err.fields.length ? err.fields : [{ field: "", message: err.message }]);
    planBox.replaceChildren(el("p", { class: "muted" }, "No plan until the spec is valid."));
    stateLine.textContent = `${n} problem(s) in the spec.`;
  }
}

function schedule() {
  clearTimeout(timer);
  timer = setTimeout(() => validate().catch((e) => { stateLine.textContent = String(e); }), DEBOUNCE_MS);
}

text.addEventListener("input", schedule);
file.addEventListener("change", async () => {
  const f = file.files?.[0];
  if (!f) return;
  text.value = await f.text();
  schedule();
});

form.addEventListener("submit", async (ev) => {
  ev.preventDefault();
  submitBtn.disabled = true;
  stateLine.textContent = "Submitting…";
  try {
    const job = await api("/v1/jobs", { method: "POST", body: text.value, contentType: "application/yaml" });
    stateLine.textContent = `Submitted job ${job.id}.`;
    location.assign(`/ui/jobs/${encodeURIComponent(job.id)}`);
  } catch (err) {
    if (!(err instanceof ApiError)) throw err;
    const n = showFieldErrors(errors, text, err.fields.length ? err.fields : [{ field: "", message: err.message }]);
    stateLine.textContent = `Not submitted: ${n} problem(s).`;
    errors.querySelector("button")?.focus();
  } finally {
    submitBtn.disabled = false;
  }
});

// A spec typed or pasted before this module ran (it is deferred) is kept, not replaced by the starter.
if (!text.value) text.value = STARTER;
schedule();
