/**
 * Server-sent events, as the head streams them: `data: <json>` events separated by a
 * blank line, ending with `data: [DONE]`. Bounded: an event larger than
 * `maxEventBytes` is an error, never an unbounded buffer.
 */

import { KvmeshError, StreamError, errorObject } from "./errors.js";

export const MAX_EVENT_BYTES = 8 << 20;

/** The `data:` payloads of each event, in order, until the stream ends. */
export async function* sseData(
  body: ReadableStream<Uint8Array>,
  maxEventBytes = MAX_EVENT_BYTES,
): AsyncGenerator<string> {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { done, value } = await reader.read();
      buf += done ? decoder.decode() : decoder.decode(value, { stream: true });
      let cut: number;
      while ((cut = buf.search(/\r?\n\r?\n/)) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut).replace(/^\r?\n\r?\n/, "");
        const data = eventData(event);
        if (data !== undefined) yield data;
      }
      if (buf.length > maxEventBytes) throw new KvmeshError(`an event exceeds ${maxEventBytes} bytes`);
      if (done) break;
    }
    const tail = eventData(buf);
    if (tail !== undefined) yield tail;
  } finally {
    await reader.cancel().catch(() => undefined); // early exit: stop the download
  }
}

function eventData(event: string): string | undefined {
  const lines = event.split(/\r?\n/).filter((l) => l.startsWith("data:"));
  if (lines.length === 0) return undefined;
  return lines.map((l) => l.slice(5).replace(/^ /, "")).join("\n");
}

/** JSON chunks of an OpenAI-style stream; an error event is a `StreamError`. */
export async function* jsonChunks<T>(body: ReadableStream<Uint8Array>): AsyncGenerator<T> {
  for await (const data of sseData(body)) {
    if (data === "[DONE]") return;
    let parsed: unknown;
    try {
      parsed = JSON.parse(data);
    } catch (cause) {
      throw new KvmeshError(`the stream sent an event that is not JSON: ${data.slice(0, 80)}`, { cause });
    }
    const error = errorObject(parsed);
    if (error) throw new StreamError(error);
    yield parsed as T;
  }
  throw new KvmeshError("the stream ended without [DONE]: the output may be incomplete");
}
