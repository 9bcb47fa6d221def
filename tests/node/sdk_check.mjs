// The official OpenAI Node SDK against a running kvgate: chat and responses, streamed and not.
// Usage: node sdk_check.mjs <base_url> <model> <api_key>
// Prints one JSON object with what the SDK parsed; tests/test_node_sdk.py judges it.
import OpenAI from "openai";

const [baseURL, model, apiKey] = process.argv.slice(2);
const client = new OpenAI({ baseURL, apiKey, maxRetries: 0 });
const out = {};

const chat = await client.chat.completions.create({
  model, messages: [{ role: "user", content: "Say hello." }], max_tokens: 5,
});
out.chat = { content: chat.choices[0].message.content, finish: chat.choices[0].finish_reason,
             completion_tokens: chat.usage.completion_tokens };

const chatStream = await client.chat.completions.create({
  model, messages: [{ role: "user", content: "Stream hello." }], max_tokens: 6, stream: true,
});
const deltas = [];
let chatFinish = null;
for await (const chunk of chatStream) {
  for (const choice of chunk.choices) {
    if (choice.delta.content) deltas.push(choice.delta.content);
    if (choice.finish_reason) chatFinish = choice.finish_reason;
  }
}
out.chat_stream = { chunks: deltas.length, text: deltas.join(""), finish: chatFinish };

const first = await client.responses.create({
  model, input: "Read the README.", instructions: "You are terse.", max_output_tokens: 6,
});
out.responses = { id: first.id, status: first.status, text: first.output_text,
                  output_tokens: first.usage.output_tokens };

const stream = await client.responses.create({
  model, input: "Continue.", instructions: "You are terse.", previous_response_id: first.id, stream: true,
});
const types = [];
const text = [];
let completed = null;
for await (const event of stream) {
  types.push(event.type);
  if (event.type === "response.output_text.delta") text.push(event.delta);
  if (event.type === "response.completed") completed = event.response;
}
out.responses_stream = { types, text: text.join(""), id: completed?.id,
                         previous_response_id: completed?.previous_response_id,
                         cached_tokens: completed?.usage?.input_tokens_details?.cached_tokens,
                         output_text: completed?.output_text ?? completed?.output?.[0]?.content?.[0]?.text };

const got = await client.responses.retrieve(completed.id);
out.retrieved = { id: got.id, status: got.status };

try {
  await client.responses.retrieve("resp_kg1.forged.id.tag");
  out.forged = { status: 200 };
} catch (err) {
  out.forged = { status: err.status, code: err.code, name: err.constructor.name };
}

console.log(JSON.stringify(out));
