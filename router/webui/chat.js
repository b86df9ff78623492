// The chat playground: one conversation, kept in localStorage, sent to
// /v1/chat/completions and streamed back. A reply has up to three parts, each
// shown apart: the model's reasoning (`delta.reasoning_content`), its answer
// (`delta.content`) and its tool calls (`delta.tool_calls`, pieced together
// by index). Stop aborts the fetch; the server cancels a request whose client
// went away.

import { errorMessage, request } from "./api.js";
import { element } from "./dom.js";
import { sseEvents } from "./sse.js";

const STORE = "sluice.chat";
const DEFAULT_SETTINGS = { system: "", temperature: "0.7", top_p: "1", max_tokens: "512", seed: "", stop: "", extra: "" };

// Messages: {role: "user", content} or {role: "assistant", content, reasoning,
// toolCalls: [{id, name, arguments}], status: streaming|done|stopped|error,
// error, stats}.
function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) ?? "{}");
    return { messages: saved.messages ?? [], settings: { ...DEFAULT_SETTINGS, ...saved.settings } };
  } catch {
    return { messages: [], settings: { ...DEFAULT_SETTINGS } };
  }
}

export class Chat {
  constructor(root) {
    this.root = root;
    this.list = root.querySelector("#messages");
    this.form = root.querySelector("#composer");
    this.prompt = root.querySelector("#prompt");
    this.sendButton = root.querySelector("#send");
    this.stopButton = root.querySelector("#stop-generation");
    this.status = root.querySelector("#chat-status");
    this.settingsForm = root.querySelector("#settings-form");
    this.extraError = root.querySelector("#extra-error");
    this.views = new WeakMap(); // message -> its elements
    this.controller = null;
    Object.assign(this, load());
    // A reply that was streaming when the page closed ended there.
    for (const m of this.messages) if (m.status === "streaming") m.status = "stopped";
    this.fillSettings();
    // On a phone the settings would push the conversation off the screen.
    if (matchMedia("(max-width: 720px)").matches) root.querySelector("#settings").open = false;
    this.renderAll();
    this.listen();
  }

  listen() {
    this.form.addEventListener("submit", (event) => {
      event.preventDefault();
      this.send();
    });
    this.prompt.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
        event.preventDefault();
        this.send();
      } else if (event.key === "Escape") {
        this.stop();
      }
    });
    this.stopButton.addEventListener("click", () => this.stop());
    // Enter in a settings field would submit (and reload) the page.
    this.settingsForm.addEventListener("submit", (event) => event.preventDefault());
    this.settingsForm.addEventListener("input", () => {
      this.settings = Object.fromEntries(new FormData(this.settingsForm));
      this.parseExtra();
      this.save();
    });
    this.root.querySelector("#new-chat").addEventListener("click", () => {
      this.stop();
      this.messages = [];
      this.save();
      this.renderAll();
      this.prompt.focus();
    });
  }

  fillSettings() {
    for (const [name, value] of Object.entries(this.settings)) {
      const field = this.settingsForm.elements.namedItem(name);
      if (field) field.value = value;
    }
  }

  save() {
    localStorage.setItem(STORE, JSON.stringify({ messages: this.messages, settings: this.settings }));
  }

  // The extra fields as an object, or null (with the reason shown) when they
  // are not a JSON object.
  parseExtra() {
    const text = this.settings.extra.trim();
    let extra = {};
    let problem = "";
    if (text) {
      try {
        extra = JSON.parse(text);
        if (extra === null || typeof extra !== "object" || Array.isArray(extra)) problem = "Extra request fields must be a JSON object.";
      } catch (error) {
        problem = `Extra request fields are not valid JSON: ${error.message}`;
      }
    }
    this.extraError.textContent = problem;
    this.settingsForm.elements.namedItem("extra").setAttribute("aria-invalid", String(Boolean(problem)));
    return problem ? null : extra;
  }

  requestBody(extra) {
    const s = this.settings;
    const history = this.messages
      .filter((m) => m.role === "user" || m.content || m.toolCalls?.length)
      .map((m) => {
        if (m.role === "user" || !m.toolCalls?.length) return { role: m.role, content: m.content };
        const calls = m.toolCalls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
        return { role: "assistant", content: m.content, tool_calls: calls };
      });
    const body = {
      messages: s.system.trim() ? [{ role: "system", content: s.system }, ...history] : history,
      stream: true,
      stream_options: { include_usage: true },
    };
    for (const key of ["temperature", "top_p", "max_tokens", "seed"]) {
      if (s[key] !== "") body[key] = Number(s[key]);
    }
    const stop = s.stop.split("\n").filter((line) => line !== "");
    if (stop.length) body.stop = stop;
    return { ...body, ...extra };
  }

  async send() {
    const text = this.prompt.value;
    if (this.controller || !text.trim()) return;
    const extra = this.parseExtra();
    if (extra === null) {
      this.root.querySelector("#settings").open = true;
      this.settingsForm.elements.namedItem("extra").focus();
      return;
    }
    this.prompt.value = "";
    this.messages.push({ role: "user", content: text });
    const body = this.requestBody(extra);
    const reply = { role: "assistant", content: "", reasoning: "", toolCalls: [], status: "streaming" };
    this.messages.push(reply);
    this.renderAll();
    this.save();
    this.controller = new AbortController();
    this.setBusy(true);
    try {
      await this.stream(body, reply, this.controller.signal);
      reply.status = "done";
    } catch (error) {
      if (error.name === "AbortError") {
        reply.status = "stopped";
      } else {
        reply.status = "error";
        reply.error = error.message;
      }
    }
    this.controller = null;
    this.setBusy(false);
    this.update(reply);
    this.save();
  }

  async stream(body, reply, signal) {
    const init = { method: "POST", headers: { "content-type": "application/json" }, body: JSON.stringify(body), signal };
    const response = await request("/v1/chat/completions", init, { interactive: true });
    if (!response.ok) throw new Error(await errorMessage(response));
    const started = performance.now();
    let first = null;
    let pending = false;
    for await (const chunk of sseEvents(response.body)) {
      for (const choice of chunk.choices ?? []) {
        first ??= performance.now();
        applyDelta(reply, choice.delta ?? {});
        if (choice.finish_reason) reply.finish = choice.finish_reason;
      }
      if (chunk.usage) reply.usage = chunk.usage;
      reply.stats = stats(reply.usage, started, first, performance.now());
      // One repaint per frame, however fast chunks arrive.
      if (!pending) {
        pending = true;
        requestAnimationFrame(() => {
          pending = false;
          this.update(reply);
        });
      }
    }
  }

  stop() {
    this.controller?.abort();
  }

  setBusy(busy) {
    this.sendButton.hidden = busy;
    this.stopButton.hidden = !busy;
    this.status.textContent = busy ? "Generating…" : "";
    if (!busy) this.prompt.focus();
  }

  renderAll() {
    this.list.replaceChildren(...this.messages.map((m) => this.render(m)));
  }

  render(message) {
    const item = element("li", `message ${message.role}`);
    const role = element("p", "role", message.role === "user" ? "You" : "Assistant");
    const reasoning = element("details", "reasoning");
    reasoning.open = true;
    const reasoningText = element("div", "text");
    reasoning.append(element("summary", "", "Reasoning"), reasoningText);
    const content = element("div", "content");
    const tools = element("div", "tool-calls");
    const meta = element("p", "meta");
    item.append(role, reasoning, content, tools, meta);
    this.views.set(message, { item, reasoning, reasoningText, content, tools, meta });
    this.update(message);
    return item;
  }

  update(message) {
    const view = this.views.get(message);
    if (!view) return;
    view.item.dataset.status = message.status ?? "done";
    view.item.setAttribute("aria-busy", String(message.status === "streaming"));
    view.reasoning.hidden = !message.reasoning;
    view.reasoningText.textContent = message.reasoning ?? "";
    view.content.textContent = message.content;
    view.tools.replaceChildren(...(message.toolCalls ?? []).map(renderToolCall));
    view.meta.textContent = metaText(message);
    view.meta.hidden = message.role === "user" || !view.meta.textContent;
    view.item.scrollIntoView({ block: "end" });
  }
}

// Adds one chunk's delta to the reply. Tool calls arrive in pieces: the first
// piece of call `index` names it, later pieces append to its arguments.
export function applyDelta(reply, delta) {
  if (delta.reasoning_content) reply.reasoning += delta.reasoning_content;
  if (delta.content) reply.content += delta.content;
  for (const piece of delta.tool_calls ?? []) {
    const call = (reply.toolCalls[piece.index] ??= { id: "", name: "", arguments: "" });
    if (piece.id) call.id = piece.id;
    if (piece.function?.name) call.name += piece.function.name;
    if (piece.function?.arguments) call.arguments += piece.function.arguments;
  }
}

function renderToolCall(call) {
  const title = element("p", "", "Tool call: ");
  title.append(element("code", "tool-name", call.name));
  const args = element("pre", "tool-arguments");
  try {
    args.textContent = JSON.stringify(JSON.parse(call.arguments), null, 2);
  } catch {
    args.textContent = call.arguments; // still streaming, or not JSON
  }
  const box = element("div", "tool-call");
  box.append(title, args);
  return box;
}

// Client-side timings: time to the first chunk and tokens per second after it.
function stats(usage, started, first, now) {
  const tokens = usage?.completion_tokens ?? null;
  const ttft = first === null ? null : first - started;
  const rate = tokens > 1 && first !== null && now > first ? ((tokens - 1) * 1000) / (now - first) : null;
  return { tokens, ttft, rate };
}

function metaText(message) {
  if (message.role === "user") return "";
  const parts = [];
  const s = message.stats;
  if (s?.tokens !== null && s?.tokens !== undefined) parts.push(`${s.tokens} tokens`);
  if (s?.rate) parts.push(`${s.rate.toFixed(1)} tok/s`);
  if (s?.ttft !== null && s?.ttft !== undefined) parts.push(`first token ${Math.round(s.ttft)} ms`);
  if (message.finish && message.status === "done") parts.push(`finish: ${message.finish}`);
  if (message.status === "stopped") parts.push("stopped");
  if (message.status === "error") parts.push(`error: ${message.error}`);
  return parts.join(" · ");
}
