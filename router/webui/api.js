// Every request the page makes goes through `request`: the API key, once the
// server asked for one, rides along as `Authorization: Bearer KEY`. A 401 opens
// the key dialog and retries with what the user typed; the requests that get a
// 401 while the dialog is open (the dashboard polls two endpoints) wait for the
// same answer instead of opening a dialog each.

const KEY_NAME = "sluice.apiKey";

export function apiKey() {
  return sessionStorage.getItem(KEY_NAME) ?? localStorage.getItem(KEY_NAME);
}

// The key lives in sessionStorage (gone with the tab) unless the user asked to
// keep it on this device.
function storeKey(key, remember) {
  sessionStorage.removeItem(KEY_NAME);
  localStorage.removeItem(KEY_NAME);
  (remember ? localStorage : sessionStorage).setItem(KEY_NAME, key);
}

let pendingPrompt = null;
// Set when the user cancelled the dialog: background requests (the dashboard's
// polls) then stop asking, until the user acts (sends a message, clicks
// "Enter key").
let declined = false;

// Resolves to the key the user typed, or null when they cancelled.
function askForKey(reason) {
  pendingPrompt ??= new Promise((resolve) => {
    const dialog = document.getElementById("key-dialog");
    const input = document.getElementById("key-input");
    document.getElementById("key-reason").textContent = reason;
    input.value = "";
    const finish = (key) => {
      dialog.removeEventListener("close", onClose);
      pendingPrompt = null;
      declined = key === null;
      resolve(key);
    };
    const onClose = () => {
      if (dialog.returnValue === "ok" && input.value) {
        storeKey(input.value, document.getElementById("key-remember").checked);
        finish(input.value);
      } else {
        finish(null);
      }
    };
    dialog.addEventListener("close", onClose);
    document.getElementById("key-cancel").onclick = () => dialog.close("cancel");
    dialog.returnValue = "";
    dialog.showModal();
    input.focus();
  });
  return pendingPrompt;
}

// Opens the key dialog at the user's request; resolves to whether a key was given.
export async function promptForKey() {
  return (await askForKey(apiKey() ? "Enter a new API key." : "This server needs an API key.")) !== null;
}

// fetch() with the key. Returns the response of the last try: a 401 only when
// the user cancelled the key dialog (or, for a request that is not
// `interactive`, had cancelled it before).
export async function request(path, init = {}, { interactive = false } = {}) {
  if (interactive) declined = false;
  for (;;) {
    const sent = apiKey();
    const headers = new Headers(init.headers);
    if (sent) headers.set("Authorization", `Bearer ${sent}`);
    const response = await fetch(path, { ...init, headers });
    if (response.status !== 401) return response;
    // Another request may have been answered with a new key meanwhile.
    if (apiKey() !== sent) continue;
    if (declined) return response;
    const reason = sent ? "The server refused that key. Enter the right one." : "This server needs an API key.";
    if ((await askForKey(reason)) === null) return response;
  }
}

// The message of an error answer, whichever API's shape it has
// (OpenAI: {error: {message}}, TGI: {error: "..."}).
export async function errorMessage(response) {
  const text = await response.text();
  try {
    const body = JSON.parse(text);
    const error = body.error ?? body;
    return `${response.status}: ${typeof error === "string" ? error : error.message ?? text}`;
  } catch {
    return `${response.status}: ${text || response.statusText}`;
  }
}
