// One job: its loss and throughput charts (generations and dp as bands; failures, recoveries and
// resizes as markers), recovery table, checkpoints of both tiers, events, log tail and spec.
//
// Live, through three Server-Sent Events streams of the job, each ending when the job finishes:
// its events (GET /v1/jobs/{id}/events?follow=true), its metrics rows (…/metrics?follow=true) and
// its log lines (…/logs?follow=true&tail=N: the newest N, then each new one). Nothing is polled
// for them; only the keepers' in-memory snapshots (GET /v1/cluster) are re-read now and then.
import {
  api, ago, announce, badge, el, fmtBytes, fmtNum, fmtSecs, fmtTime, replaceRows, showError,
} from "./common.js";

const jobId = document.body.dataset.jobId;
const base = `/v1/jobs/${encodeURIComponent(jobId)}`;
const SNAPSHOTS_MS = 9000;
const LOG_KEEP = 400;
const DRAW_MS = 100; // rows and lines that arrive together are drawn together
const POLL_S = 0.5; // how often the server looks for new rows and lines of an idle stream
const TERMINAL = new Set(["SUCCEEDED", "FAILED", "CANCELLED"]);
const RECOVERY_KINDS = new Set(["restored", "recovered"]);
const REFRESH_ON = new Set([
  "state", "started", "admitted", "supervisor_started", "generation", "failure_detected", "restored",
  "recovered", "resumed", "resized", "finished", "failed", "cancelled", "cancel_requested", "released", "waiting",
]);

const S = {
  job: null,
  goodput: null, // GET .../goodput: the share of the wall time since step 1 spent in steps, and the pauses
  rows: [],
  lastStep: -1,
  events: [],
  lastEventId: 0,
  logs: [],
  logAfter: 0,
  streamOpen: false,
  ended: false,
};

// ------------------------------------------------------------------ the header and facts
function renderJob() {
  const j = S.job;
  document.getElementById("job-name").textContent = j.name;
  document.title = `Job ${j.name} · Unbroken`;
  document.getElementById("job-status").replaceWith(Object.assign(badge(j.status), { id: "job-status" }));
  document.getElementById("job-reason").textContent = j.reason ?? "";
  const terminal = TERMINAL.has(j.status);
  document.getElementById("cancel").hidden = terminal || j.cancel_requested;
  document.getElementById("delete").hidden = !terminal;
  const last = S.rows.at(-1) ?? {};
  // The streamed rows run ahead of the job record, which is re-read only when an event says so.
  const p = (last.step ?? -1) > (j.progress.step ?? -1) ? { ...j.progress, ...last } : j.progress;
  const facts = [
    ["Owner", j.owner],
    ["Step", p.step === null ? "—" : `${p.step}${p.total_steps ? ` / ${p.total_steps}` : ""}`],
    ["Loss", fmtNum(p.loss, 4)],
    ["Tokens/s", fmtNum(p.tokens_per_s)],
    ["Step time", fmtSecs(last.step_time_s)],
    ["dp", `${p.dp ?? "—"} (range ${j.min_world}–${j.max_world ?? "cluster"} workers)`],
    ["Generation", p.generation ?? "—"],
    ["Recoveries", p.recoveries],
    ["Goodput", S.goodput ? S.goodput.summary : "—"],
    ["Priority", j.priority],
    ["Submitted", `${ago(j.created_at)} ago`],
    ["Started", fmtTime(j.started_at)],
    ["Finished", fmtTime(j.finished_at)],
  ];
  document.getElementById("job-facts").replaceChildren(
    ...facts.map(([k, v]) => el("div", {}, el("dt", {}, k), el("dd", {}, v))));
  document.getElementById("spec").textContent = JSON.stringify(j.spec, null, 2);
}

async function refreshJob() {
  // (an older server without the goodput resource: the fact shows a dash)
  [S.job, S.goodput] = await Promise.all([api(base), api(`${base}/goodput`).catch(() => null)]);
  renderJob();
}

// ------------------------------------------------------------------ charts
function bands() {
  const out = [];
  for (const r of S.rows) {
    const cur = out.at(-1);
    if (cur && cur.generation === r.generation && cur.dp === r.dp) cur.to = r.step;
    else out.push({ from: r.step, to: r.step, generation: r.generation, dp: r.dp });
  }
  return out;
}

function markers() {
  const firstStepOfGen = (g) => S.rows.find((r) => r.generation >= g)?.step;
  const out = [];
  for (const ev of S.events) {
    const d = ev.data ?? {};
    if (ev.kind === "failure_detected") {
      const step = d.step;
      out.push({ kind: "failure", step, text: `Failure after step ${step ?? "?"}: ${d.kind ?? ev.message}` });
    } else if (RECOVERY_KINDS.has(ev.kind)) {
      const step = d.first_step ?? firstStepOfGen(d.generation);
      out.push({
        kind: "recovery", step,
        text: `Recovered (generation ${d.generation ?? "?"}) at step ${step ?? "?"}: restored step ${d.restored_step ?? "?"}`
          + ` from ${[].concat(d.source ?? []).join("/") || "?"}`,
      });
    } else if (ev.kind === "resized") {
      const step = firstStepOfGen(d.generation) ?? S.lastStep;
      out.push({ kind: "resize", step, text: `Resized dp ${d.old_dp ?? "?"} → ${d.new_dp ?? "?"} at step ${step ?? "?"}` });
    }
  }
  return out;
}

const MARK_STYLE = {
  failure: { color: "#c5221f", dash: [6, 4] },
  recovery: { color: "#188038", dash: [] },
  resize: { color: "#1a56db", dash: [2, 3] },
};

function bandPlugin() {
  return {
    hooks: {
      drawClear: [(u) => {
        const { ctx } = u;
        const { left, top, width, height } = u.bbox;
        ctx.save();
        ctx.font = `${Math.round(11 * devicePixelRatio)}px system-ui, sans-serif`;
        bands().forEach((b, i) => {
          // Half a step either side, kept inside the plotting area.
          const x0 = Math.max(left, u.valToPos(b.from - 0.5, "x", true));
          const x1 = Math.min(left + width, u.valToPos(b.to + 0.5, "x", true));
          if (x1 <= x0) return;
          ctx.fillStyle = i % 2 ? "rgba(11, 87, 208, 0.07)" : "rgba(11, 87, 208, 0.15)";
          ctx.fillRect(x0, top, x1 - x0, height);
          ctx.fillStyle = "#1b1f24";
          if (x1 - x0 > 40 * devicePixelRatio) ctx.fillText(`gen ${b.generation} · dp ${b.dp}`, x0 + 4, top + 14 * devicePixelRatio);
        });
        ctx.restore();
      }],
      draw: [(u) => {
        const { ctx } = u;
        const { top, height } = u.bbox;
        ctx.save();
        ctx.lineWidth = 2 * devicePixelRatio;
        for (const m of markers()) {
          if (m.step === undefined || m.step === null) continue;
          const x = u.valToPos(m.step, "x", true);
          ctx.strokeStyle = MARK_STYLE[m.kind].color;
          ctx.setLineDash(MARK_STYLE[m.kind].dash.map((v) => v * devicePixelRatio));
          ctx.beginPath();
          ctx.moveTo(x, top);
          ctx.lineTo(x, top + height);
          ctx.stroke();
        }
        ctx.restore();
      }],
    },
  };
}

let lossPlot = null;
let speedPlot = null;

function chartWidth(node) {
  return Math.max(280, node.clientWidth || 600);
}

function lossData() {
  const steps = S.rows.map((r) => r.step);
  const data = [steps, S.rows.map((r) => r.loss ?? null)];
  if (S.rows.some((r) => r.eval_loss !== undefined && r.eval_loss !== null)) data.push(S.rows.map((r) => r.eval_loss ?? null));
  return data;
}

function drawCharts() {
  const lossNode = document.getElementById("loss-chart");
  const speedNode = document.getElementById("speed-chart");
  lossNode.dataset.points = String(S.rows.length);
  lossNode.dataset.markers = markers().map((m) => `${m.kind}@${m.step}`).join(" ");
  if (!window.uPlot || !S.rows.length) return;
  const ld = lossData();
  if (lossPlot && lossPlot.series.length !== ld.length) { lossPlot.destroy(); lossPlot = null; }
  if (!lossPlot) {
    const series = [{ label: "step" }, { label: "loss", stroke: "#0b57d0", width: 2 }];
    if (ld.length > 2) series.push({ label: "eval loss", stroke: "#b3261e", width: 2, spanGaps: true, points: { show: true } });
    lossPlot = new window.uPlot({
      width: chartWidth(lossNode), height: 280, series, plugins: [bandPlugin()],
      scales: { x: { time: false } }, axes: [{ label: "step" }, { label: "loss" }],
    }, ld, lossNode);
  } else lossPlot.setData(ld);
  const sd = [S.rows.map((r) => r.step), S.rows.map((r) => r.tokens_per_s ?? null), S.rows.map((r) => r.step_time_s ?? null)];
  if (!speedPlot) {
    speedPlot = new window.uPlot({
      width: chartWidth(speedNode), height: 220,
      series: [{ label: "step" }, { label: "tokens/s", stroke: "#146c2e", width: 2, scale: "tps" },
        { label: "step time (s)", stroke: "#8a5300", width: 2, scale: "s" }],
      scales: { x: { time: false } },
      axes: [{ label: "step" }, { scale: "tps", label: "tokens/s" }, { scale: "s", side: 1, label: "step time (s)", grid: { show: false } }],
      plugins: [bandPlugin()],
    }, sd, speedNode);
  } else speedPlot.setData(sd);
}

new ResizeObserver(() => {
  if (lossPlot) lossPlot.setSize({ width: chartWidth(document.getElementById("loss-chart")), height: 280 });
  if (speedPlot) speedPlot.setSize({ width: chartWidth(document.getElementById("speed-chart")), height: 220 });
}).observe(document.getElementById("main"));

function renderMarkers() {
  const list = markers();
  document.getElementById("markers").replaceChildren(...list.map((m) => el("li", { class: `marker-${m.kind}` }, m.text)));
}

// ------------------------------------------------------------------ tables
function renderRecoveries() {
  const rows = S.events.filter((e) => RECOVERY_KINDS.has(e.kind)).map((e) => {
    const d = e.data ?? {};
    return el("tr", { class: "recovery" },
      el("td", { class: "num" }, d.generation ?? "—"),
      el("td", {}, d.kind ?? "—", d.fallback_reason ? el("div", { class: "muted" }, `fallback: ${d.fallback_reason}`) : null),
      el("td", { class: "num" }, fmtSecs(d.detect_s)),
      el("td", { class: "num" }, fmtSecs(d.reform_s)),
      el("td", { class: "num" }, fmtSecs(d.restore_s)),
      el("td", { class: "num" }, fmtSecs(d.replay_s)),
      el("td", { class: "num" }, fmtSecs(d.total_s)),
      el("td", { class: "num" }, d.lost_steps ?? "—"),
      el("td", { class: "num" }, d.restored_step ?? "—"),
      el("td", {}, [].concat(d.source ?? []).join(", ") || "—"));
  });
  replaceRows(document.querySelector("#recoveries tbody"), rows, "No recovery yet.", 10);
}

async function refreshCheckpoints() {
  const { items } = await api(`${base}/checkpoints`);
  replaceRows(document.querySelector("#checkpoints tbody"), items.map((c) => el("tr", {},
    el("td", { class: "num" }, c.step), el("td", {}, c.tier), el("td", {}, el("code", {}, c.uri)),
    el("td", {}, fmtTime(c.ts)))), "None yet.", 4);
}

async function refreshSnapshots() {
  const cluster = await api("/v1/cluster");
  const rows = [];
  for (const n of cluster.nodes) {
    const held = n.keeper?.jobs?.[jobId];
    if (!held) continue;
    rows.push(el("tr", {}, el("td", {}, n.name ?? n.node_id.slice(0, 12)),
      el("td", {}, held.committed.map(([g, s]) => `${g}:${s}`).join(", ") || "none committed"),
      el("td", { class: "num" }, held.shards), el("td", { class: "num" }, fmtBytes(held.bytes))));
  }
  replaceRows(document.querySelector("#snapshots tbody"), rows, "None held.", 4);
}

function renderEvent(ev) {
  const list = document.getElementById("events");
  list.prepend(el("li", { "data-kind": ev.kind },
    el("span", { class: "muted" }, new Date(ev.ts * 1000).toLocaleTimeString(), " "),
    el("span", { class: "kind" }, ev.kind), " ", ev.message));
}

// ------------------------------------------------------------------ the metrics and log streams
let drawTimer = null;

function drawSoon() {
  drawTimer ??= setTimeout(() => {
    drawTimer = null;
    drawCharts();
    renderMarkers();
    if (S.job) renderJob();
    const pre = document.getElementById("logs");
    const atEnd = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 4;
    pre.textContent = S.logs.join("\n") || "(no log lines yet)";
    if (atEnd) pre.scrollTop = pre.scrollHeight;
  }, DRAW_MS);
}

// One EventSource on a follow stream: `url()` names where to (re)start from what is shown; the
// browser itself reconnects after a dropped connection (the server resumes after Last-Event-ID).
// Closed at the stream's `end`, and while the tab is hidden: over HTTP/1.1 a browser keeps at
// most six connections to one server, and each open job page holds three.
function followStream(url, eventName, onItem) {
  let es = null;
  let ended = false;
  const open = () => {
    if (es || ended || document.visibilityState !== "visible") return;
    es = new EventSource(url());
    es.addEventListener(eventName, (m) => { onItem(JSON.parse(m.data)); drawSoon(); });
    es.addEventListener("end", () => { ended = true; close(); });
    es.addEventListener("error", () => {
      if (es?.readyState !== EventSource.CLOSED) return; // reconnecting by itself
      // Refused (a 401 or 404 has no event stream): api() sends an ended session to the login page.
      close();
      api(base).then(() => setTimeout(open, 2000), (err) => showError(document.getElementById("job-facts"), err));
    });
  };
  const close = () => { es?.close(); es = null; };
  document.addEventListener("visibilitychange", () => (document.visibilityState === "visible" ? open() : close()));
  open();
}

function followMetrics() {
  followStream(() => `${base}/metrics?follow=true&poll_s=${POLL_S}&after_step=${S.lastStep}`, "metrics", (r) => {
    if (r.step > S.lastStep) { S.rows.push(r); S.lastStep = r.step; }
  });
}

function followLogs() {
  followStream(() => `${base}/logs?follow=true&poll_s=${POLL_S}&tail=${LOG_KEEP}&after=${S.logAfter}`, "log", (l) => {
    S.logAfter = l.id;
    S.logs.push(l.line);
    if (S.logs.length > LOG_KEEP) S.logs.splice(0, S.logs.length - LOG_KEEP);
  });
}

// ------------------------------------------------------------------ the event stream
function onEvents(batch) {
  for (const ev of batch) {
    S.events.push(ev);
    S.lastEventId = Math.max(S.lastEventId, ev.id);
    renderEvent(ev);
    // Only what a user waits for is read out; the list itself stays quiet.
    if (RECOVERY_KINDS.has(ev.kind) || ev.kind === "failure_detected" || ev.kind === "status") announce(`${ev.kind}: ${ev.message}`);
  }
  renderMarkers();
  renderRecoveries();
  drawCharts();
  const kinds = new Set(batch.map((e) => e.kind));
  const work = [];
  if ([...kinds].some((k) => REFRESH_ON.has(k))) work.push(refreshJob());
  if (kinds.has("checkpointed")) work.push(refreshCheckpoints());
  if (kinds.has("generation") || kinds.has("restored") || kinds.has("released")) work.push(refreshSnapshots());
  Promise.all(work).catch(() => {});
}

// Parses the text/event-stream answer ("id:", "event:", "data:" lines; a blank line ends one).
async function follow() {
  const live = document.getElementById("live");
  while (!S.ended) {
    try {
      const resp = await fetch(`${base}/events?follow=true&after=${S.lastEventId}`, {
        headers: { Accept: "text/event-stream" }, credentials: "same-origin",
      });
      if (resp.status === 401) { location.assign(`/ui/login?next=${encodeURIComponent(location.pathname)}`); return; }
      if (!resp.ok || !resp.body) throw new Error(`event stream answered ${resp.status}`);
      S.streamOpen = true;
      live.hidden = false;
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value;
        let cut;
        const batch = [];
        while ((cut = buf.indexOf("\n\n")) >= 0) {
          const block = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          let kind = "message";
          let data = "";
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) kind = line.slice(6).trim();
            else if (line.startsWith("data:")) data += line.slice(5).trim();
          }
          if (kind === "end") S.ended = true;
          else if (data) batch.push(JSON.parse(data));
        }
        if (batch.length) onEvents(batch);
      }
    } catch (err) {
      console.warn("event stream interrupted", err);
    }
    S.streamOpen = false;
    live.hidden = true;
    if (!S.ended) await new Promise((r) => setTimeout(r, 2000));
  }
  // The job finished: its final status, checkpoints and snapshots (the other streams end by themselves).
  await Promise.all([refreshJob(), refreshCheckpoints(), refreshSnapshots()]).catch(() => {});
}

// The keepers' snapshots change every few steps without an event: re-read them while the job runs.
setInterval(() => {
  if (S.streamOpen && document.visibilityState === "visible") refreshSnapshots().catch(() => {});
}, SNAPSHOTS_MS);

// ------------------------------------------------------------------ cancel and delete
const dialog = document.getElementById("confirm");

function confirmThen(text, okLabel, action) {
  document.getElementById("confirm-text").textContent = text;
  document.getElementById("confirm-ok").textContent = okLabel;
  dialog.returnValue = "";
  dialog.addEventListener("close", async () => {
    if (dialog.returnValue !== "ok") return;
    try {
      await action();
    } catch (err) {
      showError(document.getElementById("job-reason"), err);
    }
  }, { once: true });
  dialog.showModal();
}

document.getElementById("cancel").addEventListener("click", () => confirmThen(
  `Cancel job ${S.job.name} (${jobId})? Its workers stop; checkpoints already written stay.`, "Cancel the job",
  async () => {
    S.job = await api(`${base}/cancel`, { method: "POST" });
    renderJob();
    announce("Cancellation requested.");
  }));

document.getElementById("delete").addEventListener("click", () => confirmThen(
  `Delete job ${S.job.name} (${jobId}) and its events, metrics, logs and checkpoint records? This cannot be undone.`,
  "Delete the job",
  async () => {
    await api(base, { method: "DELETE" });
    location.assign("/ui/jobs");
  }));

// ------------------------------------------------------------------ start
(async () => {
  followMetrics();
  followLogs();
  try {
    await refreshJob();
    await Promise.all([refreshCheckpoints(), refreshSnapshots().catch(() => {})]);
  } catch (err) {
    showError(document.getElementById("job-facts"), err);
  }
  follow();
})();
