"""The Anthropic Messages API (`POST /v1/messages`) on top of the OpenAI request path.

A Messages request is translated into the chat form serve_protocol.py validates (system
prompt, text, tool_use / tool_result blocks, tools, tool_choice, stop_sequences); the
answer is sent back as Anthropic content blocks, or as its stream events (message_start,
content_block_start/delta/stop, message_delta, message_stop).
"""

import json
import uuid

from .answers import ToolSplitter, split_answer
from .openai import APIError, Request, field_, parse_request, stop_strings

SUPPORTED = {
    "model",
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "metadata",
}
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def error_body(e: APIError) -> dict:
    kind = (
        "authentication_error"
        if e.status == 401
        else "not_found_error"
        if e.status == 404
        else "overloaded_error"
        if e.code == "overloaded"
        else "api_error"
        if e.status >= 500
        else "invalid_request_error"
    )
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise APIError(400, f"{where} must be a string or a list of content blocks", where)
    return content


def _block_text(content, where: str) -> str:
    parts = []
    for b in _blocks(content, where):
        if b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise APIError(
                400, f"{where}: only text blocks are supported here, got {b.get('type')!r}", where
            )
        parts.append(b["text"])
    return "".join(parts)


def _message(m, i) -> list:
    """One Anthropic message as chat messages (tool results become `tool` messages)."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise APIError(400, f"{where}.role must be 'user' or 'assistant'", where)
    text, calls, out = [], [], []
    for j, b in enumerate(_blocks(m.get("content"), f"{where}.content")):
        kind = b.get("type")
        if kind == "text" and isinstance(b.get("text"), str):
            text.append(b["text"])
        elif kind == "tool_use" and m["role"] == "assistant":
            calls.append(
                {
                    "id": b.get("id"),
                    "type": "function",
                    "function": {
                        "name": b.get("name"),
                        "arguments": json.dumps(b.get("input", {})),
                    },
                }
            )
        elif kind == "tool_result" and m["role"] == "user":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": b.get("tool_use_id"),
                    "content": _block_text(b.get("content", ""), f"{where}.content[{j}].content"),
                }
            )
        else:
            raise APIError(
                400,
                f"{where}.content[{j}]: a {kind!r} block is not supported in a {m['role']} message",
                f"{where}.content",
            )
    if text or calls or not out:
        msg = {"role": m["role"], "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_choice(choice):
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    raise APIError(
        400, "'tool_choice' must be {'type': 'auto' | 'any' | 'none' | 'tool'}", "tool_choice"
    )


def parse(body, srv) -> Request:
    """Validate a Messages request into the Request the OpenAI path builds."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    extra = sorted(set(body) - SUPPORTED)
    if extra:
        raise APIError(400, f"not supported by this server: {', '.join(extra)}", extra[0])
    if field_(body, "max_tokens", (int,)) is None:
        raise APIError(400, "'max_tokens' is required", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError(400, "'messages' is required: a non-empty list", "messages")
    chat = [m for i, m in enumerate(msgs) for m in _message(m, i)]
    if body.get("system") is not None:
        chat.insert(0, {"role": "system", "content": _block_text(body["system"], "system")})
    tools = field_(body, "tools", (list,))
    if tools:
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise APIError(
                    400, f"tools[{i}] must be {{name, description, input_schema}}", f"tools[{i}]"
                )
        tools = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object"},
                },
            }
            for t in tools
        ]
    openai = {
        k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "top_k") if k in body
    }
    openai.update(messages=chat, tools=tools, tool_choice=_tool_choice(body.get("tool_choice")))
    req = parse_request(openai, srv.tokenizer, srv.config, True, srv.grammars)
    req.job.stop = stop_strings(body, "stop_sequences", 16)
    req.stream = field_(body, "stream", (bool,), False)
    return req


def _tool_block(call) -> dict:
    args = call["function"]["arguments"]
    try:
        value = json.loads(args)
    except ValueError:
        value = {"text": args}
    return {
        "type": "tool_use",
        "id": "toolu_" + call["id"][5:],
        "name": call["function"]["name"],
        "input": value if isinstance(value, dict) else {"value": value},
    }


def _stop(job, reason, calls):
    if calls and reason == "stop":
        return "tool_use", None
    if reason == "stop" and job.stop_hit is not None:
        return "stop_sequence", job.stop_hit
    return STOP_REASONS[reason], None


def _usage(job, output: int) -> dict:
    return {
        "input_tokens": len(job.prompt) - job.cached_tokens,
        "output_tokens": output,
        "cache_read_input_tokens": job.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _message_head(handler, req) -> dict:
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": handler.server.config.model_name,
    }


def whole(handler, req: Request):
    got = handler.collect(req.job)
    if got is None:
        return
    text, _, _, (_, reason, n) = got
    content, calls = split_answer(req, text)
    blocks = ([{"type": "text", "text": content}] if content else []) + [
        _tool_block(c) for c in calls
    ]
    stop_reason, stop_sequence = _stop(req.job, reason, calls)
    handler.send_json(
        200,
        dict(
            _message_head(handler, req),
            content=blocks,
            stop_reason=stop_reason,
            stop_sequence=stop_sequence,
            usage=_usage(req.job, n),
        ),
    )


class _Blocks:
    """The content-block events of one streamed Messages answer."""

    def __init__(self, handler):
        self.handler, self.index, self.open, self.calls = handler, -1, None, 0

    def send(self, kind, **kw):
        self.handler.send_sse(dict(type=kind, **kw), event=kind)

    def close(self):
        if self.open is not None:
            self.send("content_block_stop", index=self.index)
            self.open = None

    def text(self, value):
        if self.open != "text":
            self.close()
            self.index, self.open = self.index + 1, "text"
            block = {"type": "text", "text": ""}
            self.send("content_block_start", index=self.index, content_block=block)
        delta = {"type": "text_delta", "text": value}
        self.send("content_block_delta", index=self.index, delta=delta)

    def call(self, value):
        self.close()
        self.index, self.calls = self.index + 1, self.calls + 1
        block = _tool_block(value)
        self.send("content_block_start", index=self.index, content_block=dict(block, input={}))
        delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        self.send("content_block_delta", index=self.index, delta=delta)
        self.send("content_block_stop", index=self.index)

    def items(self, pairs):
        for kind, value in pairs:
            if kind == "text" and value:
                self.text(value)
            elif kind == "call":
                self.call(value)


def stream(handler, req: Request):
    handler.start_sse()
    job, out = req.job, _Blocks(handler)
    head = dict(_message_head(handler, req), content=[], stop_reason=None, stop_sequence=None)
    out.send("message_start", message=dict(head, usage=_usage(job, 0)))
    out.send("ping")
    splitter = ToolSplitter(req.tool_markers, req.tools) if req.tools else None
    for event in handler.events(job):
        if event[0] == "text":
            out.items(splitter.feed(event[1]) if splitter else [("text", event[1])])
        elif event[0] == "error":
            handler.send_sse(error_body(APIError(500, event[1])), event="error")
            return
        elif event[0] == "done":
            if splitter:
                out.items(splitter.flush())
            out.close()
            stop_reason, stop_sequence = _stop(job, event[1], out.calls)
            out.send(
                "message_delta",
                delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                usage={"output_tokens": event[2]},
            )
            out.send("message_stop")
