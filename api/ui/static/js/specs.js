// Job-spec editing shared by the submit and plan pages: where a field sits in the YAML text,
// the list of field errors beside the editor, and a short summary of a plan.
import { el, fmtBytes, fmtNum } from "./common.js";

const KEY_LINE = /^(\s*)(-\s+)?([A-Za-z0-9_.-]+)\s*:/;

// The 1-based line of a dotted field path ("training.steps", "chaos.0.kind") in block-style YAML:
// the line of that key, else of its nearest written ancestor (flow style, defaults); null if none.
export function lineOf(text, path) {
  const want = path.split(".").filter((p) => !/^\d+$/.test(p));
  const stack = [];
  let best = null;
  let bestDepth = 0;
  text.split("\n").forEach((line, i) => {
    const m = KEY_LINE.exec(line);
    if (!m || line.trimStart().startsWith("#")) return;
    const indent = m[1].length + (m[2] ? m[2].length : 0);
    while (stack.length && stack.at(-1).indent >= indent) stack.pop();
    stack.push({ indent, key: m[3] });
    const keys = stack.map((s) => s.key);
    let depth = 0;
    while (depth < keys.length && depth < want.length && keys[depth] === want[depth]) depth += 1;
    if (depth === keys.length && depth > bestDepth) { best = i + 1; bestDepth = depth; }
  });
  return best;
}

export function selectLine(textarea, line) {
  const lines = textarea.value.split("\n");
  const start = lines.slice(0, line - 1).reduce((n, l) => n + l.length + 1, 0);
  textarea.focus();
  textarea.setSelectionRange(start, start + (lines[line - 1] ?? "").length);
}

// Field errors ({field, message}) as a list beside the editor, each with its line and a button
// that selects that line. Returns how many were shown.
export function showFieldErrors(list, textarea, fields, extra = []) {
  const items = fields.map((f) => {
    const line = f.field && f.field !== "body" ? lineOf(textarea.value, f.field) : null;
    return el("li", { "data-field": f.field },
      el("span", { class: "where" }, f.field || "spec"), line ? ` (line ${line})` : "", ": ", f.message,
      line ? el("button", { type: "button", class: "secondary", onclick: () => selectLine(textarea, line),
        "aria-label": `Go to line ${line} (${f.field})` }, "Go to line") : null);
  });
  for (const w of extra) items.push(el("li", { class: "warn" }, w));
  list.replaceChildren(...items);
  textarea.setAttribute("aria-invalid", fields.length ? "true" : "false");
  return items.length;
}

export function planSummary(plan) {
  if (!plan.ok) {
    return el("div", {}, el("p", { class: "error" }, "No layout fits this cluster:"),
      el("ul", { class: "errors" }, (plan.reasons.length ? plan.reasons : plan.errors).slice(0, 6).map((r) => el("li", { class: "warn" }, r))));
  }
  const b = plan.best;
  const c = plan.cluster;
  return el("div", {},
    el("p", { class: "ok-text" }, `Fits: ${b.layout} on ${c.gpus} ${c.gpu} device(s) over ${c.nodes} node(s).`),
    el("p", {}, `About ${fmtNum(b.tokens_per_s)} tokens/s, ${fmtNum(b.step_time_s)} s a step; `
      + `peak memory ${fmtBytes(b.peak_memory_bytes)} of ${fmtBytes(b.capacity_bytes)} per device.`),
    c.source ? el("p", { class: "muted" }, `Cluster: ${c.source}.`) : null,
    plan.submission && !plan.submission.ok
      ? el("p", { class: "error" }, `auto: ${plan.submission.reasons.join("; ")}`) : null);
}
