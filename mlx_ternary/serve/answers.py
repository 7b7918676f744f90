"""OpenAI answers: generated text and token records back into OpenAI's shapes.

`whole` and `stream` send a chat or completions answer through the HTTP handler `h` (its
`collect`, `events`, `send_json`, `send_sse`); `ToolSplitter` splits tool calls out of the
text as it streams; the logprobs objects and `usage` are OpenAI's.
"""

import json
import time
import uuid

from .engine import Job
from .openai import APIError, Request, new_call_id


class ToolSplitter:
    """Splits generated text into content and tool calls as it streams in."""

    def __init__(self, markers, tools):
        self.start, self.end, self.parse = markers
        self.tools, self.buf, self.inside = tools, "", False
        self.calls = 0

    def feed(self, text: str) -> list:
        """Items ("text", str) and ("call", {"id", "type", "function"}) ready to send."""
        self.buf += text
        out = []
        while True:
            mark = self.end if self.inside else self.start
            i = self.buf.find(mark)
            if i < 0:
                break
            if self.inside:
                out.append(("call", self._call(self.buf[:i])))
            elif i:
                out.append(("text", self.buf[:i]))
            self.buf, self.inside = self.buf[i + len(mark) :], not self.inside
        if not self.inside:  # send all but a possible start of the start marker
            hold = next(
                (
                    n
                    for n in range(min(len(self.start) - 1, len(self.buf)), 0, -1)
                    if self.buf.endswith(self.start[:n])
                ),
                0,
            )
            if len(self.buf) > hold:
                out.append(("text", self.buf[: len(self.buf) - hold]))
                self.buf = self.buf[len(self.buf) - hold :]
        return out

    def flush(self) -> list:
        """What is left at the end; an unfinished call stays text."""
        rest = (self.start if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [("text", rest)] if rest else []

    def _call(self, text: str) -> dict:
        try:
            parsed = self.parse(text, self.tools)
        except Exception:  # what the model wrote is not a call: keep it visible
            parsed = {"name": "", "arguments": text}
        args = parsed.get("arguments", {})
        self.calls += 1
        return {
            "id": new_call_id(),
            "type": "function",
            "function": {
                "name": parsed.get("name", ""),
                "arguments": args if isinstance(args, str) else json.dumps(args),
            },
        }


def split_answer(req: Request, text: str):
    """(content or None, [tool calls]) of a whole answer."""
    if not req.tools:
        return text, []
    splitter = ToolSplitter(req.tool_markers, req.tools)
    items = splitter.feed(text) + splitter.flush()
    content = "".join(s for kind, s in items if kind == "text")
    calls = [c for kind, c in items if kind == "call"]
    return (content.strip() or None) if calls else content, calls


def _token_str(tokenizer, tid: int) -> str:
    return tokenizer.decode([tid])


def chat_logprobs(tokenizer, records) -> dict:
    def entry(tid, lp):
        s = _token_str(tokenizer, tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            dict(entry(r["id"], r["logprob"]), top_logprobs=[entry(i, v) for i, v in r["top"]])
            for r in records
        ]
    }


def completion_logprobs(tokenizer, records, offset: int = 0, first=None) -> dict:
    """OpenAI's legacy logprobs object; `first`: a leading prompt token with no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    rows = ([(first, None, None)] if first is not None else []) + [
        (r["id"], r["logprob"], {_token_str(tokenizer, i): v for i, v in r["top"]}) for r in records
    ]
    for tid, lp, top in rows:
        s = _token_str(tokenizer, tid)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(s)
    return out


def usage(job: Job, completion: int) -> dict:
    n = len(job.prompt)
    return {
        "prompt_tokens": n,
        "completion_tokens": completion,
        "total_tokens": n + completion,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def whole(h, req: Request):
    got = h.collect(req.job)
    if got is None:
        return  # the client went away
    text, records, prompt_records, (_, reason, n) = got
    tok, job = h.server.tokenizer, req.job
    if req.chat:
        content, calls = split_answer(req, text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
            reason = "tool_calls" if reason == "stop" else reason
        choice = {
            "index": 0,
            "message": message,
            "logprobs": chat_logprobs(tok, records) if job.logprobs is not None else None,
        }
    else:
        choice = {
            "index": 0,
            "text": req.echo_text + text,
            "logprobs": _completion_logprobs(h, req, records, prompt_records),
        }
    choice["finish_reason"] = reason
    h.send_json(
        200,
        {
            "id": _rid(req.chat),
            "created": int(time.time()),
            "object": "chat.completion" if req.chat else "text_completion",
            "model": h.server.config.model_name,
            "choices": [choice],
            "usage": usage(job, n),
        },
    )


def _completion_logprobs(h, req, records, prompt_records, offset=None):
    job, tok = req.job, h.server.tokenizer
    if job.logprobs is None:
        return None
    if prompt_records is not None and job.echo:
        lead = completion_logprobs(tok, prompt_records, 0, first=job.prompt[0])
        rest = completion_logprobs(tok, records, len(req.echo_text))
        return {k: lead[k] + rest[k] for k in lead}
    return completion_logprobs(tok, records, len(req.echo_text) if offset is None else offset)


class _Stream:
    """The SSE chunks of one streamed chat or completions answer."""

    def __init__(self, h, req: Request):
        self.h, self.req, self.job, self.tok = h, req, req.job, h.server.tokenizer
        self.rid, self.created = _rid(req.chat), int(time.time())
        self.splitter = ToolSplitter(req.tool_markers, req.tools) if req.tools else None
        self.offset = self.calls = 0

    def send(self, choice=None, use=None):
        chunk = {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.req.chat else "text_completion",
            "created": self.created,
            "model": self.h.server.config.model_name,
            "choices": [choice] if choice else [],
        }
        if use:
            chunk["usage"] = use
        self.h.send_sse(chunk)

    def text_chunk(self, text, records, reason=None):
        on = self.job.logprobs is not None
        if self.req.chat:
            lp = chat_logprobs(self.tok, records) if on else None
            return {"index": 0, "delta": {"content": text}, "logprobs": lp, "finish_reason": reason}
        lp = completion_logprobs(self.tok, records, self.offset) if on else None
        self.offset += len(text)
        return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

    def items(self, items, records):
        for kind, value in items:
            if kind == "text":
                self.send(self.text_chunk(value, records))
            else:
                delta = {"tool_calls": [dict(value, index=self.calls)]}
                self.calls += 1
                self.send({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
            records = []
        if records:
            self.send(self.text_chunk("", records))

    def text(self, text, records):
        if not self.req.chat:
            self.send(self.text_chunk(text, records))
        else:
            self.items(self.splitter.feed(text) if self.splitter else [("text", text)], records)

    def finish(self, reason, n):
        if self.splitter:
            self.items(self.splitter.flush(), [])
        reason = "tool_calls" if self.calls and reason == "stop" else reason
        if self.req.chat:
            self.send({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason})
        else:
            self.send(self.text_chunk("", [], reason))
        if self.req.include_usage:
            self.send(use=usage(self.job, n))
        self.h.wfile.write(b"data: [DONE]\n\n")
        self.h.wfile.flush()


def stream(h, req: Request):
    h.start_sse()
    out = _Stream(h, req)
    if req.chat:
        delta = {"role": "assistant", "content": ""}
        out.send({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
    for event in h.events(req.job):
        if event[0] == "prompt_logprobs":
            lp = _completion_logprobs(h, req, [], event[1])
            out.send({"index": 0, "text": req.echo_text, "logprobs": lp, "finish_reason": None})
            out.offset = len(req.echo_text)
        elif event[0] == "text":
            out.text(event[1], event[2])
        elif event[0] == "error":
            h.send_sse(APIError(500, event[1], type_="server_error").body())
            return
        else:
            out.finish(event[1], event[2])


def _rid(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
