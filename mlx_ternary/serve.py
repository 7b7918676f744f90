"""An OpenAI-compatible HTTP server: stdlib ThreadingHTTPServer + one generation thread.

Handler threads parse and validate requests, tokenize, and wait on a per-request queue;
the generation thread owns the model and drives mlx-lm's BatchGenerator (continuous
batching, chunked prefill), so concurrent requests share decode steps instead of queueing
behind a lock. A request whose client goes away is removed from the batch. Every error a
client sees is OpenAI's JSON shape; tracebacks stay in the server's log.
"""

import json
import logging
import queue
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional

import mlx.core as mx

from .plan import activation_dtype
from .nn import ternary_layers

log = logging.getLogger(__name__)
MAX_BODY = 4 * 1024 * 1024
POLL_S = 0.2


class APIError(Exception):
    """An error a client caused: sent as HTTP `status` with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type_)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type,
                          "param": self.param, "code": self.code}}


@dataclass
class ServeConfig:
    """What `mlx-ternary serve` was started with."""

    model_name: str
    max_context: int = 4096
    prefill_step_size: int = 512
    max_concurrency: int = 8
    max_queue: int = 64


@dataclass
class Job:
    """One request inside the engine: prompt tokens in, events out on `events`.

    Events: ("text", str), ("done", finish_reason, completion_tokens), ("error", str).
    """

    prompt: List[int]
    max_tokens: int
    sampling: dict
    stop: List[str] = field(default_factory=list)
    events: queue.Queue = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    uid: Optional[int] = None
    detokenizer: object = None
    pending: str = ""
    tokens: int = 0


def _seeded_sampler(temp, top_p, top_k, min_p, seed):
    # A per-request key makes a seeded request reproducible whatever else is in the batch.
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    state = {"key": mx.random.key(seed)}

    def sample(logprobs):
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, top_p)
        if min_p:
            logprobs = apply_min_p(logprobs, min_p)
        if top_k:
            logprobs = apply_top_k(logprobs, top_k)
        state["key"], sub = mx.random.split(state["key"])
        return mx.random.categorical(logprobs * (1.0 / temp), key=sub)

    return sample


def make_sampler(s: dict):
    """A sampler for one request's sampling dict (greedy at temperature 0)."""
    from mlx_lm.sample_utils import greedy_sampler, make_sampler as mlx_sampler

    if s["temperature"] == 0:
        return greedy_sampler  # shared: the batch then samples in one call
    if s.get("seed") is not None:
        return _seeded_sampler(s["temperature"], s["top_p"], s["top_k"], s["min_p"], s["seed"])
    return mlx_sampler(s["temperature"], s["top_p"], s["min_p"], top_k=s["top_k"])


class Engine:
    """The generation thread: admits jobs, steps the BatchGenerator, emits text."""

    def __init__(self, model, tokenizer, max_concurrency: int = 8,
                 prefill_step_size: int = 512):
        self.model, self.tokenizer = model, tokenizer
        self.max_concurrency = max_concurrency
        self.prefill_step_size = prefill_step_size
        self.inbox: queue.Queue = queue.Queue()
        self.active = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-ternary-engine",
                                        daemon=True)
        self.failed: Optional[str] = None
        self.tokens_generated = 0

    def start(self):
        self._thread.start()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self.failed is None

    def load(self) -> int:
        """Jobs waiting or running."""
        return self.inbox.qsize() + len(self.active)

    def submit(self, job: Job):
        self.inbox.put(job)

    def _new_generator(self, stream):
        from mlx_lm.generate import BatchGenerator, make_stop_sequences

        self._stops = make_stop_sequences(self.tokenizer)
        return BatchGenerator(self.model, completion_batch_size=self.max_concurrency,
                              prefill_batch_size=self.max_concurrency,
                              prefill_step_size=self.prefill_step_size, stream=stream)

    def _run(self):
        try:
            stream = mx.default_stream(mx.default_device())
            gen = self._new_generator(stream)
            while not self._stop.is_set():
                self._admit(gen, block=not self.active)
                self._drop_cancelled(gen)
                if not self.active:
                    continue
                try:
                    self._step(gen)
                except Exception as e:  # a failed step fails its batch, not the server
                    log.exception("generation step failed")
                    for job in self.active.values():
                        job.events.put(("error", f"generation failed ({type(e).__name__})"))
                    self.active.clear()
                    del gen
                    mx.clear_cache()
                    gen = self._new_generator(stream)
        except Exception as e:
            log.exception("engine thread died")
            self.failed = f"{type(e).__name__}: {e}"
            for job in self.active.values():
                job.events.put(("error", "the generation engine stopped"))

    def _step(self, gen):
        # A method, so the responses (each finished one holds its KV cache) die on return.
        _, responses = gen.next()
        for r in responses:
            self._emit(gen, r)

    def _admit(self, gen, block: bool):
        from mlx_lm.sample_utils import make_logits_processors

        while True:
            try:
                job = self.inbox.get(timeout=POLL_S) if block else self.inbox.get_nowait()
            except queue.Empty:
                return
            block = False
            if job.cancelled.is_set():
                continue
            s = job.sampling
            procs = make_logits_processors(
                s.get("logit_bias"), s.get("repetition_penalty"), 20,
                s.get("presence_penalty"), 20, s.get("frequency_penalty"), 20)
            (job.uid,) = gen.insert([job.prompt], max_tokens=[job.max_tokens],
                                    samplers=[make_sampler(s)], logits_processors=[procs],
                                    stop_sequences=[self._stops])
            job.detokenizer = self.tokenizer.detokenizer
            self.active[job.uid] = job

    def _drop_cancelled(self, gen):
        gone = [uid for uid, job in self.active.items() if job.cancelled.is_set()]
        if gone:
            gen.remove(gone)
            for uid in gone:
                del self.active[uid]

    def _emit(self, gen, r):
        job = self.active.get(r.uid)
        if job is None:
            return
        job.tokens += 1
        self.tokens_generated += 1
        detok = job.detokenizer
        if r.finish_reason != "stop":  # the EOS token itself is not text
            detok.add_token(r.token)
        if r.finish_reason is not None:
            detok.finalize()
        text, reason = self._apply_stop(job, detok.last_segment, r.finish_reason)
        if text:
            job.events.put(("text", text))
        if reason is not None:
            job.events.put(("done", reason, job.tokens))
            del self.active[r.uid]
            if r.finish_reason is None:  # a stop string ended it: leave the batch
                gen.remove([r.uid])

    @staticmethod
    def _apply_stop(job: Job, text: str, reason: Optional[str]):
        """Cut the text at the first stop string; hold back a possible stop-string prefix."""
        if not job.stop:
            return text, reason
        job.pending += text
        cut = [i for i in (job.pending.find(s) for s in job.stop) if i >= 0]
        if cut:
            out, job.pending = job.pending[:min(cut)], ""
            return out, "stop"
        if reason is not None:
            out, job.pending = job.pending, ""
            return out, reason
        hold = 0
        for s in job.stop:
            for n in range(min(len(s) - 1, len(job.pending)), 0, -1):
                if job.pending.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        out = job.pending[:len(job.pending) - hold]
        job.pending = job.pending[len(out):]
        return out, None


# ----------------------------------------------------------------------------- requests

def _field(body, name, types, default=None, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("number" if t is float else t.__name__ for t in types)
        raise APIError(400, f"'{name}' must be {names}, got {type(value).__name__}", name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _message_text(content, i) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"messages[{i}].content must be a string or a list of text parts",
                   f"messages[{i}].content")


def prompt_tokens(tokenizer, body: dict, chat: bool) -> List[int]:
    """The request's prompt as token ids (chat template from the tokenizer when it has one)."""
    if chat:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise APIError(400, "'messages' is required: a non-empty list of "
                           "{role, content} objects", "messages")
        clean = []
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, f"messages[{i}] must be an object with a string 'role'",
                               f"messages[{i}]")
            clean.append({"role": m["role"], "content": _message_text(m.get("content", ""), i)})
        if getattr(tokenizer, "has_chat_template", False):
            try:
                return list(tokenizer.apply_chat_template(clean, add_generation_prompt=True))
            except Exception as e:  # jinja templates raise for roles they do not accept
                raise APIError(400, f"the chat template rejected the messages ({e})",
                               "messages") from None
        from mlx_lm.server import convert_chat

        return tokenizer.encode(convert_chat(clean))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return prompt
    if not isinstance(prompt, str) or not prompt:
        raise APIError(400, "'prompt' is required: a non-empty string (or one string in a "
                       "list, or a list of token ids)", "prompt")
    return tokenizer.encode(prompt)


def parse_request(body, tokenizer, config: ServeConfig, chat: bool) -> tuple:
    """Validate an OpenAI request body. Returns (Job, stream, include_usage)."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    model = _field(body, "model", (str,))
    if model is not None and model not in (config.model_name, "default_model"):
        raise APIError(404, f"the model '{model}' does not exist; this server serves "
                       f"'{config.model_name}' (see /v1/models)", "model", "model_not_found")
    n = _field(body, "n", (int,), 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1 (this server returns one choice), got {n}", "n")
    stream = _field(body, "stream", (bool,), False)
    opts = _field(body, "stream_options", (dict,), {})
    include_usage = bool(opts.get("include_usage", False))
    if _field(body, "logprobs", (bool, int), False) or body.get("top_logprobs"):
        raise APIError(400, "logprobs are not supported by this server", "logprobs")
    big = 1 << 31
    max_tokens = _field(body, "max_completion_tokens", (int,), None, 1, big)
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", (int,), None, 1, big)
    num = (int, float)
    sampling = {
        "temperature": _field(body, "temperature", num, 1.0, 0, 2),
        "top_p": _field(body, "top_p", num, 1.0, 0, 1),
        "top_k": _field(body, "top_k", (int,), 0, 0, big),
        "min_p": _field(body, "min_p", num, 0.0, 0, 1),
        "seed": _field(body, "seed", (int,)),
        "frequency_penalty": _field(body, "frequency_penalty", num, None, -2, 2),
        "presence_penalty": _field(body, "presence_penalty", num, None, -2, 2),
        "repetition_penalty": _field(body, "repetition_penalty", num, None, 0, 10),
    }
    bias = _field(body, "logit_bias", (dict,))
    if bias:
        try:
            sampling["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise APIError(400, "'logit_bias' must map token ids to numbers",
                           "logit_bias") from None
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(
            isinstance(s, str) and s for s in stop):
        raise APIError(400, "'stop' must be a string or a list of up to 4 non-empty strings",
                       "stop")
    tokens = prompt_tokens(tokenizer, body, chat)
    room = config.max_context - len(tokens)
    if room < 1:
        raise APIError(400, f"the prompt is {len(tokens)} tokens; this server's context is "
                       f"{config.max_context} tokens (--max-context), which leaves no room to "
                       "generate; shorten the prompt", "messages" if chat else "prompt",
                       "context_length_exceeded")
    if max_tokens is not None and max_tokens > room:
        raise APIError(400, f"the prompt ({len(tokens)} tokens) plus max_tokens "
                       f"({max_tokens}) is {len(tokens) + max_tokens} tokens, over this "
                       f"server's context of {config.max_context} (--max-context); ask for "
                       f"at most {room} tokens", "max_tokens", "context_length_exceeded")
    job = Job(prompt=tokens, max_tokens=max_tokens or room, sampling=sampling, stop=stop)
    return job, stream, include_usage


# ----------------------------------------------------------------------------- HTTP

class Handler(BaseHTTPRequestHandler):
    """One connection; `self.server` carries `engine`, `tokenizer` and `config`."""

    server_version = "mlx-ternary"
    protocol_version = "HTTP/1.0"  # one request per connection; streams end with the close

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def _json(self, status: int, obj: dict):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _guard(self, fn):
        try:
            fn()
        except APIError as e:
            self._json(e.status, e.body())
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            pass
        except Exception:
            log.exception("request failed")
            try:
                self._json(500, APIError(500, "internal server error", type_="server_error")
                           .body())
            except OSError:
                pass

    def do_GET(self):
        self._guard(self._get)

    def do_POST(self):
        self._guard(self._post)

    def _get(self):
        srv = self.server
        if self.path == "/health":
            ok = srv.engine.healthy
            self._json(200 if ok else 503, {"status": "ok" if ok else "error",
                                            "active": len(srv.engine.active)})
        elif self.path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{
                "id": srv.config.model_name, "object": "model", "created": srv.created,
                "owned_by": "mlx-ternary"}]})
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
        chat = self.path in ("/v1/chat/completions", "/chat/completions")
        if not chat and self.path not in ("/v1/completions", "/completions"):
            raise APIError(404, f"no such endpoint: POST {self.path}", code="not_found")
        srv = self.server
        body = self._read_body()
        job, stream, include_usage = parse_request(body, srv.tokenizer, srv.config, chat)
        if not srv.engine.healthy:
            raise APIError(503, "the generation engine is not running", type_="server_error")
        if srv.engine.load() >= srv.config.max_concurrency + srv.config.max_queue:
            raise APIError(503, f"the server is busy ({srv.engine.load()} requests running or "
                           "queued); retry later", type_="server_error", code="overloaded")
        srv.engine.submit(job)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        try:
            (self._stream if stream else self._whole)(job, rid, chat, include_usage)
        finally:
            job.cancelled.set()  # no-op when finished; frees the batch slot otherwise

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _events(self, job: Job):
        while True:
            try:
                event = job.events.get(timeout=POLL_S)
            except queue.Empty:
                if self._client_gone():
                    return
                continue
            yield event
            if event[0] != "text":
                return

    def _usage(self, job, completion):
        n = len(job.prompt)
        return {"prompt_tokens": n, "completion_tokens": completion,
                "total_tokens": n + completion}

    def _whole(self, job, rid, chat, include_usage):
        text, done = [], None
        for event in self._events(job):
            if event[0] == "text":
                text.append(event[1])
            elif event[0] == "error":
                raise APIError(500, event[1], type_="server_error")
            else:
                done = event
        if done is None:
            return  # the client went away
        text = "".join(text)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                  if chat else {"index": 0, "text": text, "logprobs": None})
        choice["finish_reason"] = done[1]
        self._json(200, {"id": rid, "object": "chat.completion" if chat else "text_completion",
                         "created": int(time.time()), "model": self.server.config.model_name,
                         "choices": [choice], "usage": self._usage(job, done[2])})

    def _stream(self, job, rid, chat, include_usage):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        created, name = int(time.time()), self.server.config.model_name
        obj = "chat.completion.chunk" if chat else "text_completion"

        def send(choice=None, usage=None):
            chunk = {"id": rid, "object": obj, "created": created, "model": name,
                     "choices": [choice] if choice else []}
            if usage:
                chunk["usage"] = usage
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

        def choice(text, reason=None, first=False):
            if chat:
                delta = {"role": "assistant", "content": text} if first else {"content": text}
                return {"index": 0, "delta": delta, "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}

        if chat:
            send(choice("", first=True))
        for event in self._events(job):
            if event[0] == "text":
                send(choice(event[1]))
            elif event[0] == "error":
                err = APIError(500, event[1], type_="server_error").body()
                self.wfile.write(f"data: {json.dumps(err)}\n\n".encode())
                return
            else:
                send(choice("", event[1]))
                if include_usage:
                    send(usage=self._usage(job, event[2]))
                self.wfile.write(b"data: [DONE]\n\n")
                self.wfile.flush()


class Server(ThreadingHTTPServer):
    """The HTTP server plus the engine it feeds; `serve_forever()` runs it."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, model, tokenizer, config: ServeConfig, host: str = "127.0.0.1",
                 port: int = 8080):
        materialize(model)
        self.engine = Engine(model, tokenizer, config.max_concurrency, config.prefill_step_size)
        self.tokenizer, self.config, self.created = tokenizer, config, int(time.time())
        super().__init__((host, port), Handler)
        self.engine.start()

    def server_close(self):
        super().server_close()
        self.engine.stop()


def materialize(model):
    """Evaluate the weights and the runtime tables of the ternary layers on this thread,
    so the generation thread finds no lazy graph built on another thread's stream."""
    mx.eval(model.parameters())
    dtype = activation_dtype(model)
    mx.eval([layer._fast_affine(dtype)[:2] for _, layer in ternary_layers(model)
             if layer.packing == "fast" and layer._backend() == "reference"])
