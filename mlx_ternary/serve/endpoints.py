"""The endpoints beside the APIs: tokenize, detokenize, tokenizer info, metrics, the chat page.

`/tokenize` and `/detokenize` take both shapes clients send: llama-server's (`content` ->
`tokens`, `tokens` -> `content`) and vLLM's (`prompt` -> `tokens` with `count` and
`max_model_len`, `tokens` -> `prompt`); `/tokenizer_info` is vLLM's (what lm-eval's remote
tokenizer reads). Each route is `route(handler)`; http.py lists them in its table.
"""

from functools import lru_cache
from pathlib import Path

from .openai import APIError, check_model, completion_prompt, field_

CHAT_PAGE = Path(__file__).with_name("chat.html")  # one static file: no build step, no CDN


def _encode(h, body) -> list:
    tok = h.server.tokenizer
    if "content" in body:  # llama-server: special tokens off unless asked
        text, special = body["content"], field_(body, "add_special", (bool,), False)
    else:  # vLLM: on unless turned off
        text, special = body.get("prompt"), field_(body, "add_special_tokens", (bool,), True)
    if not isinstance(text, str):
        raise APIError(400, "'content' (or 'prompt') must be a string", "content")
    return list(tok.encode(text, add_special_tokens=special))


def tokenize(h):
    body = h.read_body()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, h.server.config)
    tokens = _encode(h, body)
    if "content" in body:
        out = {"tokens": tokens}
        if field_(body, "with_pieces", (bool,), False):
            out["tokens"] = [{"id": t, "piece": h.server.tokenizer.decode([t])} for t in tokens]
        h.send_json(200, out)
    else:
        limit = h.server.config.max_context
        h.send_json(200, {"count": len(tokens), "max_model_len": limit, "tokens": tokens})


def detokenize(h):
    body = h.read_body()
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, h.server.config)
    tokens = body.get("tokens")
    if tokens == []:
        text = ""
    else:
        if not isinstance(tokens, list):
            raise APIError(400, "'tokens' must be a list of token ids", "tokens")
        text = h.server.tokenizer.decode(completion_prompt(h.server.tokenizer, tokens))
    h.send_json(200, {"content": text, "prompt": text})  # llama-server's key, vLLM's key


def tokenizer_info(h):
    tok = h.server.tokenizer
    hf = getattr(tok, "_tokenizer", tok)
    info = {
        "tokenizer_class": type(hf).__name__,
        "eos_token": getattr(hf, "eos_token", None),
        "bos_token": getattr(hf, "bos_token", None),
        "pad_token": getattr(hf, "pad_token", None),
        "unk_token": getattr(hf, "unk_token", None),
        "chat_template": getattr(hf, "chat_template", None),
        "model_max_length": h.server.config.max_context,
    }
    h.send_json(200, info)


def metrics(h):
    data = h.server.metrics.render(h.server.engine).encode()
    h.send_response(200)
    h.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


@lru_cache(maxsize=1)
def _page() -> bytes:
    return CHAT_PAGE.read_bytes()


def chat_page(h):
    """`GET /`: the chat page (it asks for the API key itself, so it is served without)."""
    data = _page()
    h.send_response(200)
    h.send_header("Content-Type", "text/html; charset=utf-8")
    h.send_header("Content-Length", str(len(data)))
    h.send_header("Content-Security-Policy", "default-src 'self' 'unsafe-inline'")
    h.end_headers()
    h.wfile.write(data)
