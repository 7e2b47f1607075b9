// The cluster: GET /v1/cluster (nodes, free and used CPUs/GPUs, workers per job, keeper memory,
// the queue in admission order with the reason each job waits), refreshed while visible.
import { api, ago, badge, el, fmtBytes, fmtNum, replaceRows, showError } from "./common.js";

const REFRESH_MS = 4000;

function jobLink(id, name) {
  return el("a", { href: `/ui/jobs/${encodeURIComponent(id)}` }, name ?? id);
}

function used(r) {
  return `${fmtNum(r.used)} / ${fmtNum(r.total)}`;
}

function render(c, names) {
  const summary = document.getElementById("cluster-summary");
  const cpus = c.total.CPU ?? 0;
  const gpus = c.total.GPU ?? 0;
  summary.textContent = c.ray
    ? `${c.nodes.filter((n) => n.alive).length} node(s) alive · CPUs free ${fmtNum(c.free.CPU ?? 0)} of ${fmtNum(cpus)}`
      + ` · GPUs free ${fmtNum(c.free.GPU ?? 0)} of ${fmtNum(gpus)} · ${c.queue_length} job(s) queued`
    : `No Ray cluster behind this server (store only): ${fmtNum(cpus)} CPUs, ${fmtNum(gpus)} GPUs assumed · `
      + `${c.queue_length} job(s) queued`;
  const dash = document.getElementById("dashboard");
  dash.replaceChildren(c.dashboard_url
    ? el("span", {}, "Actors, logs and resources in the ",
      el("a", { href: c.dashboard_url, target: "_blank", rel: "noopener noreferrer" }, "Ray dashboard"),
      " (it asks for Ray's own token: ray get-auth-token).")
    : el("span", { class: "muted" }, "The Ray dashboard is not running for this cluster."));

  replaceRows(document.querySelector("#nodes tbody"), c.nodes.map((n) => el("tr", {},
    el("td", {}, n.name ?? n.node_id.slice(0, 12), el("div", { class: "muted" }, n.address)),
    el("td", {}, n.alive ? "alive" : "dead"),
    el("td", { class: "num" }, used(n.cpus)),
    el("td", { class: "num" }, used(n.gpus)),
    el("td", {}, Object.entries(n.workers).map(([id, k]) => el("div", {}, jobLink(id, names[id]), `: ${k}`))),
    el("td", {}, n.keeper
      ? `${fmtBytes(n.keeper.used_bytes)} of ${fmtBytes(n.keeper.limit_bytes)}`
        + (Object.keys(n.keeper.jobs).length ? ` (${Object.keys(n.keeper.jobs).length} job(s))` : "")
      : "no keeper"),
  )), "No nodes (no Ray cluster behind this server).", 6);

  replaceRows(document.querySelector("#running tbody"), c.jobs.map((j) => el("tr", {},
    el("td", {}, jobLink(j.id, j.name)), el("td", {}, j.owner), el("td", {}, badge(j.status)),
    el("td", { class: "num" }, j.dp ?? "—"),
    el("td", {}, Object.entries(j.workers_by_node).map(([node, k]) => `${node}: ${k}`).join(", ") || "—"),
  )), "No job is running.", 5);

  replaceRows(document.querySelector("#queue tbody"), c.queue.map((q) => el("tr", {},
    el("td", { class: "num" }, q.position), el("td", {}, jobLink(q.id, q.name)), el("td", {}, q.owner),
    el("td", { class: "num" }, q.priority), el("td", { class: "num" }, q.workers), el("td", {}, ago(q.submitted_at)),
    el("td", {}, q.reason ?? "not looked at yet"),
  )), c.queue_length ? "Only other users' jobs are queued." : "The queue is empty.", 7);
}

async function load() {
  try {
    const c = await api("/v1/cluster");
    const names = Object.fromEntries([...c.jobs, ...c.queue].map((j) => [j.id, j.name]));
    render(c, names);
  } catch (err) {
    showError(document.getElementById("cluster-summary"), err);
  }
}

load();
setInterval(() => { if (document.visibilityState === "visible") load(); }, REFRESH_MS);
