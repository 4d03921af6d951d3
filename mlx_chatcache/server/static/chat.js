// The chat page: conversations kept in localStorage, each pinned on the server by its own
// prompt_cache_key; replies streamed over server-sent events and rendered with markdown.js.
import { finishedLength, renderMarkdown } from "./markdown.js";

const STORE_KEY = "mlxcc.conversations";
const CURRENT_KEY = "mlxcc.current";
const API_KEY = "mlxcc.apiKey"; // sessionStorage: kept for this tab only
const SETTINGS = ["temperature", "top_p", "max_tokens", "seed", "stop"];
const $ = (id) => document.getElementById(id);

let asking = null; // the pending question for the key, shared by every request that needs it

/** Show the key form ("why" says why) and resolve once a key is entered. */
function askKey(why) {
  if (!asking) {
    asking = new Promise((resolve) => {
      const form = $("key-form");
      $("key-why").textContent = why;
      form.hidden = false;
      $("key").focus();
      form.addEventListener("submit", (event) => {
        event.preventDefault();
        const key = $("key").value.trim();
        if (!key) return;
        sessionStorage.setItem(API_KEY, key);
        $("key").value = "";
        form.hidden = true;
        asking = null;
        resolve();
      }, { once: true });
    });
  }
  return asking;
}

/** fetch() with this tab's API key; a 401 asks for the key (kept for the tab) and sends again. */
export async function api(path, options = {}) {
  for (;;) {
    const key = sessionStorage.getItem(API_KEY);
    const headers = { ...(options.headers || {}) };
    if (key) headers.Authorization = "Bearer " + key;
    const response = await fetch(path, { ...options, headers });
    if (response.status !== 401) return response;
    sessionStorage.removeItem(API_KEY);
    await askKey(key ? "The key was refused: enter it again." : "This server needs an API key.");
  }
}

/** Fill the header (model name, exposure banner); shared by both pages. Returns the model id. */
export async function header() {
  let model = null;
  try {
    const models = await (await api("/v1/models")).json();
    model = models.data[0].id;
    $("model").textContent = model;
  } catch {
    $("model").textContent = "(server not reachable)";
  }
  try {
    const ui = await (await api("/v1/ui")).json();
    if (ui.exposed && !sessionStorage.getItem(API_KEY)) {
      const banner = $("exposed");
      banner.textContent = `This page is reachable from other machines (--host ${ui.host} --ui): anyone who ` +
        "reaches it can chat and read the store statistics; there is no login.";
      banner.hidden = false;
    }
  } catch { /* an older server: no banner */ }
  return model;
}

/** 128 random bits as hex (crypto.randomUUID needs a secure context, which a plain-HTTP LAN address is not). */
export function newId() {
  const bytes = crypto.getRandomValues(new Uint8Array(16));
  return Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("");
}

function load() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE_KEY) || "[]");
    return Array.isArray(list) ? list.filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages)) : [];
  } catch {
    return [];
  }
}

const state = { conversations: [], current: null, model: null, controller: null, pending: null };

function save() {
  try {
    localStorage.setItem(STORE_KEY, JSON.stringify(state.conversations));
    if (state.current) localStorage.setItem(CURRENT_KEY, state.current.id);
  } catch {
    showError("the browser's storage for this page is full: delete old conversations to keep new ones");
  }
}

function newConversation() {
  const conv = { id: newId(), title: "New chat", system: "", settings: {}, messages: [] };
  state.conversations.unshift(conv);
  return conv;
}

function select(conv) {
  state.current = conv;
  $("system").value = conv.system || "";
  for (const name of SETTINGS) $(name).value = conv.settings?.[name] ?? "";
  save();
  renderSidebar();
  renderMessages();
}

function renderSidebar() {
  const list = $("conversations");
  list.replaceChildren();
  for (const conv of state.conversations) {
    const li = document.createElement("li");
    const open = document.createElement("button");
    open.type = "button";
    open.className = "open" + (conv === state.current ? " current" : "");
    open.textContent = conv.title || "New chat";
    open.title = "prompt_cache_key " + conv.id;
    open.dataset.id = conv.id;
    open.addEventListener("click", () => { if (!state.controller) select(conv); });
    const del = document.createElement("button");
    del.type = "button";
    del.className = "delete";
    del.textContent = "×";
    del.title = "delete this conversation from the browser";
    del.addEventListener("click", () => {
      if (state.controller) return;
      state.conversations = state.conversations.filter((c) => c !== conv);
      select(state.conversations[0] || newConversation());
    });
    li.append(open, del);
    list.appendChild(li);
  }
}

/** "prompt 87 tok · cached 40 (memory) · TTFT 0.010 s · 133 tok/s" from a usage chunk. */
export function statsLine(stats) {
  if (!stats) return "";
  const parts = [];
  if (stats.prompt_tokens != null) parts.push(`prompt ${stats.prompt_tokens} tok`);
  if (stats.cached_tokens != null) parts.push(`cached ${stats.cached_tokens}` + (stats.tier ? ` (${stats.tier})` : ""));
  if (stats.ttft_s != null) parts.push(`TTFT ${stats.ttft_s.toFixed(3)} s`);
  if (stats.tps != null) parts.push(`${Math.round(stats.tps)} tok/s`);
  if (stats.finish) parts.push(stats.finish);
  return parts.join(" · ");
}

function messageNode(message) {
  const box = document.createElement("div");
  box.className = "message " + message.role;
  const who = document.createElement("div");
  who.className = "role";
  who.textContent = message.role + (message.stopped ? " (stopped)" : "") +
    (message.cut ? " (cut off: the connection was lost)" : "");
  const body = document.createElement("div");
  body.className = "body";
  body.appendChild(renderMarkdown(message.content));
  box.append(who, body);
  if (message.stats) {
    const line = document.createElement("div");
    line.className = "stats";
    line.textContent = statsLine(message.stats);
    box.appendChild(line);
  }
  return box;
}

function renderMessages() {
  const list = $("messages");
  list.replaceChildren(...state.current.messages.map(messageNode));
  list.scrollTop = list.scrollHeight;
}

function showError(text) {
  const line = document.createElement("div");
  line.className = "error";
  line.textContent = text;
  $("messages").appendChild(line);
}

function readSettings(conv) {
  conv.system = $("system").value;
  conv.settings = {};
  for (const name of SETTINGS) if ($(name).value !== "") conv.settings[name] = $(name).value;
}

function requestBody(conv) {
  const messages = [];
  if (conv.system.trim()) messages.push({ role: "system", content: conv.system });
  for (const m of conv.messages) messages.push({ role: m.role, content: m.content });
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true },
    prompt_cache_key: conv.id };
  const s = conv.settings;
  for (const name of ["temperature", "top_p"]) if (s[name] != null) body[name] = Number(s[name]);
  for (const name of ["max_tokens", "seed"]) if (s[name] != null) body[name] = parseInt(s[name], 10);
  if (s.stop) body.stop = s.stop.split(",").map((x) => x.trim()).filter(Boolean);
  return body;
}

/** Yield the JSON payloads of a server-sent-event stream (chunks may split anywhere). */
export async function* sseEvents(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    buffer += decoder.decode(value || new Uint8Array(), { stream: !done });
    buffer = buffer.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
    if (done) return;
  }
}

async function errorText(response) {
  try {
    const body = await response.json();
    return `error ${response.status}: ${body.error.message}`;
  } catch {
    return `error ${response.status} from the server`;
  }
}

function stats(usage, obj, startedAt, firstAt) {
  const timing = obj.mlxcc_timing || {};
  const cache = obj.mlxcc_cache || {};
  const out = { prompt_tokens: usage.prompt_tokens, completion_tokens: usage.completion_tokens,
    cached_tokens: usage.prompt_tokens_details?.cached_tokens ?? null, tier: cache.tier || null };
  if (timing.first_token_s != null) out.ttft_s = (timing.queued_s || 0) + timing.first_token_s;
  else if (firstAt) out.ttft_s = (firstAt - startedAt) / 1000;
  const decode = timing.total_s != null && timing.first_token_s != null ? timing.total_s - timing.first_token_s : null;
  if (decode > 0 && usage.completion_tokens > 1) out.tps = (usage.completion_tokens - 1) / decode;
  return out;
}

async function send(text) {
  const conv = state.current;
  readSettings(conv);
  const user = { role: "user", content: text };
  const reply = { role: "assistant", content: "" };
  conv.messages.push(user);
  if (conv.title === "New chat") conv.title = text.slice(0, 40);
  const body = requestBody(conv);
  conv.messages.push(reply);
  renderSidebar();
  renderMessages();
  const node = $("messages").lastElementChild.querySelector(".body");
  let frame = 0;
  let done = 0; // reply.content[:done] is rendered for good
  let tail = []; // the nodes of the rest, replaced on every paint
  const paint = () => {
    frame = 0;
    for (const n of tail) n.remove();
    const cut = finishedLength(reply.content);
    if (cut > done) {
      node.appendChild(renderMarkdown(reply.content.slice(done, cut)));
      done = cut;
    }
    const rest = renderMarkdown(reply.content.slice(done));
    tail = [...rest.childNodes];
    node.appendChild(rest);
  };
  const controller = new AbortController();
  busy(controller);
  const startedAt = performance.now();
  let firstAt = 0;
  let failure = null;
  try {
    const response = await api("/v1/chat/completions", { method: "POST", body: JSON.stringify(body),
      headers: { "Content-Type": "application/json" }, signal: controller.signal });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const obj of sseEvents(response.body.getReader())) {
      if (obj.error) throw new Error("error: " + obj.error.message);
      const choice = obj.choices?.[0];
      if (choice?.delta?.content) {
        firstAt = firstAt || performance.now();
        reply.content += choice.delta.content;
        frame = frame || requestAnimationFrame(paint);
      }
      if (choice?.finish_reason) reply.finish = choice.finish_reason;
      if (obj.usage) reply.stats = { ...stats(obj.usage, obj, startedAt, firstAt), finish: reply.finish };
    }
    if (!reply.finish) throw new TypeError("the stream ended before the reply did");
  } catch (e) {
    if (controller.signal.aborted) reply.stopped = true;
    else if (e.name !== "TypeError") failure = e.message;
    else failure = reply.content ? "the connection to the server was lost" : "network error: the server did not answer";
  } finally {
    if (frame) cancelAnimationFrame(frame);
    busy(null);
  }
  if (failure && reply.content) {
    // the connection died mid-reply: the message and the part received stay, marked, as Stop keeps them
    reply.cut = true;
    delete reply.stats;
    renderMessages();
    showError(`${failure}: the reply is cut off (the part received is kept)`);
  } else if (failure) {
    conv.messages.splice(conv.messages.indexOf(user), 2);
    renderMessages();
    showError(failure);
    $("input").value = text;
  } else {
    renderMessages();
  }
  save();
}

function busy(controller) {
  state.controller = controller;
  $("send").disabled = !!controller;
  $("stop-button").disabled = !controller;
}

async function main() {
  state.conversations = load();
  const current = localStorage.getItem(CURRENT_KEY);
  select(state.conversations.find((c) => c.id === current) || state.conversations[0] || newConversation());
  $("new").addEventListener("click", () => { if (!state.controller) select(newConversation()); });
  $("stop-button").addEventListener("click", () => state.controller?.abort());
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("input").value;
    if (!text.trim() || state.controller) return;
    if (!state.model) return showError("the server did not answer GET /v1/models: reload the page when it runs");
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  for (const name of ["system", ...SETTINGS]) $(name).addEventListener("change", () => { readSettings(state.current); save(); });
  state.model = await header();
  document.body.dataset.ready = "1";
}

if ($("messages")) main();
