/** kvmesh's TypeScript SDK: `KvmeshClient`, its types and its errors. */
export * from "./client.js";
export * from "./errors.js";
export type * from "./types.js";
