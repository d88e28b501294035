import { defineConfig } from "vitest/config";

export default defineConfig({
  test: {
    include: ["test/**/*.test.ts"],
    globalSetup: ["test/head.ts"],
    testTimeout: 60_000,
    hookTimeout: 150_000,
    coverage: {
      provider: "v8",
      include: ["src/**/*.ts"],
      exclude: ["src/openapi.ts", "src/types.ts", "src/index.ts"],
      reporter: ["text", "json-summary"],
      thresholds: { lines: 95, branches: 85, functions: 95, statements: 95 },
    },
  },
});
