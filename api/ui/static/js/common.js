// What every console page shares: the /v1 client (session cookie + CSRF header), DOM building
// without innerHTML (values from the server are always text), and number/time formats.

const csrf = document.querySelector('meta[name="csrf-token"]')?.content ?? "";
export const me = { name: document.body.dataset.user ?? "", role: document.body.dataset.role ?? "user" };
export const isAdmin = me.role === "admin";

export class ApiError extends Error {
  constructor(status, body) {
    super(body?.message ?? `HTTP ${status}`);
    this.status = status;
    this.body = body ?? {};
    this.fields = this.body.fields ?? [];
  }
}

// Every request of the console goes to a documented /v1 route (a test checks this).
export async function api(path, { method = "GET", body, contentType = "application/json" } = {}) {
  const headers = { Accept: "application/json" };
  if (method !== "GET") headers["X-CSRF-Token"] = csrf;
  if (body !== undefined) headers["Content-Type"] = contentType;
  const resp = await fetch(path, { method, headers, body, credentials: "same-origin" });
  if (resp.status === 401) {
    location.assign(`/ui/login?next=${encodeURIComponent(location.pathname + location.search)}`);
    throw new ApiError(401, { message: "your session has ended; log in again" });
  }
  if (resp.status === 204) return null;
  const data = await resp.json().catch(() => ({}));
  if (!resp.ok) throw new ApiError(resp.status, data);
  return data;
}

// el("td", {class: "num"}, "text", childNode): attributes, then children (strings become text nodes).
export function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? "" : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return node;
}

export function replaceRows(tbody, rows, emptyText, columns) {
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", { class: "empty" }, el("td", { colspan: columns }, emptyText))]));
}

export function announce(text) {
  const region = document.getElementById("announce");
  if (region) region.textContent = text;
}

export function badge(status) {
  return el("span", { class: `badge ${status}` }, status);
}

export function fmtNum(x, digits = 3) {
  if (x === null || x === undefined || Number.isNaN(x)) return "—";
  if (Math.abs(x) >= 1000) return Math.round(x).toLocaleString("en-US");
  return String(Number(Number(x).toPrecision(digits)));
}

export function fmtSecs(s) {
  if (s === null || s === undefined) return "—";
  if (s < 1) return `${(s * 1000).toFixed(0)} ms`;
  if (s < 120) return `${s.toFixed(2)} s`;
  return fmtAge(s);
}

export function fmtAge(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function ago(ts) {
  return ts ? fmtAge(Date.now() / 1000 - ts) : "—";
}

export function fmtTime(ts) {
  return ts ? new Date(ts * 1000).toLocaleString() : "—";
}

export function fmtBytes(n) {
  if (n === null || n === undefined) return "—";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  let x = Number(n);
  while (x >= 1024 && i < units.length - 1) { x /= 1024; i += 1; }
  return `${x.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function showError(container, err) {
  container.replaceChildren(el("p", { class: "error", role: "alert" }, err.message ?? String(err)));
}
