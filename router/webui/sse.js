// Server-sent events read from a fetch() body (EventSource cannot POST or send
// an Authorization header). Yields the parsed JSON of every event's data until
// OpenAI's `[DONE]`; an error object the server sends mid-stream is thrown.

export async function* sseEvents(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      // An event ends at a blank line (LF or CRLF line ends).
      for (let match; (match = /\r?\n\r?\n/.exec(buffer)); ) {
        const data = eventData(buffer.slice(0, match.index));
        buffer = buffer.slice(match.index + match[0].length);
        if (data === null) continue;
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message ?? String(event.error));
        yield event;
      }
    }
  } finally {
    // Reached early (the caller stopped reading): close the connection, which
    // cancels the generation on the server. A no-op after the end.
    await reader.cancel().catch(() => {});
  }
}

// The `data:` lines of one event joined by newlines (the SSE rule); null for an
// event without data (a comment or keep-alive).
export function eventData(block) {
  const lines = block.split(/\r?\n/).filter((line) => line.startsWith("data:"));
  if (lines.length === 0) return null;
  return lines.map((line) => line.slice(line.startsWith("data: ") ? 6 : 5)).join("\n");
}
