/**
 * Request types come from the server's OpenAPI schema (`openapi.ts`, generated from
 * `openapi.json` by `npm run gen`): a field the server renames or drops is a type
 * error in this SDK, its tests and its examples. Response types are written here:
 * the head's routes return untyped JSON in its schema, so the end-to-end tests
 * check these shapes against a real head instead.
 */

import type { components, paths } from "./openapi.js";

/** `T` without its index signature (`extra="allow"` models): only named fields. */
export type Known<T> = { [K in keyof T as string extends K ? never : number extends K ? never : K]: T[K] };

type JsonBody<P extends keyof paths, M extends "post"> = paths[P][M] extends {
  requestBody: { content: { "application/json": infer B } };
}
  ? B
  : never;

export type Message = Known<components["schemas"]["Message"]>;
export type ChatRequestBody = Known<JsonBody<"/v1/chat/completions", "post">>;
export type CompletionRequestBody = Known<JsonBody<"/v1/completions", "post">>;
export type GroupCreateParams = Known<JsonBody<"/v1/network/groups", "post">>;
export type PairParams = Known<JsonBody<"/v1/network/pair", "post">>;

export interface StreamOptions {
  include_usage?: boolean;
}

export type ChatCompletionCreateParams = Omit<ChatRequestBody, "messages" | "stream_options"> & {
  messages: Message[];
  stream_options?: StreamOptions | null;
};
export type CompletionCreateParams = Omit<CompletionRequestBody, "stream_options"> & {
  stream_options?: StreamOptions | null;
};

/** How the head got a request's prefix: the `kvmesh` field of a completion. */
export interface KvmeshReport {
  source: "session" | "local" | "disk" | "remote" | "compute";
  prompt_tokens: number;
  reused_tokens: number;
  computed_tokens: number;
  peer: string | null;
  bytes_fetched: number;
  /** Why the cache was not used (e.g. `checksum_mismatch`), null when it was or nothing was cached. */
  fallback: string | null;
  lookup_s: number;
  fetch_s: number;
  import_s: number;
  compute_s: number;
  saved_s: number;
  used_stored_logits: boolean;
  /** Bytes that crossed the wire for the fetch (frames; fewer when trimmed or compressed). */
  bytes_wire: number;
  /** Sliding-window layers' positions outside the window stayed on the peer. */
  trimmed: boolean;
  /** The part codec asked for ("" for raw). */
  codec: string;
  /** The planner's choice for the prompt, when a peer held more than this head. */
  planner: { choice?: "fetch" | "compute"; fetch_s_est?: number; compute_s_est?: number };
  ttft_s: number | null;
}

export interface Usage {
  prompt_tokens: number;
  completion_tokens: number;
  total_tokens: number;
  /** `cached_tokens`: prompt tokens imported, not recomputed. */
  prompt_tokens_details: { cached_tokens: number };
}

export type FinishReason = "stop" | "length" | "tool_calls" | null;

/** A call the model made, parsed from its output by the head's tool-call parser. */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** A piece of a tool call in a stream: `id` and `name` come first, `arguments` arrive as string pieces. */
export interface ToolCallDelta {
  index: number;
  id?: string;
  type?: "function";
  function?: { name?: string; arguments?: string };
}

export interface CompletionChoice {
  index: number;
  text: string;
  finish_reason: FinishReason;
  logprobs: unknown;
}

export interface Completion {
  id: string;
  object: "text_completion";
  created: number;
  model: string;
  choices: CompletionChoice[];
  usage: Usage;
  kvmesh: KvmeshReport | null;
}

export interface ChatCompletion {
  id: string;
  object: "chat.completion";
  created: number;
  model: string;
  choices: { index: number; message: { role: "assistant"; content: string | null; tool_calls?: ToolCall[] }; finish_reason: FinishReason; logprobs: unknown }[];
  usage: Usage;
  kvmesh: KvmeshReport | null;
}

export interface CompletionChunk {
  id: string;
  object: "text_completion";
  created: number;
  model: string;
  choices: CompletionChoice[];
  usage?: Usage;
}

export interface ChatCompletionChunk {
  id: string;
  object: "chat.completion.chunk";
  created: number;
  model: string;
  choices: { index: number; delta: { role?: "assistant"; content?: string; tool_calls?: ToolCallDelta[] }; finish_reason: FinishReason; logprobs?: unknown }[];
  /** Only on the last chunk, with `stream_options: {include_usage: true}`. */
  usage?: Usage;
}

export interface Capacity {
  budget_bytes: number;
  used_bytes: number;
  entries: number;
}

export interface NetworkSummary {
  nodes: number;
  heads: number;
  caches: number;
  groups: number;
  /** The model id; with a valid key, its full compatibility card. */
  model: string;
  completed_tokens: number;
  kv_assisted_tokens: number;
  hit_ratio: number | null;
  capacity_bytes: number;
  used_bytes: number;
  uptime_s: number;
  /** True when a valid API key was presented (private detail included). */
  private: boolean;
}

export interface Endpoint {
  address: string;
  interface: string;
  priority: number;
  rtt_ms: number | null;
}

export interface NetworkNode {
  alias: string;
  roles: string[];
  region: string;
  status: "self" | "live" | "stale";
  health: "ok" | "backed off" | "quarantined";
  card_age_s: number;
  epoch_age_s: number;
  interfaces: string[];
  capacity: Capacity;
  hit_ratio: number | null;
  /** Public: how many model namespaces; private: their summaries. */
  models: number | string[];
  /** Private reads only (a valid API key). */
  node_id?: string;
  epoch?: string;
  endpoints?: Endpoint[];
}

export interface Group {
  id: string;
  name: string;
  members: string[];
  description: string;
  created: number;
}

export interface TokenSeriesPoint {
  t: number;
  /** Requests in the window (a public window holds several; an admin sees every one). */
  requests: number;
  completion_tokens: number;
  kv_assisted_tokens: number;
  computed_tokens: number;
}

export interface NetworkTokens {
  completed_tokens: number;
  kv_assisted_tokens: number;
  computed_prompt_tokens: number;
  prompt_tokens: number;
  requests: number;
  series: TokenSeriesPoint[];
}

export interface Transfer {
  peer: string;
  bytes: number;
  seconds: number;
  gbps: number;
  at: number;
  blocks: number;
}

export interface TierStats extends Capacity {
  tier: string;
  hits: number;
  admissions: number;
  evictions: number;
  promotions: number;
  corrupt: number;
  dropped: number;
}

export interface NetworkPrefill {
  requests: number;
  hit_ratio: number | null;
  by_source: Record<KvmeshReport["source"], number>;
  bytes_fetched: number;
  bytes_published: number;
  prefill_seconds_saved: number;
  fallback_reasons: Record<string, number>;
  recent_transfers: Transfer[];
  capacity: (Capacity & { alias: string })[];
  tiers: TierStats[];
}

export interface PairingToken {
  pairing_token: string;
  expires_at: number;
  single_use: true;
}

export interface PairResult {
  seeds: string[];
  fleet_key?: string;
}

export interface Health {
  status: "ok" | "engine_failed";
  model: string;
  namespace: string;
  peers: number;
  compatible_peers: number;
  publish_pending: number;
  queue: { waiting: number; queued_tokens: number; running: number; max: number };
  batch: { sequences: number; max: number };
  error?: string;
}

export interface ModelList {
  object: "list";
  data: { id: string; object: "model"; created: number; owned_by: string }[];
}
