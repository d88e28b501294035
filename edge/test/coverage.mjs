/**
 * Line coverage of the Worker *as it runs in workerd*: the tests run a bundle whose
 * `src/worker.ts` is instrumented by istanbul (no eval: workerd forbids it); before an
 * edge is disposed its counters are fetched and merged; `report()` maps them back to
 * `src/worker.ts`, prints the table and fails below the threshold.
 */

import { build, transform } from "esbuild";
import libCoverage from "istanbul-lib-coverage";
import { createInstrumenter } from "istanbul-lib-instrument";
import libReport from "istanbul-lib-report";
import libSourceMaps from "istanbul-lib-source-maps";
import reports from "istanbul-reports";
import { mkdirSync, readFileSync, writeFileSync, existsSync } from "node:fs";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";

const ROOT = join(dirname(fileURLToPath(import.meta.url)), "..");
const RAW = join(ROOT, "coverage", "worker-raw.json");
export const THRESHOLD = 95;

/** The instrumented test bundle's path. */
export async function instrumentedBundle() {
  const instrumenter = createInstrumenter({ esModules: true, produceSourceMap: true, coverageGlobalScope: "globalThis", coverageGlobalScopeFunc: false });
  const out = join(ROOT, "dist", "worker.coverage.js");
  await build({
    entryPoints: [join(ROOT, "test", "coverage-entry.mjs")],
    bundle: true,
    format: "esm",
    target: "es2022",
    outfile: out,
    logLevel: "error",
    plugins: [{
      name: "istanbul",
      setup(b) {
        b.onLoad({ filter: /[\\/]src[\\/]worker\.ts$/ }, async (args) => {
          const src = readFileSync(args.path, "utf8");
          const js = await transform(src, { loader: "ts", format: "esm", target: "es2022", sourcemap: "external", sourcefile: args.path });
          const map = JSON.parse(js.map);
          const code = instrumenter.instrumentSync(js.code, args.path, map);
          return { contents: code, loader: "js" };
        });
      },
    }],
  });
  return out;
}

const merged = libCoverage.createCoverageMap({});

/** Fetches an edge's counters (before it is disposed) into the run's total. */
export async function collect(/** @type {import("miniflare").Miniflare} */ mf) {
  const r = await mf.dispatchFetch("http://edge/__coverage__");
  merged.merge(/** @type {any} */ (await r.json()));
}

/** Writes the run's total for `report()`. */
export function save() {
  mkdirSync(dirname(RAW), { recursive: true });
  writeFileSync(RAW, JSON.stringify(merged.toJSON()));
}

/** Prints the text table of `src/worker.ts`; the line percentage. */
export async function report() {
  if (!existsSync(RAW)) throw new Error(`no coverage data at ${RAW}: run the tests first`);
  const store = libSourceMaps.createSourceMapStore();
  const map = await store.transformCoverage(libCoverage.createCoverageMap(JSON.parse(readFileSync(RAW, "utf8"))));
  const context = libReport.createContext({ dir: join(ROOT, "coverage"), coverageMap: map, defaultSummarizer: "flat" });
  reports.create("text").execute(context);
  reports.create("json-summary").execute(context);
  return map.getCoverageSummary().lines.pct;
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const pct = await report();
  if (pct < THRESHOLD) {
    console.error(`the Worker's line coverage ${pct}% is below ${THRESHOLD}%`);
    process.exit(1);
  }
}
