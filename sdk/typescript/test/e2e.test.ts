/**
 * The SDK against a real `kvmesh head` (demo-tiny; see head.ts): network reads and
 * writes, completions and chat, streamed and not, kvmesh's extras, typed errors.
 */

import { describe, expect, inject, it } from "vitest";
import {
  AbortError,
  AuthenticationError,
  BadRequestError,
  KvmeshClient,
  NotFoundError,
  PermissionDeniedError,
  type ChatCompletionChunk,
} from "../src/index.js";

const url = inject("kvmeshUrl");
const key = inject("kvmeshKey");
const pub = new KvmeshClient({ baseUrl: url });
const admin = new KvmeshClient({ baseUrl: url, apiKey: key });
const IP = /\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b/;
const LONG = "Prefill caching lets a fleet of machines reuse the work of reading a long prompt. ".repeat(12);

describe("network", () => {
  it("public reads show aggregates and no addresses; a key adds them", async () => {
    const s = await pub.network.summary();
    expect(s.private).toBe(false);
    expect(s.nodes).toBeGreaterThanOrEqual(1);
    expect(s.heads).toBeGreaterThanOrEqual(1);
    expect(typeof s.model).toBe("string");
    for (const k of ["caches", "groups", "completed_tokens", "kv_assisted_tokens", "capacity_bytes", "used_bytes", "uptime_s"] as const) {
      expect(typeof s[k]).toBe("number");
    }
    const nodes = await pub.network.nodes();
    const me = nodes.find((n) => n.status === "self")!;
    expect(me.roles).toContain("head");
    expect(me.endpoints).toBeUndefined();
    expect(me.capacity.budget_bytes).toBeGreaterThan(0);
    expect(JSON.stringify(nodes)).not.toMatch(IP);
    expect((await admin.network.summary()).private).toBe(true);
    const priv = (await admin.network.nodes()).find((n) => n.status === "self")!;
    expect(priv.endpoints![0]!.address).toMatch(IP);
    expect(typeof priv.node_id).toBe("string");
  });

  it("tokens and prefill follow a completion", async () => {
    const before = await pub.network.tokens();
    // sampled at OpenAI's default temperature, the tiny model may end early (1 of its 259 tokens is EOS)
    const r = await pub.completions.create({ model: "demo-tiny", prompt: "count these tokens", max_tokens: 3 });
    const after = await pub.network.tokens();
    expect(r.usage.completion_tokens).toBeGreaterThanOrEqual(1);
    expect(after.completed_tokens).toBeGreaterThanOrEqual(before.completed_tokens + r.usage.completion_tokens);
    expect(after.requests).toBeGreaterThan(before.requests);
    // a public window shows only several requests together; an admin sees each window
    expect((await admin.network.tokens()).series.length).toBeGreaterThan(0);
    const p = await pub.network.prefill();
    expect(p.requests).toBeGreaterThan(0);
    expect(Object.keys(p.by_source).sort()).toEqual(["compute", "disk", "local", "remote", "session"]);
    expect(p.tiers.length).toBeGreaterThan(0);
    expect(Array.isArray(p.recent_transfers)).toBe(true);
  });

  it("writes need a key: groups created, listed, deleted; pairing tokens issued", async () => {
    const denied = await pub.network.createGroup({ name: "nope" }).catch((e: unknown) => e);
    expect(denied).toBeInstanceOf(AuthenticationError);
    expect((denied as AuthenticationError).code).toBe("invalid_api_key");
    await expect(new KvmeshClient({ baseUrl: url, apiKey: "wrong" }).network.registerNode()).rejects.toBeInstanceOf(AuthenticationError);
    const g = await admin.network.createGroup({ name: "sdk-group", members: ["sdk-head"], description: "from the SDK" });
    expect([g.name, g.members, g.description]).toEqual(["sdk-group", ["sdk-head"], "from the SDK"]);
    expect((await pub.network.groups()).map((x) => x.id)).toContain(g.id);
    await admin.network.deleteGroup(g.id);
    expect((await pub.network.groups()).map((x) => x.id)).not.toContain(g.id);
    await expect(admin.network.deleteGroup(g.id)).rejects.toBeInstanceOf(NotFoundError);
    const bad = await admin.network.createGroup({ name: "" }).catch((e: unknown) => e);
    expect(bad).toBeInstanceOf(BadRequestError);
    expect((bad as BadRequestError).param).toBe("name");
    const t = await admin.network.registerNode();
    expect([t.single_use, t.pairing_token.length > 16, t.expires_at > Date.now() / 1000]).toEqual([true, true, true]);
    const pair = await pub.network.pair({ token: t.pairing_token, alias: "sdk-peer" });
    expect(Array.isArray(pair.seeds)).toBe(true);
    await expect(pub.network.pair({ token: t.pairing_token })).rejects.toBeInstanceOf(PermissionDeniedError);
  });

  it("health and models", async () => {
    expect((await pub.health()).status).toBe("ok");
    expect((await pub.models.list()).data[0]!.id).toBe("demo-tiny");
  });
});

describe("completions", () => {
  it("a repeated long chat prompt is served from the cache, with kvmesh's report", async () => {
    const messages = [{ role: "user" as const, content: LONG }];
    const cold = await pub.chat.completions.create({ model: "demo-tiny", messages, max_tokens: 4, temperature: 0 });
    expect(cold.object).toBe("chat.completion");
    expect(cold.choices[0]!.message.role).toBe("assistant");
    const warm = await pub.chat.completions.create({ model: "demo-tiny", messages, max_tokens: 4, temperature: 0 });
    const { prompt_tokens, prompt_tokens_details } = warm.usage;
    expect(prompt_tokens).toBeGreaterThan(100);
    expect(prompt_tokens_details.cached_tokens).toBeGreaterThanOrEqual(0.9 * prompt_tokens);
    expect(warm.kvmesh!.source).not.toBe("compute");
    expect(warm.kvmesh!.reused_tokens).toBe(prompt_tokens_details.cached_tokens);
    expect(warm.kvmesh!.ttft_s).toBeGreaterThan(0);
    expect(warm.choices[0]!.message.content).toBe(cold.choices[0]!.message.content);
  });

  it("streams chat chunks as an async iterator, usage last", async () => {
    const stream = await pub.chat.completions.create({
      model: "demo-tiny", messages: [{ role: "user", content: LONG }], max_tokens: 6, temperature: 0,
      stream: true, stream_options: { include_usage: true },
    });
    const chunks: ChatCompletionChunk[] = [];
    for await (const c of stream) chunks.push(c);
    expect(chunks[0]!.choices[0]!.delta.role).toBe("assistant");
    expect(chunks.every((c) => c.object === "chat.completion.chunk")).toBe(true);
    const finish = chunks.flatMap((c) => c.choices).find((c) => c.finish_reason);
    expect(finish?.finish_reason).toBe("length");
    const usage = chunks.at(-1)!.usage!;
    expect(usage.completion_tokens).toBe(6);
    expect(usage.prompt_tokens_details.cached_tokens).toBeGreaterThanOrEqual(0.9 * usage.prompt_tokens);
  });

  it("streams a text completion and matches the non-streamed text", async () => {
    const params = { model: "demo-tiny", prompt: "the edge and the head", max_tokens: 5, temperature: 0 };
    const whole = await pub.completions.create(params);
    expect(whole.object).toBe("text_completion");
    let text = "";
    for await (const c of await pub.completions.create({ ...params, stream: true })) text += c.choices[0]?.text ?? "";
    expect(text).toBe(whole.choices[0]!.text);
  });

  it("bad requests are typed errors naming the field", async () => {
    const hot = await pub.chat.completions.create({ model: "demo-tiny", messages: [{ role: "user", content: "x" }], temperature: 7 }).catch((e: unknown) => e);
    expect(hot).toBeInstanceOf(BadRequestError);
    expect((hot as BadRequestError).param).toBe("temperature");
    const missing = await pub.completions.create({ model: "no-such-model", prompt: "x" }).catch((e: unknown) => e);
    expect(missing).toBeInstanceOf(NotFoundError);
    expect((missing as NotFoundError).code).toBe("model_not_found");
    // a streamed request that is refused is refused before its stream: an APIError, not a stream
    await expect(pub.completions.create({ model: "demo-tiny", prompt: "x", max_tokens: 0, stream: true })).rejects.toBeInstanceOf(BadRequestError);
  });

  it("an abort ends a stream mid-way and the head keeps serving", async () => {
    const ac = new AbortController();
    const stream = await pub.completions.create({ model: "demo-tiny", prompt: LONG, max_tokens: 200, ignore_eos: true, stream: true }, { signal: ac.signal });
    let n = 0;
    const e = await (async () => {
      for await (const _ of stream) if (++n === 2) ac.abort();
    })().catch((x: unknown) => x);
    expect(e).toBeInstanceOf(AbortError);
    expect((await pub.health()).status).toBe("ok");
  });
});
