// The one DOM helper the views share.

// A new element with a class and text content (both optional).
export function element(tag, className = "", text = "") {
  const made = document.createElement(tag);
  if (className) made.className = className;
  if (text) made.textContent = text;
  return made;
}
