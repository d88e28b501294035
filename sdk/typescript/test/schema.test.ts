/**
 * The SDK against the live server's OpenAPI schema: every route it calls exists with
 * its method, and the SDK (sources, tests, examples) type-checks with request types
 * generated from the *live* schema, not the committed snapshot. A server change that
 * breaks the SDK fails here; a compatible one only asks for `npm run gen`.
 */

import { readFileSync } from "node:fs";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import openapiTS, { astToString } from "openapi-typescript";
import ts from "typescript";
import { expect, inject, it } from "vitest";
import { ROUTES } from "../src/index.js";

const ROOT = resolve(dirname(fileURLToPath(import.meta.url)), "..");
const GENERATED = join(ROOT, "src", "openapi.ts");

async function liveSchema(): Promise<{ paths: Record<string, Record<string, unknown>> }> {
  const r = await fetch(inject("kvmeshUrl") + "/openapi.json");
  expect(r.status).toBe(200);
  return (await r.json()) as { paths: Record<string, Record<string, unknown>> };
}

/** tsc diagnostics of the project with `src/openapi.ts` replaced by `generated`. */
export function typecheckWith(generated: string): string[] {
  const cfg = ts.getParsedCommandLineOfConfigFile(join(ROOT, "tsconfig.json"), {}, { ...ts.sys, onUnRecoverableConfigFileDiagnostic: () => undefined })!;
  const host = ts.createCompilerHost(cfg.options);
  const read = host.readFile.bind(host);
  host.readFile = (f) => (resolve(f) === GENERATED ? generated : read(f));
  const program = ts.createProgram({ rootNames: cfg.fileNames, options: { ...cfg.options, noEmit: true }, host });
  return ts.getPreEmitDiagnostics(program).map((d) => ts.flattenDiagnosticMessageText(d.messageText, "\n"));
}

it("every route the SDK calls is in the live schema with its method", async () => {
  const schema = await liveSchema();
  for (const { path, method } of Object.values(ROUTES)) {
    expect(schema.paths[path], path).toBeDefined();
    expect(schema.paths[path]![method], `${method} ${path}`).toBeDefined();
  }
});

/** The schema with its keys sorted, as scripts/dump_openapi.py writes it. */
function sorted(v: unknown): unknown {
  if (Array.isArray(v)) return v.map(sorted);
  if (typeof v !== "object" || v === null) return v;
  return Object.fromEntries(Object.keys(v).sort().map((k) => [k, sorted((v as Record<string, unknown>)[k])]));
}

it("the SDK type-checks against types generated from the live schema", async () => {
  const live = astToString(await openapiTS(sorted(await liveSchema()) as never, { defaultNonNullable: false }));
  expect(typecheckWith(live)).toEqual([]);
  if (live.replace(/\s+/g, "") !== readFileSync(GENERATED, "utf8").replace(/^\/\*\*[\s\S]*?\*\/\s*/, "").replace(/\s+/g, "")) {
    console.warn("openapi.json is older than the server's schema (compatible): refresh it with scripts/dump_openapi.py and npm run gen");
  }
}, 120_000);

it("a server that dropped or renamed a request field would fail that check", () => {
  const renamed = readFileSync(GENERATED, "utf8").replaceAll("max_tokens?:", "max_new_tokens?:");
  expect(renamed).not.toBe(readFileSync(GENERATED, "utf8"));
  expect(typecheckWith(renamed).join("\n")).toMatch(/max_tokens/);
}, 120_000);
