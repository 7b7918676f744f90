"""An OpenAI- and Anthropic-compatible HTTP server: stdlib ThreadingHTTPServer + one engine.

Handler threads parse and validate requests (serve_protocol.py, serve_anthropic.py),
tokenize, and wait on a per-request queue; the generation thread (serve_engine.py) owns
the model and drives mlx-lm's BatchGenerator, so concurrent requests share decode steps.
A request whose client goes away is removed from the batch. Every error a client sees is
the API's own JSON shape; tracebacks stay in the server's log.
"""

import json
import logging
import queue
import select
import socket
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from ..memory import kv_bytes, materialize
from . import anthropic as anthropic
from .engine import POLL_S, Engine, Job
from .kv_quant import make_cache
from .openai import (
    APIError,
    Request,
    ServeConfig,
    ToolSplitter,
    chat_logprobs,
    completion_logprobs,
    parse_request,
    split_answer,
    usage,
)

log = logging.getLogger(__name__)
MAX_BODY = 4 * 1024 * 1024
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETION_PATHS = ("/v1/completions", "/completions")
MESSAGES_PATHS = ("/v1/messages", "/messages")
__all__ = ["APIError", "ServeConfig", "Server", "load_model", "make_engine"]


class Handler(BaseHTTPRequestHandler):
    """One connection; `self.server` carries `engine`, `tokenizer`, `grammars`, `config`."""

    server_version = "mlx-ternary"
    protocol_version = "HTTP/1.0"  # one request per connection; streams end with the close

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def send_json(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_sse(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()

    def send_sse(self, obj, event=None):
        head = f"event: {event}\n" if event else ""
        self.wfile.write(f"{head}data: {json.dumps(obj)}\n\n".encode())
        self.wfile.flush()

    def _guard(self, fn, anthropic_errors=False):
        shape = anthropic.error_body if anthropic_errors else APIError.body
        try:
            fn()
        except APIError as e:
            self.send_json(e.status, shape(e))
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        except Exception:
            log.exception("request failed")
            try:
                self.send_json(
                    500, shape(APIError(500, "internal server error", type_="server_error"))
                )
            except OSError:
                pass

    def do_GET(self):
        self._guard(self._get)

    def do_POST(self):
        self._guard(self._post, anthropic_errors=self.path in MESSAGES_PATHS)

    def _get(self):
        srv = self.server
        if self.path == "/health":
            ok = srv.engine.healthy
            self.send_json(
                200 if ok else 503,
                {"status": "ok" if ok else "error", "active": len(srv.engine.active)},
            )
        elif self.path in ("/v1/models", "/models"):
            self.send_json(
                200,
                {
                    "object": "list",
                    "data": [
                        {
                            "id": srv.config.model_name,
                            "object": "model",
                            "created": srv.created,
                            "owned_by": "mlx-ternary",
                        }
                    ],
                },
            )
        else:
            raise APIError(404, f"no such endpoint: GET {self.path}", code="not_found")

    def _read_body(self):
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "a Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number") from None
        if length < 0 or length > MAX_BODY:
            raise APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY}")
        raw = self.rfile.read(length)
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    def _post(self):
        srv = self.server
        if self.path in MESSAGES_PATHS:
            req = anthropic.parse(self._read_body(), srv)
            answer = anthropic.stream if req.stream else anthropic.whole
        elif self.path in CHAT_PATHS or self.path in COMPLETION_PATHS:
            req = parse_request(
                self._read_body(), srv.tokenizer, srv.config, self.path in CHAT_PATHS, srv.grammars
            )
            answer = Handler._stream if req.stream else Handler._whole
        else:
            raise APIError(404, f"no such endpoint: POST {self.path}", code="not_found")
        self.submit(req.job)
        try:
            answer(self, req)
        finally:
            req.job.cancelled.set()  # no-op when finished; frees the batch slot otherwise

    def submit(self, job: Job):
        engine, config = self.server.engine, self.server.config
        if not engine.healthy:
            raise APIError(503, "the generation engine is not running", type_="server_error")
        if engine.load() >= config.max_concurrency + config.max_queue:
            raise APIError(
                503,
                f"the server is busy ({engine.load()} requests running or queued); retry later",
                type_="server_error",
                code="overloaded",
            )
        engine.submit(job)

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def events(self, job: Job):
        """The job's events until "done" or "error"; stops early if the client leaves."""
        while True:
            try:
                event = job.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    return
                continue
            yield event
            if event[0] in ("done", "error"):
                return

    def collect(self, job: Job):
        """(text, records, prompt records, done event) of a whole answer, or None if the
        client left; an engine error becomes a 500."""
        text, records, prompt_records, done = [], [], [], None
        for event in self.events(job):
            if event[0] == "text":
                text.append(event[1])
                records += event[2]
            elif event[0] == "prompt_logprobs":
                prompt_records = event[1]
            elif event[0] == "error":
                raise APIError(500, event[1], type_="server_error")
            else:
                done = event
        return None if done is None else ("".join(text), records, prompt_records, done)

    def _whole(self, req: Request):
        got = self.collect(req.job)
        if got is None:
            return  # the client went away
        text, records, prompt_records, (_, reason, n) = got
        tok, job = self.server.tokenizer, req.job
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
                "logprobs": self._completion_logprobs(req, records, prompt_records),
            }
        choice["finish_reason"] = reason
        self.send_json(
            200,
            {
                "id": _rid(req.chat),
                "created": int(time.time()),
                "object": "chat.completion" if req.chat else "text_completion",
                "model": self.server.config.model_name,
                "choices": [choice],
                "usage": usage(job, n),
            },
        )

    def _completion_logprobs(self, req, records, prompt_records, offset=None):
        job, tok = req.job, self.server.tokenizer
        if job.logprobs is None:
            return None
        if prompt_records is not None and job.echo:
            lead = completion_logprobs(tok, prompt_records, 0, first=job.prompt[0])
            rest = completion_logprobs(tok, records, len(req.echo_text))
            return {k: lead[k] + rest[k] for k in lead}
        return completion_logprobs(tok, records, len(req.echo_text) if offset is None else offset)

    def _stream(self, req: Request):
        self.start_sse()
        rid, created, name = _rid(req.chat), int(time.time()), self.server.config.model_name
        obj = "chat.completion.chunk" if req.chat else "text_completion"
        tok, job = self.server.tokenizer, req.job
        splitter = ToolSplitter(req.tool_markers, req.tools) if req.tools else None
        state = {"offset": 0, "calls": 0}

        def send(choice=None, use=None):
            chunk = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": name,
                "choices": [choice] if choice else [],
            }
            if use:
                chunk["usage"] = use
            self.send_sse(chunk)

        def text_chunk(text, records, reason=None):
            if req.chat:
                lp = chat_logprobs(tok, records) if job.logprobs is not None else None
                return {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": lp,
                    "finish_reason": reason,
                }
            lp = (
                completion_logprobs(tok, records, state["offset"])
                if job.logprobs is not None
                else None
            )
            state["offset"] += len(text)
            return {"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}

        def chat_items(items, records):
            for kind, value in items:
                if kind == "text":
                    send(text_chunk(value, records))
                else:
                    delta = {"tool_calls": [dict(value, index=state["calls"])]}
                    state["calls"] += 1
                    send({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})
                records = []
            if records:
                send(text_chunk("", records))

        if req.chat:
            send(
                {
                    "index": 0,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            )
        for event in self.events(job):
            if event[0] == "prompt_logprobs":
                lp = self._completion_logprobs(req, [], event[1])
                send({"index": 0, "text": req.echo_text, "logprobs": lp, "finish_reason": None})
                state["offset"] = len(req.echo_text)
            elif event[0] == "text":
                if req.chat:
                    chat_items(
                        splitter.feed(event[1]) if splitter else [("text", event[1])], event[2]
                    )
                else:
                    send(text_chunk(event[1], event[2]))
            elif event[0] == "error":
                self.send_sse(APIError(500, event[1], type_="server_error").body())
                return
            else:
                if splitter:
                    chat_items(splitter.flush(), [])
                reason = "tool_calls" if state["calls"] and event[1] == "stop" else event[1]
                send(
                    text_chunk("", [], reason)
                    if not req.chat
                    else {"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}
                )
                if req.include_usage:
                    send(use=usage(job, event[2]))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()


def _rid(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


class Server(ThreadingHTTPServer):
    """The HTTP server plus the engine it feeds; `serve_forever()` runs it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        model,
        tokenizer,
        config: ServeConfig,
        host: str = "127.0.0.1",
        port: int = 8080,
        engine_class=None,
    ):
        self.engine = make_engine(model, tokenizer, config, engine_class or Engine)
        self.grammars = self.engine.grammars
        self.tokenizer, self.config, self.created = tokenizer, config, int(time.time())
        super().__init__((host, port), Handler)
        self.engine.start()

    def server_close(self):
        super().server_close()
        self.engine.stop()


def make_engine(model, tokenizer, config: ServeConfig, engine_class=None) -> Engine:
    """The generation engine for `config` (not started); `engine_class` defaults to Engine
    (serve.lockstep.LockstepEngine runs one rank of a tensor-parallel group)."""
    materialize(model)
    make_cache(model, config.kv_bits, config.kv_group_size)  # refuses what cannot be
    if config.prompt_cache_bytes is None:
        config.prompt_cache_bytes = kv_bytes(
            model, config.max_context, config.max_concurrency, config.kv_bits, config.kv_group_size
        )
    return (engine_class or Engine)(
        model,
        tokenizer,
        config.max_concurrency,
        config.prefill_step_size,
        kv_bits=config.kv_bits,
        kv_group_size=config.kv_group_size,
        prompt_cache_bytes=config.prompt_cache_bytes,
        grammars=_grammars(model, tokenizer),
    )


def _grammars(model, tokenizer):
    """llguidance's view of the tokenizer (built on the first constrained request)."""
    from .constrain import Grammars

    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return Grammars(tokenizer, vocab or len(tokenizer.get_vocab()))


def load_model(path: str, adapter_path: Optional[str] = None, activations: Optional[str] = None):
    """(model, tokenizer) for `serve`, loaded lazily so the memory plan runs first; LoRA/DoRA
    adapters (mlx-lm's format) applied when `adapter_path` is given."""
    from ..checkpoint.load import load

    return load(path, lazy=True, adapter_path=adapter_path, activations=activations)
