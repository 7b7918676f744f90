// llama.cpp's side of scripts/bench/llamacpp_check.py, through node-llama-cpp (CPU build).
//
//   node scripts/bench/llamacpp_check.mjs NODE_MODULES_DIR REQUEST.json
//
// REQUEST: {"model": "x.gguf", "prompt_ids": [...], "max_tokens": 40,
//           "strings": ["I'll", ...], "teacher_ids": [...], "threads": 2}
// Prints one JSON object: llama.cpp's ids for each string (no BOS, special tokens
// not parsed), its greedy continuation of prompt_ids, the argmax it predicts after
// each teacher_ids prefix, and the generation speed.
import {readFileSync} from "node:fs";
import {join} from "node:path";
import {pathToFileURL} from "node:url";

const [nodeModules, requestFile] = process.argv.slice(2);
if (!nodeModules || !requestFile) {
    console.error("usage: node llamacpp_check.mjs NODE_MODULES_DIR REQUEST.json");
    process.exit(2);
}
const {getLlama} = await import(pathToFileURL(join(nodeModules, "node-llama-cpp", "dist", "index.js")).href);
const req = JSON.parse(readFileSync(requestFile, "utf8"));

const llama = await getLlama({gpu: false, build: "never", logLevel: "error"});
const model = await llama.loadModel({modelPath: req.model});
const out = {tokenized: {}, generated: [], teacher_argmax: []};
for (const s of req.strings ?? [])
    out.tokenized[s] = Array.from(model.tokenize(s, false));

const context = await model.createContext({contextSize: 512, threads: req.threads ?? 2, batchSize: 512});

// Greedy continuation of the prompt.
let sequence = context.getSequence();
const start = process.hrtime.bigint();
let first = null;
for await (const token of sequence.evaluate(req.prompt_ids, {temperature: 0})) {
    if (first === null) first = process.hrtime.bigint();
    out.generated.push(token);
    if (out.generated.length >= req.max_tokens) break;
}
const end = process.hrtime.bigint();
out.prompt_and_first_token_s = Number(first - start) / 1e9;
out.decode_tokens_per_s = (out.generated.length - 1) / (Number(end - first) / 1e9);
sequence.dispose();

// Teacher forcing: llama.cpp's argmax after every prefix of teacher_ids.
if (req.teacher_ids?.length) {
    sequence = context.getSequence();
    const items = req.teacher_ids.map(t => [t, {generateNext: {token: true, options: {temperature: 0}}}]);
    const res = await sequence.controlledEvaluate(items);
    out.teacher_argmax = res.map(r => r?.next?.token ?? null);
    sequence.dispose();
}
await context.dispose();
await model.dispose();
console.log(JSON.stringify(out));
