/** A real HTTP server on loopback whose answers a test scripts, one handler per request. */

import { createServer, type IncomingMessage, type ServerResponse } from "node:http";
import type { AddressInfo } from "node:net";

export type Handler = (req: IncomingMessage, res: ServerResponse, body: string) => void;

export interface Scripted {
  url: string;
  /** Requests seen: method, path, headers, body. */
  seen: { method: string; path: string; headers: IncomingMessage["headers"]; body: string }[];
  close: () => Promise<void>;
}

/** Answers the n-th request with `handlers[n]` (the last one repeats). */
export async function scripted(...handlers: Handler[]): Promise<Scripted> {
  const seen: Scripted["seen"] = [];
  const server = createServer((req, res) => {
    let body = "";
    req.on("data", (c: Buffer) => (body += c.toString()));
    req.on("end", () => {
      seen.push({ method: req.method!, path: req.url!, headers: req.headers, body });
      handlers[Math.min(seen.length, handlers.length) - 1]!(req, res, body);
    });
  });
  await new Promise<void>((r) => server.listen(0, "127.0.0.1", r));
  const { port } = server.address() as AddressInfo;
  return {
    url: `http://127.0.0.1:${port}`,
    seen,
    close: () =>
      new Promise<void>((r) => {
        server.closeAllConnections();
        server.close(() => r());
      }),
  };
}

export const json =
  (status: number, body: unknown, headers: Record<string, string> = {}): Handler =>
  (_req, res) => {
    res.writeHead(status, { "Content-Type": "application/json", ...headers });
    res.end(JSON.stringify(body));
  };

export const raw =
  (status: number, text: string, headers: Record<string, string> = {}): Handler =>
  (_req, res) => {
    res.writeHead(status, headers);
    res.end(text);
  };

/** Writes `parts` one by one (an SSE body cut at arbitrary places), then ends unless `hang`. */
export const sse =
  (parts: string[], hang = false): Handler =>
  (_req, res) => {
    res.writeHead(200, { "Content-Type": "text/event-stream" });
    let i = 0;
    const next = (): void => {
      if (i < parts.length) {
        res.write(parts[i++]);
        setTimeout(next, 2);
      } else if (!hang) res.end();
    };
    next();
  };

export const hangUp: Handler = (req) => req.socket.destroy();
export const never: Handler = () => undefined;

export const apiErr = (message: string, code: string | null = null, param: string | null = null) => ({
  error: { message, type: "invalid_request_error", param, code },
});
