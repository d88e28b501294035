/**
 * The edge Worker in real workerd (miniflare) in front of a real kvmesh head: public
 * reads pass without admin fields, writes are refused at the edge even with a valid
 * key, the origin killed leaves a stale copy marked as such, the origin back makes
 * it fresh again.
 */

import { createServer } from "node:http";
import type { AddressInfo } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import type { Miniflare } from "miniflare";
import { startEdge as start } from "../serve.mjs";
import { collect, instrumentedBundle, save } from "./coverage.mjs";
import { KEY, startHead, stopHead } from "./head.mjs";

type Edge = { mf: Miniflare; url: string };
const IP = /\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b/;
const READS = ["summary", "nodes", "groups", "tokens", "prefill"].map((p) => `/v1/network/${p}`);
let head: Awaited<ReturnType<typeof startHead>>;
let edge: Edge;
let script: string; // the Worker bundle, instrumented for coverage
const stop: (() => Promise<unknown>)[] = [];

/** An edge in workerd, disposed (after its coverage is collected) in afterAll. */
async function startEdge(o: Parameters<typeof start>[0]): Promise<Edge> {
  const e = (await start({ ...o, scriptPath: script })) as Edge;
  stop.push(async () => {
    await collect(e.mf);
    await e.mf.dispose();
  });
  return e;
}

beforeAll(async () => {
  script = await instrumentedBundle();
  head = await startHead();
  edge = await startEdge({ origin: head.url, cacheTtl: "1", timeoutMs: "2000" });
}, 150_000);

afterAll(async () => {
  try {
    for (const s of stop) await s();
    save();
  } finally {
    await stopHead(head.proc);
  }
}, 60_000);

const get = (path: string, init?: RequestInit) => fetch(edge.url + path, init);

async function until(what: string, cond: () => Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const end = Date.now() + timeoutMs;
  while (Date.now() < end) {
    if (await cond()) return;
    await new Promise((r) => setTimeout(r, 100));
  }
  throw new Error(`never: ${what}`);
}

describe("public reads", () => {
  it("pass with security headers and CORS, and never show admin fields even with a valid key", async () => {
    const direct = await (await fetch(head.url + "/v1/network/nodes", { headers: { "X-API-Key": KEY } })).json();
    expect(JSON.stringify(direct)).toMatch(IP); // the key works at the origin: the edge must strip it
    for (const path of READS) {
      for (const headers of [{}, { "X-API-Key": KEY, Cookie: "session=1" }, { Authorization: `Bearer ${KEY}` }] as Record<string, string>[]) {
        const r = await get(path, { headers });
        const text = await r.text();
        expect(r.status, path).toBe(200);
        expect(text, path).not.toMatch(IP);
        expect(text).not.toMatch(/node_id|endpoints|"epoch"/);
        expect(r.headers.get("access-control-allow-origin")).toBe("*");
        expect(r.headers.get("access-control-expose-headers")).toContain("X-Kvmesh-Edge");
        expect(r.headers.get("x-content-type-options")).toBe("nosniff");
        expect(r.headers.get("content-security-policy")).toContain("default-src 'none'");
        expect(r.headers.get("referrer-policy")).toBe("no-referrer");
        expect(["fresh", "cache"]).toContain(r.headers.get("x-kvmesh-edge"));
        if (path.endsWith("summary")) expect(JSON.parse(text).private).toBe(false);
      }
    }
  });

  it("serve the dashboard and its static files; HEAD and CORS preflight answer", async () => {
    const page = await get("/");
    expect(page.status).toBe(200);
    expect(page.headers.get("content-type")).toContain("text/html");
    expect(await page.text()).toContain("/static/app.js");
    for (const f of ["/static/app.js", "/static/style.css"]) expect((await get(f)).status).toBe(200);
    const head_ = await get("/v1/network/summary", { method: "HEAD" });
    expect([head_.status, await head_.text()]).toEqual([200, ""]);
    const pre = await get("/v1/network/summary", { method: "OPTIONS", headers: { Origin: "https://example.org", "Access-Control-Request-Method": "GET" } });
    expect(pre.status).toBe(204);
    expect(pre.headers.get("access-control-allow-methods")).toContain("GET");
    const health = await get("/healthz");
    expect([health.status, (await health.json()).status]).toEqual([200, "ok"]);
  });

  it("are cached briefly: the second read within the TTL is the edge's copy", async () => {
    await until("a read served from the edge cache", async () => {
      await get("/v1/network/groups");
      return (await get("/v1/network/groups")).headers.get("x-kvmesh-edge") === "cache";
    });
    expect((await get("/healthz")).headers.get("x-kvmesh-edge")).toBe("fresh"); // never cached
  });
});

describe("refusals", () => {
  it("writes are refused at the edge even with a valid key, and the origin is unchanged", async () => {
    const before = await (await fetch(head.url + "/v1/network/groups")).json();
    const auth = { "X-API-Key": KEY, Authorization: `Bearer ${KEY}`, "Content-Type": "application/json" };
    const cases: [string, string, number][] = [
      ["POST", "/v1/network/groups", 405],
      ["DELETE", "/v1/network/groups/abc", 405],
      ["POST", "/v1/network/nodes/register", 405],
      ["POST", "/v1/network/pair", 405],
      ["PUT", "/v1/network/summary", 405],
      ["POST", "/", 405],
    ];
    for (const [method, path, status] of cases) {
      const r = await get(path, { method, headers: auth, body: JSON.stringify({ name: "via-edge", token: "x".repeat(16) }) });
      expect(r.status, `${method} ${path}`).toBe(status);
      expect((await r.json()).error.code).toBe("edge_refused");
      expect(r.headers.get("x-content-type-options")).toBe("nosniff");
    }
    expect(await (await fetch(head.url + "/v1/network/groups")).json()).toEqual(before);
  });

  it("everything outside the allowlist is a 404, OpenAI routes included unless enabled", async () => {
    for (const path of ["/metrics", "/docs", "/openapi.json", "/v1/models", "/v1/completions", "/v1/network/secret", "/static/%2e%2e/openapi.json", "/static/", "/v1/network/nodes/x"]) {
      const r = await get(path);
      expect(r.status, path).toBe(404);
    }
    const post = await get("/v1/chat/completions", { method: "POST", body: "{}" });
    expect(post.status).toBe(404);
  });

  it("with OpenAI pass-through, completions stream through the edge and other methods are 405", async () => {
    const open = await startEdge({ origin: head.url, openaiPassthrough: true });
    const models = await fetch(open.url + "/v1/models");
    expect((await models.json()).data[0].id).toBe("demo-tiny");
    const r = await fetch(open.url + "/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", Cookie: "x=1" },
      body: JSON.stringify({ model: "demo-tiny", messages: [{ role: "user", content: "hi" }], max_tokens: 3, stream: true }),
    });
    expect(r.status).toBe(200);
    expect(r.headers.get("x-kvmesh-edge")).toBe("pass");
    const text = await r.text();
    expect(text).toContain("chat.completion.chunk");
    expect(text.trim().endsWith("data: [DONE]")).toBe(true);
    expect((await fetch(open.url + "/v1/completions")).status).toBe(405);
    expect((await fetch(open.url + "/v1/network/groups", { method: "POST" })).status).toBe(405);
  });

  it("an edge without an origin says so", async () => {
    const { Miniflare } = await import("miniflare");
    const { COMPATIBILITY_DATE } = await import("../serve.mjs");
    const mf = new Miniflare({ scriptPath: script, modules: true, compatibilityDate: COMPATIBILITY_DATE });
    stop.push(async () => {
      await collect(mf);
      await mf.dispose();
    });
    const r = await mf.dispatchFetch("http://edge/v1/network/summary");
    expect([r.status, ((await r.json()) as { error: { code: string } }).error.code]).toEqual([500, "edge_misconfigured"]);
  });
});

describe("the SDK in workerd", () => {
  it("runs inside a Worker: reads the head and streams a completion", async () => {
    const { build } = await import("esbuild");
    const { Miniflare } = await import("miniflare");
    const { COMPATIBILITY_DATE } = await import("../serve.mjs");
    const sdk = new URL("../../sdk/typescript/src/index.ts", import.meta.url).pathname;
    const code = `import { KvmeshClient } from ${JSON.stringify(sdk)};
      export default { async fetch(req, env) {
        const c = new KvmeshClient({ baseUrl: env.HEAD });
        const summary = await c.network.summary();
        let text = "";
        const stream = await c.completions.create({ model: "demo-tiny", prompt: "in a worker", max_tokens: 4, temperature: 0, stream: true });
        for await (const chunk of stream) text += chunk.choices[0]?.text ?? "";
        return Response.json({ nodes: summary.nodes, text, chunks: text.length > 0 });
      } };`;
    const out = await build({ stdin: { contents: code, resolveDir: ".", loader: "js" }, bundle: true, format: "esm", write: false, target: "es2022" });
    const mf = new Miniflare({ script: out.outputFiles[0]!.text, modules: true, compatibilityDate: COMPATIBILITY_DATE, bindings: { HEAD: head.url } });
    stop.push(() => mf.dispose());
    const r = await mf.dispatchFetch("http://worker/");
    const got = (await r.json()) as { nodes: number; chunks: boolean };
    expect([r.status, got.nodes >= 1, got.chunks]).toEqual([200, true, true]);
  });
});

describe("origin failures", () => {
  it("a slow origin: the last good copy is served, marked stale", async () => {
    let hang = false;
    const slow = createServer((req, res) => {
      if (req.url === "/v1/network/prefill") {
        res.writeHead(302, { Location: "http://10.1.2.3:8000/v1/network/prefill" });
        return void res.end();
      }
      if (hang) return; // never answers
      res.writeHead(200, { "Content-Type": "application/json", "Set-Cookie": "origin=1" });
      res.end(JSON.stringify({ nodes: [], path: req.url }));
    });
    await new Promise<void>((r) => slow.listen(0, "127.0.0.1", r));
    stop.push(() => new Promise((r) => (slow.closeAllConnections(), slow.close(r))));
    const port = (slow.address() as AddressInfo).port;
    const e = await startEdge({ origin: `http://127.0.0.1:${port}`, cacheTtl: "0", timeoutMs: "300" });
    const fresh = await fetch(e.url + "/v1/network/nodes?bust=1");
    expect([fresh.status, fresh.headers.get("x-kvmesh-edge"), fresh.headers.get("set-cookie")]).toEqual([200, "fresh", null]);
    expect((await fresh.json()).path).toBe("/v1/network/nodes"); // the client's query never reaches the origin
    hang = true;
    const stale = await fetch(e.url + "/v1/network/nodes");
    expect([stale.status, stale.headers.get("x-kvmesh-edge"), stale.headers.get("warning")]).toEqual([200, "stale", '110 - "Response is Stale"']);
    expect((await stale.json()).path).toBe("/v1/network/nodes");
    const never = await fetch(e.url + "/v1/network/tokens");
    expect([never.status, (await never.json()).error.code]).toEqual([502, "origin_unavailable"]);
    const moved = await fetch(e.url + "/v1/network/prefill", { redirect: "manual" });
    expect([moved.status, moved.headers.get("location")]).toEqual([502, null]); // the origin's address stays hidden
  });

  it("the origin killed: reads answer stale; the origin back: fresh again", async () => {
    const done = await fetch(head.url + "/v1/completions", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ model: "demo-tiny", prompt: "before the crash", max_tokens: 3 }),
    });
    expect(done.status).toBe(200);
    let first = { nodes: 0, completed_tokens: 0 };
    await until("the edge shows the completion", async () => {
      first = await (await get("/v1/network/summary")).json();
      return first.completed_tokens >= 3;
    });
    await get("/");
    const listen = new URL(head.url).host;
    await stopHead(head.proc, "SIGKILL");
    await until("the summary served stale", async () => (await get("/v1/network/summary")).headers.get("x-kvmesh-edge") === "stale");
    const stale = await get("/v1/network/summary");
    expect(stale.status).toBe(200);
    expect((await stale.json()).nodes).toBe(first.nodes);
    // "/" was read after the summary: its fresh copy may outlive the summary's by as long as that read took
    await until("the page served stale", async () => (await get("/")).headers.get("x-kvmesh-edge") === "stale");
    expect((await get("/healthz")).status).toBe(502); // health is never a stale copy
    const open = await startEdge({ origin: head.url, openaiPassthrough: true });
    const passed = await fetch(open.url + "/v1/models");
    expect([passed.status, (await passed.json()).error.code]).toEqual([502, "origin_unavailable"]);
    head = await startHead(listen);
    await until("the summary fresh again", async () => (await get("/v1/network/summary")).headers.get("x-kvmesh-edge") === "fresh");
    const back = await (await get("/v1/network/summary")).json();
    expect(back.completed_tokens).toBe(0); // the new head's own answer, not the old copy
    expect((await get("/healthz")).status).toBe(200);
  }, 150_000);
});
