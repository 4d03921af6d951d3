// The store page: read-only statistics of the prompt-cache store, polled every few seconds.
// Reads GET /v1/store when the server has it, else the store part of GET /health; never any
// cached tokens or text.
import { api, header } from "./chat.js";

const $ = (id) => document.getElementById(id);
const COLORS = { memory: "#2a7ae2", disk: "#d9822b", redis: "#c0392b" };
const every = Math.min(60, Math.max(1, Number(new URLSearchParams(location.search).get("every")) || 5));
const samples = []; // {t, tiers: {name: hits}} taken by this page when the server keeps no history

function bytes(n) {
  if (typeof n !== "number") return "-";
  const units = ["B", "KB", "MB", "GB", "TB"];
  let i = 0;
  while (n >= 1000 && i < units.length - 1) { n /= 1000; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

const num = (v) => (typeof v === "number" ? String(v) : "-");

/** The store statistics in one shape: {tiers: [{name, bytes, budget, entries, ...}], lookups, misses, pins, history}. */
export function normalize(data, fromHealth) {
  const src = fromHealth ? data.store || {} : data;
  let tiers = Array.isArray(src.tiers) ? src.tiers : null;
  if (!tiers) {
    tiers = Object.entries(src).filter(([, v]) => v && typeof v === "object" && !Array.isArray(v))
      .map(([name, v]) => ({ name, ...v }));
  }
  return { tiers, lookups: src.lookups, misses: src.misses, pending: src.pending_writes,
    pins: Array.isArray(src.pins) ? src.pins : null, history: Array.isArray(src.history) ? src.history : null,
    requests: data.requests && typeof data.requests === "object" ? data.requests : {} };
}

function cell(row, value) {
  const td = document.createElement("td");
  if (value instanceof Node) td.appendChild(value);
  else td.textContent = value;
  row.appendChild(td);
}

function bar(used, budget) {
  const box = document.createElement("div");
  box.className = "bar";
  const fill = document.createElement("div");
  const share = budget > 0 && typeof used === "number" ? Math.min(1, used / budget) : 0;
  fill.style.width = `${(share * 100).toFixed(1)}%`;
  const label = document.createElement("span");
  label.textContent = `${bytes(used)} / ${bytes(budget)}`;
  box.append(fill, label);
  return box;
}

function renderTiers(store) {
  const body = $("tiers").querySelector("tbody");
  body.replaceChildren();
  for (const t of store.tiers) {
    const row = document.createElement("tr");
    row.dataset.tier = String(t.name);
    cell(row, String(t.name));
    cell(row, bar(t.bytes, t.budget));
    cell(row, num(t.entries));
    cell(row, num(t.pinned_entries));
    cell(row, num(t.blocks));
    cell(row, num(t.hits));
    cell(row, num(t.evicted));
    body.appendChild(row);
  }
  const rate = store.lookups > 0 ? ` (${Math.round((100 * (store.lookups - store.misses)) / store.lookups)}% found)` : "";
  $("summary").textContent = `lookups ${num(store.lookups)} · misses ${num(store.misses)}${rate} · ` +
    `pending writes ${num(store.pending)} · updated ${new Date().toLocaleTimeString()}`;
}

/** sha256 prefixes (12 hex) of this browser's conversation keys; empty where crypto.subtle is missing
 * (it needs a secure context: loopback is one, a plain-HTTP LAN address is not). */
const ENDPOINTS = { chat: "/v1/chat/completions", completion: "/v1/completions", messages: "/v1/messages",
  responses: "/v1/responses" };

/** Requests per endpoint, as the server counts them (chat completions, completions, Messages, Responses). */
function renderRequests(requests) {
  const body = $("requests").querySelector("tbody");
  body.replaceChildren();
  for (const [name, path] of Object.entries(ENDPOINTS)) {
    const row = document.createElement("tr");
    row.dataset.endpoint = name;
    cell(row, path);
    cell(row, num(requests[name] || 0));
    body.appendChild(row);
  }
}

async function ownKeys() {
  const own = new Set();
  if (!crypto.subtle) return own;
  let ids = [];
  try {
    ids = JSON.parse(localStorage.getItem("mlxcc.conversations") || "[]").map((c) => String(c.id));
  } catch { /* nothing stored */ }
  for (const id of ids) {
    const digest = new Uint8Array(await crypto.subtle.digest("SHA-256", new TextEncoder().encode(id)));
    own.add(Array.from(digest.slice(0, 6), (b) => b.toString(16).padStart(2, "0")).join(""));
  }
  return own;
}

function renderPins(pins, own) {
  const body = $("pins").querySelector("tbody");
  body.replaceChildren();
  if (!pins) {
    $("pins-summary").textContent = "this server does not list pins";
    return;
  }
  $("pins-summary").textContent = `${pins.length} pinned key(s), shown hashed`;
  for (const p of pins) {
    const row = document.createElement("tr");
    const key = String(p.key_sha256 ?? "-");
    cell(row, own.has(key) ? `${key} (this browser)` : key);
    cell(row, num(p.entries));
    cell(row, num(p.tokens));
    cell(row, bytes(p.bytes));
    cell(row, Array.isArray(p.tiers) ? p.tiers.join(", ") : "-");
    body.appendChild(row);
  }
}

/** Per tier, a list of [from, to, value] steps: the share of prompt tokens served from the tier
 * over each interval (server history), or the hits per interval (samples taken by this page). */
export function series(store) {
  const out = {};
  if (store.history && store.history.length > 1) {
    const h = store.history;
    for (let i = 1; i < h.length; i += 1) {
      const prompt = h[i].prompt_tokens - h[i - 1].prompt_tokens;
      for (const [name, v] of Object.entries(h[i].by_tier || {})) {
        const before = (h[i - 1].by_tier || {})[name] || 0;
        (out[name] ||= []).push([h[i - 1].t, h[i].t, prompt > 0 ? (v - before) / prompt : 0]);
      }
    }
    return { unit: "share of prompt tokens served from each tier", data: out, share: true };
  }
  for (let i = 1; i < samples.length; i += 1) {
    for (const [name, v] of Object.entries(samples[i].tiers)) {
      const before = samples[i - 1].tiers[name] ?? v;
      (out[name] ||= []).push([samples[i - 1].t, samples[i].t, v - before]);
    }
  }
  return { unit: `hits per ${every} s`, data: out, share: false };
}

/** A time of day, as the x axis labels it. */
function clockTime(t) {
  return new Date(t * 1000).toLocaleTimeString([], { hour: "2-digit", minute: "2-digit", second: "2-digit" });
}

function plot({ unit, data, share }) {
  const canvas = $("plot");
  const g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, left = 46, right = 14, top = 12, bottom = 44;
  g.clearRect(0, 0, W, H);
  g.strokeStyle = "#888";
  g.lineWidth = 1;
  g.beginPath();
  g.moveTo(left, top);
  g.lineTo(left, H - bottom);
  g.lineTo(W - right, H - bottom);
  g.stroke();
  const steps = Object.values(data).flat();
  $("plot-caption").textContent = steps.length ? `${unit}, over time` : `${unit}: waiting for a second sample`;
  canvas.dataset.points = String(steps.length);
  if (!steps.length) return;
  const t0 = Math.min(...steps.map((p) => p[0])), t1 = Math.max(...steps.map((p) => p[1]));
  const high = share ? 1 : Math.max(1, ...steps.map((p) => p[2]));
  const x = (t) => left + ((W - left - right) * (t - t0)) / Math.max(1e-9, t1 - t0);
  const y = (v) => H - bottom - ((H - bottom - top) * v) / high;
  g.fillStyle = "#555";
  g.font = "11px sans-serif";
  g.textAlign = "right";
  g.textBaseline = "middle";
  g.fillText(share ? "100%" : String(Math.round(high)), left - 6, y(high));
  g.fillText(share ? "0%" : "0", left - 6, y(0));
  const labels = [clockTime(t0), clockTime(t1)];
  g.textBaseline = "top";
  g.textAlign = "left";
  g.fillText(labels[0], left, H - bottom + 4);
  g.textAlign = "right";
  g.fillText(labels[1], W - right, H - bottom + 4);
  canvas.dataset.xlabels = JSON.stringify(labels);
  g.textAlign = "left";
  let legend = left;
  for (const [name, pts] of Object.entries(data)) {
    g.strokeStyle = g.fillStyle = COLORS[name] || "#333";
    g.lineWidth = 2;
    g.beginPath();  // each value holds over its interval: a step
    pts.forEach(([from, to, v], i) => {
      if (i) g.lineTo(x(from), y(v));
      else g.moveTo(x(from), y(v));
      g.lineTo(x(to), y(v));
    });
    g.stroke();
    g.fillText(name, legend, H - 16);
    legend += 70;
  }
  canvas.dataset.max = String(Math.max(...steps.map((p) => p[2])));
}

async function fetchStore() {
  const rich = await api("/v1/store");
  if (rich.ok) return normalize(await rich.json(), false);
  return normalize(await (await api("/health")).json(), true);
}

async function refresh() {
  try {
    const store = await fetchStore();
    samples.push({ t: Date.now() / 1000, tiers: Object.fromEntries(store.tiers.map((t) => [t.name, t.hits || 0])) });
    if (samples.length > 720) samples.shift();
    renderTiers(store);
    renderRequests(store.requests);
    renderPins(store.pins, store.pins ? await ownKeys() : new Set());
    plot(series(store));
    document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
  } catch (e) {
    $("summary").textContent = "the server did not answer: " + e.message;
  }
}

header();
refresh();
setInterval(refresh, every * 1000);
