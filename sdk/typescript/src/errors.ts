/**
 * Typed errors. Every failure the client raises is a `KvmeshError`:
 * - `APIError` (and a subclass per status) when the server answered with an error
 *   status; it carries the status, the parsed error body and the headers;
 * - `StreamError` when a stream that began with 200 ends with an error event;
 * - `ConnectionError` when no answer came (refused, reset, DNS);
 * - `TimeoutError` when `timeoutMs` passed first; `AbortError` when the caller's
 *   `AbortSignal` fired.
 */

/** The server's OpenAI-style error object (`{"error": {...}}`). */
export interface ErrorObject {
  message: string;
  type?: string;
  param?: string | null;
  code?: string | null;
}

export class KvmeshError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

export class APIError extends KvmeshError {
  readonly status: number;
  /** The parsed JSON body, or the raw text when the body was not JSON. */
  readonly body: unknown;
  readonly error: ErrorObject | undefined;
  readonly headers: Headers;

  constructor(status: number, body: unknown, headers: Headers) {
    const error = errorObject(body);
    super(`${status} ${error?.message ?? (typeof body === "string" && body ? body : "error")}`);
    this.status = status;
    this.body = body;
    this.error = error;
    this.headers = headers;
  }

  /** The server's machine-readable code (e.g. `invalid_api_key`, `queue_full`). */
  get code(): string | null | undefined {
    return this.error?.code;
  }

  /** The request field the server blamed, when it named one. */
  get param(): string | null | undefined {
    return this.error?.param;
  }
}

export class BadRequestError extends APIError {}
export class AuthenticationError extends APIError {}
export class PermissionDeniedError extends APIError {}
export class NotFoundError extends APIError {}
export class RateLimitError extends APIError {}
export class InternalServerError extends APIError {}
export class ServiceUnavailableError extends APIError {}

const BY_STATUS: Record<number, typeof APIError> = {
  400: BadRequestError,
  401: AuthenticationError,
  403: PermissionDeniedError,
  404: NotFoundError,
  429: RateLimitError,
  500: InternalServerError,
  503: ServiceUnavailableError,
};

/** The error class for an HTTP status (APIError for the ones without their own). */
export function apiError(status: number, body: unknown, headers: Headers): APIError {
  const cls = BY_STATUS[status] ?? APIError;
  return new cls(status, body, headers);
}

export class StreamError extends KvmeshError {
  readonly error: ErrorObject;
  constructor(error: ErrorObject) {
    super(`stream failed: ${error.message}`);
    this.error = error;
  }
}

export class ConnectionError extends KvmeshError {}
export class TimeoutError extends KvmeshError {}
export class AbortError extends KvmeshError {}

export function errorObject(body: unknown): ErrorObject | undefined {
  if (typeof body !== "object" || body === null) return undefined;
  const e = (body as { error?: unknown }).error;
  if (typeof e !== "object" || e === null) return undefined;
  const msg = (e as { message?: unknown }).message;
  return typeof msg === "string" ? (e as ErrorObject) : undefined;
}
