// The chat page of `flashformer serve`: a client of the server's own /v1 API, as any other.
// Conversations and settings live in this browser's localStorage (per server address); the
// answer streams in over server-sent events, and Stop aborts the fetch, which makes the
// server cancel the request and free its KV blocks. Model text reaches the DOM only through
// markdown.js (text nodes), never as HTML.

import { render } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = {
  conversations: "flashformer.conversations",
  current: "flashformer.current",
  settings: "flashformer.settings",
  key: "flashformer.apiKey",
};
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed", "markdown"];

let config = { mode: "chat", api_key_required: false };
let model = null; // the served model's id, from /v1/models
let conversations = read(STORE.conversations, []); // [{id, title, messages: [{role, content, meta}]}]
let current = localStorage.getItem(STORE.current);
let streaming = null; // the AbortController of the answer streaming in
let leaving = false; // the page is being closed or reloaded

// an answer saved while it streamed, in a page since closed: its request ended with that page
for (const message of conversations.flatMap((c) => c.messages)) {
  if (message.meta?.state === "streaming") message.meta.state = "stopped";
}

function read(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function save() {
  localStorage.setItem(STORE.conversations, JSON.stringify(conversations));
  if (current) localStorage.setItem(STORE.current, current);
  else localStorage.removeItem(STORE.current);
}

// ---- the API ----

function headers() {
  const key = localStorage.getItem(STORE.key);
  return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` } : { "Content-Type": "application/json" };
}

/** fetch `path` (GET, or POST of `body` as JSON); an error status becomes an Error with the server's message. */
async function api(path, body, signal) {
  const init = body === undefined ? { headers: headers() } : { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
  const response = await fetch(path, init);
  if (response.status === 401) {
    askKey("The server refused this key; enter it again.");
    throw new Error("incorrect API key");
  }
  if (!response.ok) {
    let message = `HTTP ${response.status}`;
    try {
      message = (await response.json()).error.message;
    } catch {}
    throw new Error(message);
  }
  return response;
}

function askKey(message) {
  $("key-error").textContent = message || "";
  if (!$("key-dialog").open) $("key-dialog").showModal();
  $("api-key").focus();
}

async function connect() {
  try {
    model = (await (await api("/v1/models")).json()).data[0].id;
    $("model-name").textContent = model;
    status("");
  } catch (error) {
    status(error.message);
  }
}

function status(text) {
  $(config.mode === "chat" ? "status" : "similarity-status").textContent = text;
}

// ---- settings ----

function restoreSettings() {
  const saved = read(STORE.settings, {});
  for (const name of SETTINGS) {
    if (!(name in saved)) continue;
    if ($(name).type === "checkbox") $(name).checked = saved[name];
    else $(name).value = saved[name];
  }
}

function storeSettings() {
  const values = Object.fromEntries(SETTINGS.map((n) => [n, $(n).type === "checkbox" ? $(n).checked : $(n).value]));
  localStorage.setItem(STORE.settings, JSON.stringify(values));
}

/** The request's sampling fields; an empty box is left out (the server's default). */
function sampling() {
  const fields = {};
  for (const name of ["temperature", "top_p", "max_tokens", "seed"]) {
    if ($(name).value.trim() !== "") fields[name] = Number($(name).value);
  }
  return fields;
}

// ---- conversations ----

function conversation() {
  return conversations.find((c) => c.id === current) || null;
}

function select(id) {
  current = id;
  save();
  showConversations();
  showMessages();
}

function newConversation() {
  const chat = { id: Date.now().toString(36) + Math.random().toString(36).slice(2, 8), title: "New conversation", messages: [] };
  conversations.unshift(chat);
  select(chat.id);
  return chat;
}

function showConversations() {
  const list = $("conversations");
  list.replaceChildren();
  for (const chat of conversations) {
    const item = list.appendChild(document.createElement("li"));
    item.dataset.id = chat.id;
    item.classList.toggle("current", chat.id === current);
    const title = item.appendChild(button(chat.title, () => select(chat.id), "title"));
    title.title = chat.title;
    item.appendChild(button("Rename", () => rename(chat, item, title), "small rename"));
    item.appendChild(button("Delete", () => remove(chat), "small delete"));
  }
}

function rename(chat, item, title) {
  const input = document.createElement("input");
  input.className = "rename-input";
  input.value = chat.title;
  let done = false;
  const commit = () => {
    if (done) return;
    done = true;
    chat.title = input.value.trim() || chat.title;
    save();
    showConversations();
  };
  input.addEventListener("keydown", (event) => {
    if (event.key === "Enter") commit();
    if (event.key === "Escape") {
      done = true;
      showConversations();
    }
  });
  input.addEventListener("blur", commit);
  title.replaceWith(input);
  input.focus();
  input.select();
}

function remove(chat) {
  if (streaming && chat.id === current) streaming.abort();
  conversations = conversations.filter((c) => c !== chat);
  if (current === chat.id) current = conversations[0]?.id || null;
  save();
  showConversations();
  showMessages();
}

function button(text, onclick, className) {
  const element = document.createElement("button");
  element.type = "button";
  element.textContent = text;
  element.className = className || "";
  element.addEventListener("click", onclick);
  return element;
}

// ---- messages ----

function showMessages() {
  const view = $("messages");
  view.replaceChildren();
  const chat = conversation();
  if (!chat) return;
  chat.messages.forEach((message, index) => view.appendChild(messageView(chat, message, index)));
  view.scrollTop = view.scrollHeight;
}

function messageView(chat, message, index) {
  const view = document.createElement("div");
  view.className = `message ${message.role}`;
  view.dataset.index = index;
  view.appendChild(document.createElement("div")).className = "role";
  view.firstChild.textContent = message.role === "user" ? "You" : model || "assistant";
  view.appendChild(document.createElement("div")).className = "content";
  view.appendChild(document.createElement("div")).className = "meta";
  const actions = view.appendChild(document.createElement("div"));
  actions.className = "actions";
  if (message.role === "user") actions.appendChild(button("Edit", () => edit(chat, index, view), "edit"));
  else if (index === chat.messages.length - 1) actions.appendChild(button("Regenerate", () => regenerate(chat, index), "regenerate"));
  draw(view, message);
  return view;
}

/** A message's text and, for an answer, its state and speed (also as data- attributes, for tests). */
function draw(view, message) {
  const meta = message.meta || {};
  render(meta.state === "error" ? meta.error : message.content, view.querySelector(".content"), $("markdown").checked);
  view.classList.toggle("error", meta.state === "error");
  if (message.role !== "assistant") return;
  view.dataset.state = meta.state || "";
  const parts = [];
  if (meta.tokens !== undefined) parts.push(`${meta.tokens} tokens`);
  if (meta.tokensPerSecond) parts.push(`${meta.tokensPerSecond.toFixed(1)} tokens/s`);
  if (meta.firstTokenMs != null) {
    parts.push(`first token after ${Math.round(meta.firstTokenMs)} ms`);
    view.dataset.firstTokenMs = meta.firstTokenMs.toFixed(1);
  }
  if (meta.state === "stopped") parts.push("stopped");
  if (meta.finish === "length") parts.push("cut at max_tokens");
  view.querySelector(".meta").textContent = parts.join(" · ");
}

function edit(chat, index, view) {
  if (streaming) return;
  const box = document.createElement("textarea");
  box.className = "edit-box";
  box.value = chat.messages[index].content;
  const content = view.querySelector(".content");
  content.replaceChildren(box);
  const actions = view.querySelector(".actions");
  actions.replaceChildren(
    button("Send", () => {
      chat.messages = chat.messages.slice(0, index);
      chat.messages.push({ role: "user", content: box.value });
      ask(chat, performance.now());
    }, "resend"),
    button("Cancel", showMessages, "cancel"),
  );
  box.focus();
}

function regenerate(chat, index) {
  if (streaming) return;
  chat.messages = chat.messages.slice(0, index);
  ask(chat, performance.now());
}

function send(pressed) {
  const text = $("prompt").value;
  if (streaming || !text.trim()) return;
  const chat = conversation() || newConversation();
  if (!chat.messages.length) chat.title = text.trim().slice(0, 40);
  chat.messages.push({ role: "user", content: text });
  $("prompt").value = "";
  ask(chat, pressed);
  showConversations();
}

/** Stream the answer to `chat`'s messages into a new assistant message; `pressed`: when the user asked (performance.now()). */
async function ask(chat, pressed) {
  const system = $("system").value.trim() ? [{ role: "system", content: $("system").value }] : [];
  const history = chat.messages.filter((m) => m.meta?.state !== "error").map(({ role, content }) => ({ role, content }));
  const answer = { role: "assistant", content: "", meta: { state: "streaming" } };
  chat.messages.push(answer);
  streaming = new AbortController();
  let first = null;
  let pieces = 0;
  let usage = null;
  const update = () => {
    const seconds = (performance.now() - first) / 1000;
    answer.meta.tokens = usage ? usage.completion_tokens : pieces;
    answer.meta.firstTokenMs = first === null ? null : first - pressed;
    answer.meta.tokensPerSecond = first !== null && answer.meta.tokens > 1 ? (answer.meta.tokens - 1) / seconds : null;
    if (chat.id === current) draw($("messages").lastElementChild, answer); // redrawn views included
  };
  try {
    if (!model) await connect();
    if (!model) throw new Error("no model: the server did not answer /v1/models");
    const body = { model, messages: [...system, ...history], stream: true, stream_options: { include_usage: true }, ...sampling() };
    const asked = api("/v1/chat/completions", body, streaming.signal); // sent before the page redraws
    save();
    showMessages();
    composing(true);
    const response = await asked;
    const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += value;
      const events = buffer.split("\n\n");
      buffer = events.pop();
      for (const event of events) {
        const data = event.replace(/^data: ?/, "");
        if (data === "[DONE]") continue;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        const choice = chunk.choices?.[0];
        if (choice?.finish_reason) answer.meta.finish = choice.finish_reason;
        if (choice?.delta?.content) {
          first ??= performance.now();
          pieces += 1;
          answer.content += choice.delta.content;
          update();
        }
      }
    }
    answer.meta.state = "done";
  } catch (error) {
    if (error.name === "AbortError" || leaving) answer.meta.state = "stopped";
    else Object.assign(answer.meta, { state: "error", error: error.message });
  }
  streaming = null;
  composing(false);
  update();
  save();
  if (chat.id === current) showMessages(); // the Regenerate button moves to this answer
}

function composing(busy) {
  $("send").disabled = busy;
  $("stop").hidden = !busy;
  for (const element of document.querySelectorAll(".message .actions button")) element.disabled = busy;
}

// ---- an encoder: two texts' cosine ----

async function compare() {
  status("");
  try {
    if (!model) await connect();
    const reply = await (await api("/v1/embeddings", { model, input: [$("text-a").value, $("text-b").value] })).json();
    const [u, v] = reply.data.map((item) => item.embedding);
    let dot = 0, uu = 0, vv = 0;
    for (let i = 0; i < u.length; i++) {
      dot += u[i] * v[i];
      uu += u[i] * u[i];
      vv += v[i] * v[i];
    }
    const cosine = dot / Math.sqrt(uu * vv);
    $("cosine").textContent = cosine.toFixed(4);
    $("cosine").dataset.value = String(cosine);
  } catch (error) {
    status(error.message);
  }
}

// ---- start ----

async function start() {
  config = await (await fetch("/webui/config.json")).json();
  document.body.classList.add(config.mode);
  $("chat").hidden = config.mode !== "chat";
  $("similarity").hidden = config.mode !== "embeddings";
  restoreSettings();
  for (const name of SETTINGS) $(name).addEventListener("change", storeSettings);
  $("markdown").addEventListener("change", showMessages);
  $("new-chat").addEventListener("click", () => (conversation()?.messages.length === 0 ? null : newConversation()));
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send(performance.now());
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      send(performance.now());
    }
  });
  $("stop").addEventListener("click", () => streaming?.abort());
  $("compare").addEventListener("click", compare);
  // leaving the page ends its fetch: an answer still streaming is kept as stopped, with what came
  window.addEventListener("beforeunload", () => (leaving = true));
  window.addEventListener("pagehide", save);
  $("key-form").addEventListener("submit", () => {
    localStorage.setItem(STORE.key, $("api-key").value);
    $("api-key").value = "";
    connect();
  });
  showConversations();
  showMessages();
  if (config.api_key_required && !localStorage.getItem(STORE.key)) askKey();
  else await connect();
  document.body.dataset.ready = "true";
}

start();
