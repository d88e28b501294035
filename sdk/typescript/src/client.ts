/**
 * `KvmeshClient`: a typed client for a kvmesh head's HTTP API, built only on `fetch`
 * (Node >= 18, browsers, Deno, Workers).
 *
 * Contract:
 * - every route it calls is a `(path, method)` of the server's OpenAPI schema
 *   (`ROUTES`, checked by the compiler and against a live head by the tests);
 * - a 429 or 503 is retried up to `maxRetries` times with exponential backoff, or
 *   after the server's `Retry-After` when it sends one (capped at `maxRetryAfterMs`:
 *   a longer wait is the caller's decision, so the error is raised instead); a
 *   connection failure is retried for reads (GET/DELETE) only;
 * - `timeoutMs` bounds each attempt up to the full body (a stream: up to its headers);
 *   the caller's `AbortSignal` ends the request, its retries and its stream;
 * - an error status is an `APIError` subclass carrying the server's body.
 */

import {
  AbortError,
  APIError,
  ConnectionError,
  KvmeshError,
  TimeoutError,
  apiError,
} from "./errors.js";
import type { paths } from "./openapi.js";
import { jsonChunks } from "./sse.js";
import type {
  ChatCompletion,
  ChatCompletionChunk,
  ChatCompletionCreateParams,
  Completion,
  CompletionChunk,
  CompletionCreateParams,
  Group,
  GroupCreateParams,
  Health,
  ModelList,
  NetworkNode,
  NetworkPrefill,
  NetworkSummary,
  NetworkTokens,
  PairingToken,
  PairParams,
  PairResult,
} from "./types.js";

type Method = "get" | "post" | "delete";
type Route = { [P in keyof paths]: { [M in Method]: paths[P][M] extends undefined ? never : { path: P; method: M } }[Method] }[keyof paths];

/** Every route the SDK calls; a path or method the schema lacks does not compile. */
export const ROUTES = {
  health: { path: "/healthz", method: "get" },
  models: { path: "/v1/models", method: "get" },
  completions: { path: "/v1/completions", method: "post" },
  chat: { path: "/v1/chat/completions", method: "post" },
  summary: { path: "/v1/network/summary", method: "get" },
  nodes: { path: "/v1/network/nodes", method: "get" },
  groups: { path: "/v1/network/groups", method: "get" },
  tokens: { path: "/v1/network/tokens", method: "get" },
  prefill: { path: "/v1/network/prefill", method: "get" },
  createGroup: { path: "/v1/network/groups", method: "post" },
  deleteGroup: { path: "/v1/network/groups/{gid}", method: "delete" },
  registerNode: { path: "/v1/network/nodes/register", method: "post" },
  pair: { path: "/v1/network/pair", method: "post" },
} as const satisfies Record<string, Route>;

export type Fetch = (input: string, init: RequestInit) => Promise<Response>;

export interface ClientOptions {
  /** The head's URL, e.g. `http://127.0.0.1:8000` (or an edge in front of it). */
  baseUrl: string;
  /** Sent as `Authorization: Bearer`: network writes and private reads need one. */
  apiKey?: string;
  fetch?: Fetch;
  /** Per attempt; default 60 s. */
  timeoutMs?: number;
  /** Retries of a 429/503 (and of a failed connection for reads); default 2. */
  maxRetries?: number;
  /** The longest `Retry-After` honoured; default 60 s. */
  maxRetryAfterMs?: number;
  /** First backoff without `Retry-After`; doubled each retry; default 500 ms. */
  backoffMs?: number;
  headers?: Record<string, string>;
  /** Called before each retry with the wait chosen (for logs and tests). */
  onRetry?: (info: RetryInfo) => void;
}

export interface RetryInfo {
  attempt: number;
  status: number | null;
  waitMs: number;
}

export interface RequestOptions {
  signal?: AbortSignal;
  timeoutMs?: number;
  maxRetries?: number;
  headers?: Record<string, string>;
}

const MAX_BACKOFF_MS = 8000;

/** Milliseconds a `Retry-After` header asks for (seconds or an HTTP date), or undefined. */
export function retryAfterMs(header: string | null, now = Date.now()): number | undefined {
  if (header === null || header.trim() === "") return undefined;
  const s = header.trim();
  if (/^\d+(\.\d+)?$/.test(s)) return Math.round(Number(s) * 1000);
  if (!/[a-z]/i.test(s)) return undefined; // neither seconds nor an HTTP date
  const at = Date.parse(s);
  return Number.isNaN(at) ? undefined : Math.max(0, at - now);
}

function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal?.aborted) return reject(new AbortError("aborted"));
    const onAbort = (): void => {
      clearTimeout(t);
      reject(new AbortError("aborted"));
    };
    const t = setTimeout(() => {
      signal?.removeEventListener("abort", onAbort);
      resolve();
    }, ms);
    signal?.addEventListener("abort", onAbort, { once: true });
  });
}

/** An async iterator of a stream's chunks; `abort()` (or the caller's signal) ends it. */
export class Stream<T> implements AsyncIterable<T> {
  constructor(
    private readonly chunks: AsyncGenerator<T>,
    private readonly controller: AbortController,
  ) {}

  [Symbol.asyncIterator](): AsyncIterator<T> {
    return this.chunks;
  }

  abort(): void {
    this.controller.abort();
  }
}

export class KvmeshClient {
  readonly baseUrl: string;
  private readonly options: Required<Omit<ClientOptions, "apiKey" | "fetch" | "baseUrl" | "onRetry">> & Pick<ClientOptions, "apiKey" | "onRetry">;
  private readonly fetchImpl: Fetch;
  readonly network: NetworkAPI;
  readonly completions: CompletionsAPI;
  readonly chat: { completions: ChatCompletionsAPI };
  readonly models: { list: (o?: RequestOptions) => Promise<ModelList> };

  constructor(options: ClientOptions) {
    let url: URL;
    try {
      url = new URL(options.baseUrl);
    } catch {
      throw new KvmeshError(`baseUrl is not a URL: ${JSON.stringify(options.baseUrl)}`);
    }
    if (url.protocol !== "http:" && url.protocol !== "https:") {
      throw new KvmeshError(`baseUrl must be http(s): ${options.baseUrl}`);
    }
    this.baseUrl = url.href.replace(/\/+$/, "");
    const f = options.fetch ?? globalThis.fetch;
    this.fetchImpl = (input, init) => f(input, init); // unbound fetch throws in browsers and Workers
    this.options = {
      apiKey: options.apiKey,
      onRetry: options.onRetry,
      timeoutMs: options.timeoutMs ?? 60_000,
      maxRetries: options.maxRetries ?? 2,
      maxRetryAfterMs: options.maxRetryAfterMs ?? 60_000,
      backoffMs: options.backoffMs ?? 500,
      headers: options.headers ?? {},
    };
    this.network = new NetworkAPI(this);
    this.completions = new CompletionsAPI(this);
    this.chat = { completions: new ChatCompletionsAPI(this) };
    this.models = { list: (o) => this.json(ROUTES.models.path, "GET", undefined, o) };
  }

  health(o?: RequestOptions): Promise<Health> {
    return this.json(ROUTES.health.path, "GET", undefined, o);
  }

  /** A JSON request; the parsed body of a 2xx (undefined for 204). */
  async json<T>(path: string, method: string, body?: unknown, o: RequestOptions = {}): Promise<T> {
    const { response, done, timedOut } = await this.request(path, method, body, o, false);
    try {
      if (response.status === 204) return undefined as T;
      const text = await response.text();
      try {
        return JSON.parse(text) as T;
      } catch (cause) {
        throw new KvmeshError(`${method} ${path}: the answer is not JSON`, { cause });
      }
    } catch (e) {
      throw mapFailure(e, o.signal, timedOut());
    } finally {
      done();
    }
  }

  /** A streaming request: the chunks of its server-sent events. */
  async stream<T>(path: string, body: unknown, o: RequestOptions = {}): Promise<Stream<T>> {
    const { response, done, controller } = await this.request(path, "POST", body, o, true);
    const signal = o.signal;
    async function* chunks(): AsyncGenerator<T> {
      try {
        if (!response.body) throw new KvmeshError("the stream has no body");
        for await (const chunk of jsonChunks<T>(response.body)) {
          // a chunk already read when abort() or the caller's signal came is not given
          if (controller.signal.aborted) throw new AbortError("aborted");
          yield chunk;
        }
      } catch (e) {
        throw controller.signal.aborted && !(e instanceof KvmeshError) ? new AbortError("aborted") : mapFailure(e, signal);
      } finally {
        done();
      }
    }
    return new Stream(chunks(), controller);
  }

  /** One request with its retries; resolves with a 2xx response. `done` releases its timers. */
  async request(
    path: string,
    method: string,
    body: unknown,
    o: RequestOptions,
    streaming: boolean,
  ): Promise<{ response: Response; done: () => void; controller: AbortController; timedOut: () => boolean }> {
    const maxRetries = o.maxRetries ?? this.options.maxRetries;
    const headers: Record<string, string> = { Accept: streaming ? "text/event-stream" : "application/json", ...this.options.headers, ...o.headers };
    if (this.options.apiKey) headers.Authorization = `Bearer ${this.options.apiKey}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const payload = body === undefined ? undefined : JSON.stringify(body);
    for (let attempt = 0; ; attempt++) {
      const controller = new AbortController();
      const onAbort = (): void => controller.abort();
      if (o.signal?.aborted) throw new AbortError("aborted");
      o.signal?.addEventListener("abort", onAbort, { once: true });
      let timedOut = false;
      const timer = setTimeout(() => {
        timedOut = true;
        controller.abort();
      }, o.timeoutMs ?? this.options.timeoutMs);
      const done = (): void => {
        clearTimeout(timer);
        o.signal?.removeEventListener("abort", onAbort);
      };
      let response: Response;
      try {
        response = await this.fetchImpl(this.baseUrl + path, { method, headers, body: payload, signal: controller.signal });
      } catch (cause) {
        done();
        if (o.signal?.aborted) throw new AbortError("aborted", { cause });
        if (timedOut) throw new TimeoutError(`${method} ${path}: no answer in ${o.timeoutMs ?? this.options.timeoutMs} ms`, { cause });
        const err = new ConnectionError(`${method} ${path}: ${String((cause as Error)?.message ?? cause)}`, { cause });
        if (method === "POST" || attempt >= maxRetries) throw err;
        await this.pause(attempt, null, undefined, o.signal);
        continue;
      }
      if (response.ok) {
        if (streaming) clearTimeout(timer); // a stream runs as long as it generates
        return { response, done, controller, timedOut: () => timedOut };
      }
      let err: APIError;
      try {
        err = apiError(response.status, await errorBody(response), response.headers);
      } catch (e) {
        throw mapFailure(e, o.signal, timedOut);
      } finally {
        done();
      }
      const wait = retryAfterMs(response.headers.get("Retry-After"));
      const retryable = response.status === 429 || response.status === 503;
      if (!retryable || attempt >= maxRetries || (wait !== undefined && wait > this.options.maxRetryAfterMs)) throw err;
      await this.pause(attempt, response.status, wait, o.signal);
    }
  }

  private pause(attempt: number, status: number | null, retryAfter: number | undefined, signal?: AbortSignal): Promise<void> {
    let waitMs = retryAfter;
    if (waitMs === undefined) {
      const base = Math.min(MAX_BACKOFF_MS, this.options.backoffMs * 2 ** attempt);
      waitMs = base / 2 + Math.random() * (base / 2); // jitter: clients refused together do not return together
    }
    this.options.onRetry?.({ attempt: attempt + 1, status, waitMs });
    return sleep(waitMs, signal);
  }
}

async function errorBody(response: Response): Promise<unknown> {
  const text = await response.text();
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function mapFailure(e: unknown, signal?: AbortSignal, timedOut = false): unknown {
  if (e instanceof KvmeshError) return e;
  if (signal?.aborted) return new AbortError("aborted", { cause: e });
  if (timedOut) return new TimeoutError("timed out reading the answer", { cause: e });
  return new ConnectionError(String((e as Error)?.message ?? e), { cause: e });
}

export class NetworkAPI {
  constructor(private readonly client: KvmeshClient) {}

  summary(o?: RequestOptions): Promise<NetworkSummary> {
    return this.client.json(ROUTES.summary.path, "GET", undefined, o);
  }

  async nodes(o?: RequestOptions): Promise<NetworkNode[]> {
    return (await this.client.json<{ nodes: NetworkNode[] }>(ROUTES.nodes.path, "GET", undefined, o)).nodes;
  }

  async groups(o?: RequestOptions): Promise<Group[]> {
    return (await this.client.json<{ groups: Group[] }>(ROUTES.groups.path, "GET", undefined, o)).groups;
  }

  tokens(o?: RequestOptions): Promise<NetworkTokens> {
    return this.client.json(ROUTES.tokens.path, "GET", undefined, o);
  }

  prefill(o?: RequestOptions): Promise<NetworkPrefill> {
    return this.client.json(ROUTES.prefill.path, "GET", undefined, o);
  }

  /** Needs the client's `apiKey`. */
  createGroup(group: GroupCreateParams, o?: RequestOptions): Promise<Group> {
    return this.client.json(ROUTES.createGroup.path, "POST", group, o);
  }

  /** Needs the client's `apiKey`; a group that does not exist is a `NotFoundError`. */
  async deleteGroup(id: string, o?: RequestOptions): Promise<void> {
    await this.client.json(ROUTES.deleteGroup.path.replace("{gid}", encodeURIComponent(id)), "DELETE", undefined, o);
  }

  /** A single-use pairing token for a new peer (`kvmesh peer --join ... --pairing-token`). Needs `apiKey`. */
  registerNode(o?: RequestOptions): Promise<PairingToken> {
    return this.client.json(ROUTES.registerNode.path, "POST", undefined, o);
  }

  /** Redeems a pairing token (what `kvmesh peer --join` does). */
  pair(params: PairParams, o?: RequestOptions): Promise<PairResult> {
    return this.client.json(ROUTES.pair.path, "POST", params, o);
  }
}

export class CompletionsAPI {
  constructor(private readonly client: KvmeshClient) {}

  create(params: CompletionCreateParams & { stream: true }, o?: RequestOptions): Promise<Stream<CompletionChunk>>;
  create(params: CompletionCreateParams & { stream?: false | null }, o?: RequestOptions): Promise<Completion>;
  create(params: CompletionCreateParams, o?: RequestOptions): Promise<Completion | Stream<CompletionChunk>>;
  create(params: CompletionCreateParams, o?: RequestOptions): Promise<Completion | Stream<CompletionChunk>> {
    return params.stream ? this.client.stream(ROUTES.completions.path, params, o) : this.client.json(ROUTES.completions.path, "POST", params, o);
  }
}

export class ChatCompletionsAPI {
  constructor(private readonly client: KvmeshClient) {}

  create(params: ChatCompletionCreateParams & { stream: true }, o?: RequestOptions): Promise<Stream<ChatCompletionChunk>>;
  create(params: ChatCompletionCreateParams & { stream?: false | null }, o?: RequestOptions): Promise<ChatCompletion>;
  create(params: ChatCompletionCreateParams, o?: RequestOptions): Promise<ChatCompletion | Stream<ChatCompletionChunk>>;
  create(params: ChatCompletionCreateParams, o?: RequestOptions): Promise<ChatCompletion | Stream<ChatCompletionChunk>> {
    return params.stream ? this.client.stream(ROUTES.chat.path, params, o) : this.client.json(ROUTES.chat.path, "POST", params, o);
  }
}
