/**
 * The Worker as the tests bundle it: `src/worker.ts` instrumented by istanbul, plus
 * one route that hands its counters back. Test-only: the deployed Worker
 * (`wrangler.toml`: `main = "src/worker.ts"`) has neither.
 */

import worker from "../src/worker.ts";

export default {
  /** @param {Request} req @param {any} env @param {any} ctx */
  async fetch(req, env, ctx) {
    if (new URL(req.url).pathname === "/__coverage__") {
      return new Response(JSON.stringify(/** @type {any} */ (globalThis).__coverage__ ?? {}));
    }
    return worker.fetch(req, env, ctx);
  },
};
