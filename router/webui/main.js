// The page's entry point: the two views behind ARIA tabs (arrow keys move
// between them; the URL's #chat / #dashboard names the open one, so a reload
// or a link keeps it), and the model's name in the header.

import { request } from "./api.js";
import { Chat } from "./chat.js";
import { Dashboard } from "./dashboard.js";

const tabs = [...document.querySelectorAll('[role="tab"]')];
const chat = new Chat(document.getElementById("chat"));
const dashboard = new Dashboard(document.getElementById("dashboard"));

function select(name, { focus = false } = {}) {
  for (const tab of tabs) {
    const selected = tab.getAttribute("aria-controls") === name;
    tab.setAttribute("aria-selected", String(selected));
    tab.tabIndex = selected ? 0 : -1;
    document.getElementById(tab.getAttribute("aria-controls")).hidden = !selected;
    if (selected && focus) tab.focus();
  }
  dashboard.show(name === "dashboard");
  if (location.hash !== `#${name}`) history.replaceState(null, "", `#${name}`);
}

for (const tab of tabs) {
  tab.addEventListener("click", () => select(tab.getAttribute("aria-controls")));
  tab.addEventListener("keydown", (event) => {
    const step = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
    if (!step) return;
    const next = tabs[(tabs.indexOf(tab) + step + tabs.length) % tabs.length];
    select(next.getAttribute("aria-controls"), { focus: true });
  });
}
document.addEventListener("visibilitychange", () => {
  dashboard.show(document.getElementById("dashboard").hidden === false);
});

async function showModelName() {
  const response = await request("/info");
  if (!response.ok) return;
  const info = await response.json();
  document.getElementById("model-name").textContent = `${info.model_id} · ${info.model_device_type} · ${info.model_dtype}`;
}

select(location.hash === "#dashboard" ? "dashboard" : "chat");
showModelName();
window.sluice = { chat, dashboard }; // for the browser tests and the curious
