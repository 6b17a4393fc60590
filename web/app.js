// specserve chat demo: talks the WebSocket protocol of /v1/ws (see docs/server.md).
// Model output is only ever inserted as text (textContent / text nodes), never as HTML.
"use strict";

const SETTINGS_KEY = "specserve.settings";
const API_KEY_KEY = "specserve.apiKey"; // sessionStorage: the key does not outlive the tab
const DEFAULTS = { systemPrompt: "", temperature: 0.7, topP: 0.95, maxTokens: 256 };

const $ = (id) => document.getElementById(id);
const ui = {
  model: $("model"), conn: $("conn"), messages: $("messages"), error: $("error"), form: $("composer"),
  prompt: $("prompt"), send: $("send"), stop: $("stop"), clear: $("clear"),
  systemPrompt: $("system-prompt"), temperature: $("temperature"), temperatureValue: $("temperature-value"),
  topP: $("top-p"), topPValue: $("top-p-value"), maxTokens: $("max-tokens"), apiKey: $("api-key"),
  reset: $("reset-settings"),
  ttft: $("stat-ttft"), tps: $("stat-tps"), tokens: $("stat-tokens"), cached: $("stat-cached"),
  accept: $("stat-accept"),
};

// -- settings (localStorage) ---------------------------------------------------------------------
function loadSettings() {
  try {
    return { ...DEFAULTS, ...JSON.parse(localStorage.getItem(SETTINGS_KEY) || "{}") };
  } catch {
    return { ...DEFAULTS };
  }
}

function readSettingsForm() {
  const num = (el, fallback) => (Number.isFinite(parseFloat(el.value)) ? parseFloat(el.value) : fallback);
  return {
    systemPrompt: ui.systemPrompt.value,
    temperature: num(ui.temperature, DEFAULTS.temperature),
    topP: num(ui.topP, DEFAULTS.topP),
    maxTokens: Math.max(1, Math.round(num(ui.maxTokens, DEFAULTS.maxTokens))),
  };
}

function showSettings(s) {
  ui.systemPrompt.value = s.systemPrompt;
  ui.temperature.value = s.temperature;
  ui.topP.value = s.topP;
  ui.maxTokens.value = s.maxTokens;
  ui.temperatureValue.textContent = Number(s.temperature).toFixed(2);
  ui.topPValue.textContent = Number(s.topP).toFixed(2);
}

function saveSettings() {
  const s = readSettingsForm();
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(s));
  showSettings(s);
  return s;
}

// -- conversation --------------------------------------------------------------------------------
const history = []; // {role, content} of finished turns
let current = null; // the response being streamed: {eventId, id, el, text, tokens, sentAt, firstAt}
let eventCounter = 0;

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = `msg ${role}`;
  const who = document.createElement("div");
  who.className = "who";
  who.textContent = role;
  const body = document.createElement("div");
  body.className = "body";
  body.textContent = text;
  el.append(who, body);
  ui.messages.append(el);
  ui.messages.scrollTop = ui.messages.scrollHeight;
  return body;
}

function showError(message) {
  ui.error.textContent = message;
  ui.error.hidden = !message;
}

function setBusy(busy) {
  ui.send.disabled = busy || !socketReady();
  ui.stop.disabled = !busy;
}

function fmt(value, digits, unit = "") {
  return value === null || value === undefined || Number.isNaN(value) ? "–" : `${value.toFixed(digits)}${unit}`;
}

function send() {
  const text = ui.prompt.value.trim();
  if (!text || current || !socketReady()) return;
  const s = saveSettings();
  showError("");
  addMessage("user", text);
  history.push({ role: "user", content: text });
  ui.prompt.value = "";
  const messages = s.systemPrompt.trim() ? [{ role: "system", content: s.systemPrompt.trim() }] : [];
  current = { eventId: `web-${++eventCounter}`, id: null, el: addMessage("assistant", ""), text: "", tokens: 0,
              sentAt: performance.now(), firstAt: null };
  current.el.parentElement.classList.add("streaming");
  for (const k of ["ttft", "tps", "tokens", "cached", "accept"]) ui[k].textContent = "–";
  socket.send(JSON.stringify({
    type: "response.create", event_id: current.eventId,
    response: { messages: messages.concat(history), max_output_tokens: s.maxTokens, temperature: s.temperature,
                top_p: s.topP },
  }));
  setBusy(true);
}

function stop() {
  if (current && current.id) socket.send(JSON.stringify({ type: "response.cancel", response_id: current.id }));
}

function onDelta(ev) {
  if (!current || ev.response_id !== current.id || ev.output_index !== 0) return;
  const now = performance.now();
  if (current.firstAt === null && ev.token_ids.length) {
    current.firstAt = now;
    ui.ttft.textContent = fmt(now - current.sentAt, 0, " ms");
  }
  current.tokens += ev.token_ids.length;
  current.text += ev.delta;
  current.el.append(document.createTextNode(ev.delta));
  ui.messages.scrollTop = ui.messages.scrollHeight;
  const seconds = (now - current.firstAt) / 1000;
  if (seconds > 0) ui.tps.textContent = fmt((current.tokens - 1) / seconds, 1);
  ui.tokens.textContent = String(current.tokens);
}

function onDone(r) {
  if (!current || r.id !== current.id) return;
  const text = r.output.length ? r.output[0].text : current.text;
  current.el.textContent = text; // the server's final text (identical to the streamed deltas)
  current.el.parentElement.classList.remove("streaming");
  current.el.parentElement.dataset.status = r.status;
  if (r.status === "cancelled") current.el.parentElement.classList.add("stopped");
  if (text) history.push({ role: "assistant", content: text });
  const m = r.metrics || {};
  if (m.ttft_ms !== null && m.ttft_ms !== undefined) ui.ttft.textContent = fmt(m.ttft_ms, 0, " ms");
  if (m.tokens_per_s) ui.tps.textContent = fmt(m.tokens_per_s, 1);
  ui.tokens.textContent = String(r.usage.output_tokens);
  ui.cached.textContent = String(r.usage.cached_tokens);
  const spec = m.spec || {};
  ui.accept.textContent = spec.draft_tokens ? fmt((100 * spec.accepted) / spec.draft_tokens, 0, "%") : "–";
  if (r.status === "failed" && r.error) showError(r.error.message);
  current = null;
  setBusy(false);
  ui.prompt.focus();
}

function onError(err) {
  showError(`${err.code}: ${err.message}`);
  if (current && (err.event_id === current.eventId || err.response_id === current.id)) {
    current.el.parentElement.remove();
    history.pop(); // the user turn that failed
    current = null;
    setBusy(false);
  }
}

// -- socket --------------------------------------------------------------------------------------
let socket = null;
let retryMs = 500;

function socketReady() {
  return socket !== null && socket.readyState === WebSocket.OPEN && ui.conn.dataset.state === "ready";
}

function setConn(state, label) {
  ui.conn.dataset.state = state;
  ui.conn.textContent = label;
  setBusy(current !== null);
}

function connect() {
  const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/ws`;
  socket = new WebSocket(url);
  setConn("connecting", "connecting");
  socket.addEventListener("open", () => {
    const key = sessionStorage.getItem(API_KEY_KEY);
    if (key) socket.send(JSON.stringify({ type: "session.auth", api_key: key }));
  });
  socket.addEventListener("message", (msg) => {
    let ev;
    try {
      ev = JSON.parse(msg.data);
    } catch {
      return;
    }
    if (ev.type === "session.created") {
      retryMs = 500;
      ui.model.textContent = `${ev.model} · ${ev.max_model_len} tokens` +
        (ev.speculative ? ` · speculative (${ev.speculative.method}, k=${ev.speculative.num_speculative_tokens})` : "");
      setConn("ready", "connected");
    } else if (ev.type === "response.created") {
      if (current && ev.event_id === current.eventId) current.id = ev.response.id;
    } else if (ev.type === "response.output_text.delta") {
      onDelta(ev);
    } else if (ev.type === "response.done") {
      onDone(ev.response);
    } else if (ev.type === "error") {
      onError(ev.error);
    }
  });
  socket.addEventListener("close", () => {
    if (current) {
      current.el.parentElement.classList.remove("streaming");
      current = null;
    }
    setConn("closed", "reconnecting…");
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 10000);
  });
}

// -- wiring --------------------------------------------------------------------------------------
function init() {
  showSettings(loadSettings());
  ui.apiKey.value = sessionStorage.getItem(API_KEY_KEY) || "";
  for (const el of [ui.systemPrompt, ui.temperature, ui.topP, ui.maxTokens]) {
    el.addEventListener("input", saveSettings);
    el.addEventListener("change", saveSettings);
  }
  ui.apiKey.addEventListener("change", () => {
    if (ui.apiKey.value) sessionStorage.setItem(API_KEY_KEY, ui.apiKey.value);
    else sessionStorage.removeItem(API_KEY_KEY);
    if (socket) socket.close(); // reconnect with the new key
  });
  ui.reset.addEventListener("click", () => {
    localStorage.removeItem(SETTINGS_KEY);
    showSettings(loadSettings());
  });
  ui.form.addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  ui.prompt.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  ui.stop.addEventListener("click", stop);
  ui.clear.addEventListener("click", () => {
    stop();
    history.length = 0;
    ui.messages.replaceChildren();
    showError("");
  });
  connect();
}

init();
