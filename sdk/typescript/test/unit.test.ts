/** Retries, errors, timeouts, aborts and stream parsing, against real loopback servers. */

import { afterEach, describe, expect, it } from "vitest";
import {
  AbortError,
  APIError,
  AuthenticationError,
  BadRequestError,
  ConnectionError,
  KvmeshClient,
  KvmeshError,
  NotFoundError,
  RateLimitError,
  ServiceUnavailableError,
  StreamError,
  TimeoutError,
  retryAfterMs,
  Stream,
  type ChatCompletionChunk,
  type RetryInfo,
} from "../src/index.js";
import { sseData } from "../src/sse.js";
import { apiErr, hangUp, json, never, raw, scripted, sse, type Scripted } from "./server.js";

let server: Scripted | undefined;
afterEach(async () => {
  await server?.close();
  server = undefined;
});

async function serve(...h: Parameters<typeof scripted>): Promise<Scripted> {
  server = await scripted(...h);
  return server;
}

function client(url: string, extra: Partial<ConstructorParameters<typeof KvmeshClient>[0]> = {}) {
  const retries: RetryInfo[] = [];
  const c = new KvmeshClient({ baseUrl: url, backoffMs: 1, onRetry: (r) => retries.push(r), ...extra });
  return { c, retries };
}

const CHUNK = (text: string) =>
  `data: ${JSON.stringify({ id: "c", object: "chat.completion.chunk", created: 1, model: "m", choices: [{ index: 0, delta: { content: text }, finish_reason: null }] })}\n\n`;
const CHAT = { model: "m", messages: [{ role: "user" as const, content: "hi" }] };

describe("retries", () => {
  it("retries a 503 after its Retry-After, then succeeds", async () => {
    const s = await serve(json(503, apiErr("queue full", "queue_full"), { "Retry-After": "0.05" }), json(200, { nodes: [] }));
    const { c, retries } = client(s.url);
    expect(await c.network.nodes()).toEqual([]);
    expect(retries).toEqual([{ attempt: 1, status: 503, waitMs: 50 }]);
    expect(s.seen).toHaveLength(2);
  });

  it("retries a 429 with exponential backoff when there is no Retry-After", async () => {
    const s = await serve(raw(429, "slow down"), raw(429, "slow down"), json(200, { groups: [{ id: "g" }] }));
    const { c, retries } = client(s.url, { backoffMs: 4 });
    expect(await c.network.groups()).toEqual([{ id: "g" }]);
    expect(retries.map((r) => r.status)).toEqual([429, 429]);
    expect(retries[0]!.waitMs).toBeGreaterThanOrEqual(2);
    expect(retries[0]!.waitMs).toBeLessThanOrEqual(4);
    expect(retries[1]!.waitMs).toBeGreaterThanOrEqual(4);
    expect(retries[1]!.waitMs).toBeLessThanOrEqual(8);
  });

  it("gives up after maxRetries with the server's error body", async () => {
    const body = apiErr("the request queue is full (1 waiting); retry later", "queue_full");
    const s = await serve(json(503, body, { "Retry-After": "0" }));
    const { c } = client(s.url, { maxRetries: 3 });
    const err = await c.network.summary().catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ServiceUnavailableError);
    const e = err as APIError;
    expect([e.status, e.code, e.body, e.headers.get("retry-after")]).toEqual([503, "queue_full", body, "0"]);
    expect(e.message).toContain("queue is full");
    expect(s.seen).toHaveLength(4);
  });

  it("does not wait a Retry-After longer than maxRetryAfterMs", async () => {
    const s = await serve(json(429, apiErr("later"), { "Retry-After": "3600" }));
    const { c, retries } = client(s.url, { maxRetryAfterMs: 1000 });
    await expect(c.network.tokens()).rejects.toBeInstanceOf(RateLimitError);
    expect([s.seen.length, retries.length]).toEqual([1, 0]);
  });

  it("never retries a client error", async () => {
    const s = await serve(json(400, apiErr("temperature: too hot", null, "temperature")));
    const { c } = client(s.url);
    const e = (await c.chat.completions.create({ ...CHAT, temperature: 9 }).catch((x: unknown) => x)) as BadRequestError;
    expect(e).toBeInstanceOf(BadRequestError);
    expect([e.param, s.seen.length]).toEqual(["temperature", 1]);
  });

  it("retries a dropped connection for a read, never for a POST", async () => {
    const s = await serve(hangUp);
    const { c, retries } = client(s.url, { maxRetries: 2 });
    await expect(c.network.prefill()).rejects.toBeInstanceOf(ConnectionError);
    expect([s.seen.length, retries.length]).toEqual([3, 2]);
    await expect(c.network.createGroup({ name: "x" })).rejects.toBeInstanceOf(ConnectionError);
    expect(s.seen).toHaveLength(4);
  });

  it("parses Retry-After as seconds or an HTTP date", () => {
    expect(retryAfterMs("2")).toBe(2000);
    expect(retryAfterMs("0.5")).toBe(500);
    expect(retryAfterMs(new Date(10_000).toUTCString(), 4_000)).toBe(6_000);
    expect(retryAfterMs(new Date(1_000).toUTCString(), 4_000)).toBe(0);
    for (const bad of [null, "", "soon", "-1"]) expect(retryAfterMs(bad)).toBeUndefined();
  });
});

describe("errors", () => {
  it("maps statuses to typed errors carrying the body", async () => {
    const s = await serve(
      json(401, apiErr("a valid API key is required", "invalid_api_key")),
      json(404, apiErr("no group 'x'", "not_found")),
      raw(502, "<html>bad gateway</html>"),
      raw(418, ""),
    );
    const { c } = client(s.url);
    const auth = (await c.network.createGroup({ name: "g" }).catch((e: unknown) => e)) as AuthenticationError;
    expect(auth).toBeInstanceOf(AuthenticationError);
    expect(auth.code).toBe("invalid_api_key");
    const nf = (await c.network.deleteGroup("x/y").catch((e: unknown) => e)) as NotFoundError;
    expect(nf).toBeInstanceOf(NotFoundError);
    expect(s.seen[1]!.path).toBe("/v1/network/groups/x%2Fy");
    const gw = (await c.health().catch((e: unknown) => e)) as APIError;
    expect([gw.constructor, gw.status, gw.body, gw.error, gw.code, gw.param]).toEqual([APIError, 502, "<html>bad gateway</html>", undefined, undefined, undefined]);
    const empty = (await c.health().catch((e: unknown) => e)) as APIError;
    expect(empty.message).toBe("418 error");
  });

  it("refuses a 2xx body that is not JSON, and a bad baseUrl", async () => {
    const s = await serve(raw(200, "not json"));
    const { c } = client(s.url);
    const e = await c.models.list().catch((x: unknown) => x);
    expect(e).toBeInstanceOf(KvmeshError);
    expect((e as Error).message).toContain("not JSON");
    expect(() => new KvmeshClient({ baseUrl: "nope" })).toThrow(KvmeshError);
    expect(() => new KvmeshClient({ baseUrl: "ftp://h" })).toThrow(/http/);
  });

  it("sends the key as a bearer token, JSON bodies, extra headers, through the given fetch", async () => {
    const s = await serve(json(201, { id: "g1", name: "n", members: [], description: "", created: 1 }), raw(204, ""));
    const calls: string[] = [];
    const c = new KvmeshClient({
      baseUrl: s.url + "/",
      apiKey: "k3y",
      headers: { "X-Trace": "t" },
      fetch: (u, i) => (calls.push(u), fetch(u, i)),
    });
    expect((await c.network.createGroup({ name: "n" })).id).toBe("g1");
    expect(await c.network.deleteGroup("g1", { headers: { "X-Extra": "1" } })).toBeUndefined();
    const [post, del] = s.seen;
    expect([post!.headers.authorization, post!.headers["content-type"], post!.headers["x-trace"], post!.body]).toEqual(["Bearer k3y", "application/json", "t", '{"name":"n"}']);
    expect([del!.method, del!.headers["x-extra"], del!.headers["content-type"]]).toEqual(["DELETE", "1", undefined]);
    expect(calls).toEqual([s.url + "/v1/network/groups", s.url + "/v1/network/groups/g1"]);
  });
});

describe("timeouts and aborts", () => {
  it("times out an attempt that never answers", async () => {
    const s = await serve(never);
    const { c } = client(s.url, { timeoutMs: 50, maxRetries: 0 });
    await expect(c.network.summary()).rejects.toBeInstanceOf(TimeoutError);
  });

  it("times out a body that never ends", async () => {
    const s = await serve((_q, res) => {
      res.writeHead(200, { "Content-Type": "application/json" });
      res.write("{");
    });
    const { c } = client(s.url, { timeoutMs: 100 });
    await expect(c.network.summary()).rejects.toBeInstanceOf(TimeoutError);
  });

  it("aborts a request in flight, before it starts, and during a backoff", async () => {
    const s = await serve(never);
    const { c } = client(s.url);
    const ac = new AbortController();
    const p = c.network.summary({ signal: ac.signal });
    setTimeout(() => ac.abort(), 20);
    await expect(p).rejects.toBeInstanceOf(AbortError);
    await expect(c.network.summary({ signal: ac.signal })).rejects.toBeInstanceOf(AbortError);
    await s.close();
    const s2 = await serve(json(503, apiErr("busy"), { "Retry-After": "30" }));
    const ac2 = new AbortController();
    const { c: c2, retries } = client(s2.url);
    const p2 = c2.network.summary({ signal: ac2.signal });
    while (retries.length === 0) await new Promise((r) => setTimeout(r, 5));
    ac2.abort();
    await expect(p2).rejects.toBeInstanceOf(AbortError);
    expect(s2.seen).toHaveLength(1);
  });

  it("aborts a body being read", async () => {
    const s = await serve((_q, res) => {
      res.writeHead(200, { "Content-Type": "application/json" });
      res.write("{");
    });
    const { c } = client(s.url);
    const ac = new AbortController();
    const p = c.network.summary({ signal: ac.signal });
    setTimeout(() => ac.abort(), 30);
    await expect(p).rejects.toBeInstanceOf(AbortError);
  });
});

describe("streams", () => {
  it("yields chunks cut at any byte, CRLF events, comments, and stops at [DONE]", async () => {
    const body = CHUNK("hel") + ": keep-alive\n\n" + CHUNK("lo").replace(/\n\n$/, "\r\n\r\n") + "data: [DONE]\n\n" + CHUNK("after");
    const parts = body.match(/.{1,7}/gs)!;
    const s = await serve(sse(parts));
    const { c } = client(s.url);
    const stream = await c.chat.completions.create({ ...CHAT, stream: true });
    const texts: string[] = [];
    for await (const ch of stream) texts.push(ch.choices[0]!.delta.content ?? "");
    expect(texts).toEqual(["hel", "lo"]);
    expect(s.seen[0]!.headers.accept).toBe("text/event-stream");
    expect(JSON.parse(s.seen[0]!.body).stream).toBe(true);
  });

  it("a stream left early closes its connection; a runtime stream flag picks the shape", async () => {
    let closed = false;
    const s = await serve((req, res) => {
      req.socket.on("close", () => (closed = true));
      sse([CHUNK("a"), CHUNK("b")], true)(req, res, "");
    });
    const { c } = client(s.url);
    const flag: boolean = s.url.length > 0; // known only at run time
    const result = await c.chat.completions.create({ ...CHAT, stream: flag });
    expect(result).toBeInstanceOf(Stream);
    for await (const _ of result as Stream<ChatCompletionChunk>) break;
    while (!closed) await new Promise((r) => setTimeout(r, 5));
    expect(closed).toBe(true);
  });

  it("raises the server's error event as a StreamError", async () => {
    const err = { error: { message: "the generation failed on the server", type: "server_error", param: null, code: "generation_failed" } };
    const s = await serve(sse([CHUNK("a"), `data: ${JSON.stringify(err)}\n\n`, "data: [DONE]\n\n"]));
    const { c } = client(s.url);
    const got: string[] = [];
    const e = await (async () => {
      for await (const ch of await c.completions.create({ model: "m", prompt: "p", stream: true })) got.push(JSON.stringify(ch));
    })().catch((x: unknown) => x);
    expect(e).toBeInstanceOf(StreamError);
    expect((e as StreamError).error.code).toBe("generation_failed");
    expect(got).toHaveLength(1);
  });

  it("refuses a cut stream, a non-JSON event and an oversized event", async () => {
    const s = await serve(sse([CHUNK("a")]), sse(["data: {nope\n\n"]), sse(["data: " + "x".repeat(64)], true));
    const { c } = client(s.url);
    const drain = async (): Promise<unknown> => {
      try {
        for await (const _ of await c.chat.completions.create({ ...CHAT, stream: true })) void _;
      } catch (e) {
        return e;
      }
      return undefined;
    };
    expect(((await drain()) as Error).message).toContain("without [DONE]");
    expect(((await drain()) as Error).message).toContain("not JSON");
    const res = await fetch(s.url, { method: "POST" });
    const big = sseData(res.body!, 16);
    await expect(big.next()).rejects.toThrow(/exceeds 16 bytes/);
  });

  it("reads a final event with no blank line after it, and skips an event without data", async () => {
    const res = new Response("event: ping\n\ndata: a\ndata: b");
    const out: string[] = [];
    for await (const d of sseData(res.body!)) out.push(d);
    expect(out).toEqual(["a\nb"]);
  });

  it("is ended by abort() and by the caller's signal, and the server sees the close", async () => {
    const s = await serve(sse([CHUNK("a"), CHUNK("b")], true));
    const { c } = client(s.url, { timeoutMs: 50 });
    const stream = await c.chat.completions.create({ ...CHAT, stream: true });
    const it = stream[Symbol.asyncIterator]();
    expect((await it.next()).value.choices[0].delta.content).toBe("a");
    await new Promise((r) => setTimeout(r, 80)); // past timeoutMs: a stream is not timed out once it began
    expect((await it.next()).value.choices[0].delta.content).toBe("b");
    stream.abort();
    await expect(it.next()).rejects.toBeInstanceOf(AbortError);
    const ac = new AbortController();
    const s2 = await c.completions.create({ model: "m", prompt: "p", stream: true }, { signal: ac.signal });
    const it2 = s2[Symbol.asyncIterator]();
    await it2.next();
    ac.abort();
    await expect(it2.next()).rejects.toBeInstanceOf(AbortError);
  });

  it("gives no chunk after an abort, even one it already read", async () => {
    const s = await serve(sse([CHUNK("a") + CHUNK("b")], true)); // one write: "b" arrives with "a"
    const { c } = client(s.url);
    for (const end of ["abort", "signal"] as const) {
      const ac = new AbortController();
      const stream = await c.chat.completions.create({ ...CHAT, stream: true }, { signal: ac.signal });
      const it = stream[Symbol.asyncIterator]();
      expect((await it.next()).value.choices[0].delta.content).toBe("a");
      if (end === "abort") stream.abort();
      else ac.abort();
      await expect(it.next()).rejects.toBeInstanceOf(AbortError);
    }
  });
});
