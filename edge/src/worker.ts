/**
 * kvmesh's public edge: a Cloudflare Worker in front of one head (`ORIGIN`).
 *
 * Contract:
 * - Only public reads pass: GET/HEAD of `/`, `/static/<file>`, `/healthz` and
 *   `/v1/network/{summary,nodes,groups,tokens,prefill}`. Every other path is a 404
 *   and every other method on those paths a 405, answered here: a write never
 *   reaches the origin, whatever key it carries. `OPENAI_PASSTHROUGH = "true"`
 *   additionally forwards `POST /v1/completions`, `POST /v1/chat/completions` and
 *   `GET /v1/models` (with their `Authorization`, for `--api-key-scope all`).
 * - Public reads are sent without the client's credentials, cookies or query
 *   string, so the origin answers its public view: no addresses, ids or epochs.
 * - Network reads and the dashboard are cached `CACHE_TTL_S` seconds (Cache API).
 *   Each good answer is also kept `STALE_TTL_S` seconds as a fallback: when the
 *   origin fails (unreachable, slower than `ORIGIN_TIMEOUT_MS`, 5xx, a redirect) that copy is
 *   served with `X-Kvmesh-Edge: stale` instead of an error. `/healthz` is never
 *   cached: it tells the origin's truth.
 * - Every answer carries the security headers (CSP fitting the dashboard, nosniff,
 *   Referrer-Policy, frame denial); public reads carry CORS for any origin.
 * - Rollback is a route change (docs/edge.md): the Worker holds no state that the
 *   origin needs.
 */

export interface Env {
  /** The head's base URL, e.g. `https://head.internal.example:8000`. */
  ORIGIN: string;
  CACHE_TTL_S?: string;
  STALE_TTL_S?: string;
  ORIGIN_TIMEOUT_MS?: string;
  OPENAI_PASSTHROUGH?: string;
}

interface Ctx {
  waitUntil(p: Promise<unknown>): void;
}

const NETWORK = new Set(["summary", "nodes", "groups", "tokens", "prefill"]);
const STATIC_FILE = /^\/static\/[A-Za-z0-9][A-Za-z0-9._-]{0,127}$/;
const OPENAI: Record<string, string> = { "/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET" };
const WRITES = new Set(["/v1/network/nodes/register", "/v1/network/pair"]);
const CACHE_HOST = "https://kvmesh-edge.cache"; // cache keys: never a real host, never a client's query
const MARK = "X-Kvmesh-Edge";

export const SECURITY_HEADERS: Record<string, string> = {
  "Content-Security-Policy":
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; " +
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
  "X-Content-Type-Options": "nosniff",
  "Referrer-Policy": "no-referrer",
  "X-Frame-Options": "DENY",
  "Strict-Transport-Security": "max-age=31536000",
};

const CORS: Record<string, string> = {
  "Access-Control-Allow-Origin": "*",
  "Access-Control-Allow-Methods": "GET, HEAD, OPTIONS",
  "Access-Control-Allow-Headers": "Accept, Content-Type",
  "Access-Control-Expose-Headers": "X-Kvmesh-Edge, X-Kvmesh-Fetched-At, Warning",
  "Access-Control-Max-Age": "600",
};

/** What the edge does with a path: a public read (cached or not), an OpenAI route, a refusal. */
export type Route =
  | { kind: "read"; cached: boolean }
  | { kind: "openai"; method: string }
  | { kind: "refuse"; status: 404 | 405; allow?: string };

export function classify(path: string, passthrough: boolean): Route {
  if (path === "/healthz") return { kind: "read", cached: false };
  if (path === "/" || STATIC_FILE.test(path)) return { kind: "read", cached: true };
  const m = /^\/v1\/network\/([a-z]+)$/.exec(path);
  if (m && NETWORK.has(m[1]!)) return { kind: "read", cached: true };
  if (WRITES.has(path) || /^\/v1\/network\/groups\/[^/]+$/.test(path)) return { kind: "refuse", status: 405, allow: "" };
  const method = OPENAI[path];
  if (method) return passthrough ? { kind: "openai", method } : { kind: "refuse", status: 404 };
  return { kind: "refuse", status: 404 };
}

function num(v: string | undefined, dflt: number, min: number, max: number): number {
  const n = Number(v);
  return v !== undefined && v !== "" && Number.isFinite(n) ? Math.min(max, Math.max(min, n)) : dflt;
}

function error(status: number, message: string, code: string, extra: Record<string, string> = {}): Response {
  const body = JSON.stringify({ error: { message, type: status >= 500 ? "server_error" : "invalid_request_error", param: null, code } });
  return new Response(body, { status, headers: { "Content-Type": "application/json", ...extra } });
}

/** `r` with the edge's headers: security always, CORS and the freshness mark for reads. */
function finish(r: Response, extra: Record<string, string>, head = false): Response {
  const headers = new Headers(r.headers);
  for (const h of ["Set-Cookie", "Server", "Via"]) headers.delete(h);
  for (const [k, v] of Object.entries({ ...SECURITY_HEADERS, ...extra })) headers.set(k, v);
  return new Response(head ? null : r.body, { status: r.status, statusText: r.statusText, headers });
}

function cacheKey(kind: "fresh" | "stale", path: string): Request {
  return new Request(`${CACHE_HOST}/${kind}${path}`);
}

async function fromOrigin(env: Env, path: string, timeoutMs: number): Promise<Response | undefined> {
  try {
    // a fresh request: the client's headers (credentials, cookies) never reach the origin
    const r = await fetch(new URL(path, env.ORIGIN).href, {
      headers: { Accept: path.startsWith("/v1/") || path === "/healthz" ? "application/json" : "*/*" },
      signal: AbortSignal.timeout(timeoutMs),
      redirect: "manual",
    });
    // a 5xx is a failure; so is a redirect, which would hand the client the origin's address
    return r.status >= 500 || (r.status >= 300 && r.status < 400) ? undefined : r;
  } catch {
    return undefined; // unreachable or too slow: the caller falls back to the stale copy
  }
}

async function publicRead(req: Request, env: Env, ctx: Ctx, path: string, cached: boolean): Promise<Response> {
  const ttl = num(env.CACHE_TTL_S, 5, 0, 300);
  const staleTtl = num(env.STALE_TTL_S, 86400, 0, 7 * 86400);
  const timeoutMs = num(env.ORIGIN_TIMEOUT_MS, 5000, 100, 60_000);
  const head = req.method === "HEAD";
  const cache = (caches as unknown as { default: Cache }).default;
  if (cached && ttl > 0) {
    const hit = await cache.match(cacheKey("fresh", path));
    if (hit) return finish(hit, { ...CORS, [MARK]: "cache" }, head);
  }
  const r = await fromOrigin(env, path, timeoutMs);
  if (r && cached && r.status === 200) {
    const body = await r.arrayBuffer();
    const keep = (seconds: number): Response =>
      new Response(body, { status: 200, headers: { "Content-Type": r.headers.get("Content-Type") ?? "application/octet-stream", "Cache-Control": `public, max-age=${seconds}`, "X-Kvmesh-Fetched-At": new Date().toUTCString() } });
    const puts = [cache.put(cacheKey("stale", path), keep(staleTtl))];
    if (ttl > 0) puts.push(cache.put(cacheKey("fresh", path), keep(ttl)));
    ctx.waitUntil(Promise.all(puts));
    return finish(keep(ttl), { ...CORS, [MARK]: "fresh" }, head);
  }
  if (r) return finish(r, { ...CORS, [MARK]: "fresh", "Cache-Control": "no-store" }, head);
  const stale = cached ? await cache.match(cacheKey("stale", path)) : undefined;
  if (stale) {
    return finish(stale, { ...CORS, [MARK]: "stale", Warning: '110 - "Response is Stale"', "Cache-Control": "no-store" }, head);
  }
  return finish(error(502, "the origin is unavailable and no earlier copy is cached", "origin_unavailable"), { ...CORS, [MARK]: "error" }, head);
}

async function openai(req: Request, env: Env, path: string): Promise<Response> {
  const headers = new Headers();
  for (const h of ["Authorization", "X-API-Key", "Content-Type", "Accept"]) {
    const v = req.headers.get(h);
    if (v !== null) headers.set(h, v);
  }
  try {
    const r = await fetch(new URL(path, env.ORIGIN).href, { method: req.method, headers, body: req.method === "POST" ? req.body : null, redirect: "manual" });
    return finish(r, { [MARK]: "pass" });
  } catch {
    return finish(error(502, "the origin is unavailable", "origin_unavailable"), { [MARK]: "error" });
  }
}

export async function handle(req: Request, env: Env, ctx: Ctx): Promise<Response> {
  const path = new URL(req.url).pathname;
  const route = classify(path, env.OPENAI_PASSTHROUGH === "true");
  if (route.kind === "refuse") {
    const msg = route.status === 405 ? `${req.method} ${path} is not served at the public edge` : `${path} is not served at the public edge`;
    return finish(error(route.status, msg, "edge_refused", route.status === 405 ? { Allow: route.allow ?? "" } : {}), {});
  }
  if (route.kind === "openai") {
    if (req.method !== route.method) return finish(error(405, `${req.method} ${path}: use ${route.method}`, "edge_refused", { Allow: route.method }), {});
    return openai(req, env, path);
  }
  if (req.method === "OPTIONS") return finish(new Response(null, { status: 204 }), CORS);
  if (req.method !== "GET" && req.method !== "HEAD") {
    return finish(error(405, `${req.method} ${path} is not served at the public edge`, "edge_refused", { Allow: "GET, HEAD, OPTIONS" }), {});
  }
  return publicRead(req, env, ctx, path, route.cached);
}

export default {
  async fetch(req: Request, env: Env, ctx: Ctx): Promise<Response> {
    if (!env.ORIGIN) return finish(error(500, "the edge has no ORIGIN configured", "edge_misconfigured"), {});
    return handle(req, env, ctx);
  },
};
