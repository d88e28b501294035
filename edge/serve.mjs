#!/usr/bin/env node
/**
 * Runs the edge Worker locally in workerd (Cloudflare's runtime, via miniflare), in
 * front of a kvmesh head:
 *
 *   node edge/serve.mjs --origin http://127.0.0.1:8000 --port 8787
 *
 * Options: --host (127.0.0.1), --cache-ttl (s), --stale-ttl (s), --timeout-ms,
 * --openai-passthrough. Prints one line `kvmesh edge <url> -> <origin>` once it
 * listens; SIGTERM or SIGINT stops it.
 */

import { build } from "esbuild";
import { Miniflare } from "miniflare";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const HERE = dirname(fileURLToPath(import.meta.url));
export const COMPATIBILITY_DATE = "2026-04-01";

/** The Worker bundled by esbuild (what wrangler would upload). */
export async function bundle() {
  const out = join(HERE, "dist", "worker.js");
  await build({ entryPoints: [join(HERE, "src", "worker.ts")], bundle: true, format: "esm", target: "es2022", outfile: out, logLevel: "error" });
  return out;
}

/**
 * A Miniflare (workerd) instance running the Worker.
 * @param {{origin: string, port?: number, host?: string, cacheTtl?: string, staleTtl?: string, timeoutMs?: string, openaiPassthrough?: boolean, scriptPath?: string}} o
 */
export async function startEdge(o) {
  const origin = new URL(o.origin); // a bad origin fails here, not on the first request
  /** @type {Record<string, string>} */
  const bindings = { ORIGIN: origin.href.replace(/\/$/, "") };
  if (o.cacheTtl !== undefined) bindings.CACHE_TTL_S = String(o.cacheTtl);
  if (o.staleTtl !== undefined) bindings.STALE_TTL_S = String(o.staleTtl);
  if (o.timeoutMs !== undefined) bindings.ORIGIN_TIMEOUT_MS = String(o.timeoutMs);
  if (o.openaiPassthrough) bindings.OPENAI_PASSTHROUGH = "true";
  const mf = new Miniflare({
    scriptPath: o.scriptPath ?? (await bundle()),
    modules: true,
    compatibilityDate: COMPATIBILITY_DATE,
    bindings,
    host: o.host ?? "127.0.0.1",
    port: o.port ?? 0,
  });
  const url = await mf.ready;
  return { mf, url: url.href.replace(/\/$/, "") };
}

async function main() {
  const { values } = parseArgs({
    options: {
      origin: { type: "string" },
      port: { type: "string", default: "8787" },
      host: { type: "string", default: "127.0.0.1" },
      "cache-ttl": { type: "string" },
      "stale-ttl": { type: "string" },
      "timeout-ms": { type: "string" },
      "openai-passthrough": { type: "boolean", default: false },
    },
  });
  if (!values.origin) {
    console.error("usage: node edge/serve.mjs --origin http://127.0.0.1:8000 [--port 8787]");
    process.exit(2);
  }
  const port = Number(values.port);
  if (!Number.isInteger(port) || port < 0 || port > 65535) {
    console.error(`--port: not a port: ${values.port}`);
    process.exit(2);
  }
  const { mf, url } = await startEdge({
    origin: values.origin, port, host: values.host, cacheTtl: values["cache-ttl"], staleTtl: values["stale-ttl"],
    timeoutMs: values["timeout-ms"], openaiPassthrough: values["openai-passthrough"],
  });
  console.log(`kvmesh edge ${url} -> ${values.origin}`);
  const stop = async () => {
    await mf.dispose();
    process.exit(0);
  };
  process.once("SIGTERM", stop);
  process.once("SIGINT", stop);
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  main().catch((e) => {
    console.error(e);
    process.exit(1);
  });
}
