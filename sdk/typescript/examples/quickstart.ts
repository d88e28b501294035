/**
 * The SDK's public API end to end: a live network summary, a streamed chat
 * completion, and the cache at work on a repeated long prompt.
 *
 *   npm run build && node dist/examples/quickstart.js http://127.0.0.1:8000 [model]
 */

import { KvmeshClient } from "../src/index.js";

async function main(baseUrl: string, model: string): Promise<void> {
  const client = new KvmeshClient({ baseUrl, apiKey: process.env.KVMESH_API_KEY });
  const summary = await client.network.summary();
  console.log(`summary: ${summary.nodes} node(s), ${summary.completed_tokens} tokens completed, model ${summary.model}`);

  const prompt = "Explain how a fleet shares the prefill of a long prompt, step by step. ".repeat(12);
  for (const round of ["cold", "warm"]) {
    const stream = await client.chat.completions.create({
      model,
      messages: [{ role: "user", content: prompt }],
      max_tokens: 16,
      stream: true,
      stream_options: { include_usage: true },
    });
    let text = "";
    let chunks = 0;
    let cached = 0;
    let promptTokens = 0;
    for await (const chunk of stream) {
      chunks++;
      text += chunk.choices[0]?.delta.content ?? "";
      if (chunk.usage) {
        cached = chunk.usage.prompt_tokens_details.cached_tokens;
        promptTokens = chunk.usage.prompt_tokens;
      }
    }
    console.log(`${round}: streamed ${chunks} chunks (${JSON.stringify(text.slice(0, 40))}...); cached_tokens ${cached}/${promptTokens} = ${(cached / promptTokens).toFixed(3)}`);
  }
}

main(process.argv[2] ?? "http://127.0.0.1:8000", process.argv[3] ?? "demo-tiny").catch((e: unknown) => {
  console.error(e);
  process.exit(1);
});
