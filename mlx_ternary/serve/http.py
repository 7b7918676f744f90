"""An OpenAI- and Anthropic-compatible HTTP server: stdlib ThreadingHTTPServer + one engine.

Handler threads parse and validate requests (serve_protocol.py, serve_anthropic.py),
tokenize, and wait on a per-request queue; the generation thread (serve_engine.py) owns
the model and drives mlx-lm's BatchGenerator, so concurrent requests share decode steps.
A request whose client goes away is removed from the batch. Every error a client sees is
the API's own JSON shape; tracebacks stay in the server's log.
"""

import hmac
import ipaddress
import json
import logging
import queue
import select
import signal
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

from ..memory import kv_bytes, materialize
from ..speculative import check_rewindable
from . import answers, endpoints, openapi
from . import anthropic as anthropic
from .engine import POLL_S, Engine, Job
from .kv_quant import make_cache
from .metrics import Metrics
from .openai import APIError, Request, ServeConfig, parse_request, short_name

log = logging.getLogger(__name__)
MAX_BODY = 4 * 1024 * 1024
RETRY_AFTER_S = 1  # what a 503 tells a client to wait
CLOSE_WAIT_S = 5  # how long server_close waits for open connections to end
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
COMPLETION_PATHS = ("/v1/completions", "/completions")
MESSAGES_PATHS = ("/v1/messages", "/messages")
PUBLIC = ("/health", "/")  # answered without the API key (the page asks for it)
CORS_HEADERS = "Authorization, Content-Type, x-api-key, anthropic-version, anthropic-beta"
BUSY = (  # the whole answer to a connection over --max-connections
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
    b"Retry-After: %d\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
)
__all__ = [
    "APIError",
    "ServeConfig",
    "Server",
    "bind_error",
    "drain_on_signals",
    "exposure_warning",
    "load_lazily",
    "make_engine",
    "short_name",
]


class Handler(BaseHTTPRequestHandler):
    """One connection (HTTP/1.1 keep-alive); `self.server` carries `engine`, `tokenizer`,
    `grammars`, `config`. Requests are dispatched through ROUTES."""

    server_version = "mlx-ternary"
    protocol_version = "HTTP/1.1"

    def setup(self):
        self.timeout = self.server.config.read_timeout  # applied to the socket by setup
        super().setup()

    def log_message(self, fmt, *args):
        log.debug("%s %s", self.address_string(), fmt % args)

    def send_response(self, code, message=None):
        self._status = code
        path = getattr(self, "path", "").split("?", 1)[0]
        known = any(path == p for _, p in ROUTES)  # a label per endpoint, not per probe
        self.server.metrics.request(path if known else "other", code)
        super().send_response(code, message)

    def end_headers(self):
        origin = self.headers.get("Origin") if self.headers else None
        allowed = self.server.config.cors_origins
        if origin and ("*" in allowed or origin in allowed):
            self.send_header("Access-Control-Allow-Origin", "*" if "*" in allowed else origin)
            self.send_header("Vary", "Origin")
        super().end_headers()

    def send_json(self, status: int, obj: dict, headers=None):
        data = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.end_headers()
        self.wfile.write(data)

    def start_sse(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")  # the stream ends with the connection
        self.close_connection = True
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
            if not self._body_read and not self._drain():
                self.close_connection = True  # an unread body would be taken for the next request
            self.send_json(e.status, shape(e), e.headers)
        except (BrokenPipeError, ConnectionResetError, socket.timeout):
            self.close_connection = True
        except Exception:
            log.exception("request failed")
            self.close_connection = True
            try:
                self.send_json(
                    500, shape(APIError(500, "internal server error", type_="server_error"))
                )
            except OSError:
                pass

    def _drain(self) -> bool:
        """Read the body of a request refused before its body was read (a wrong key, an
        unknown path), where its Content-Length is within MAX_BODY: the connection then
        stays usable, and the refusal reaches the client - closing a socket with unread
        bytes sends a TCP reset, which can arrive before the response. False where the body
        is not read (no valid length, too large, or the client stops sending)."""
        try:
            length = self._body_length()
            self._body_read = len(self.rfile.read(length)) == length
        except (APIError, OSError):
            return False
        return self._body_read

    def _dispatch(self, method: str):
        length = self.headers.get("Content-Length")
        self._body_read = method in ("GET", "OPTIONS") and not length or length == "0"
        path = self.path.split("?", 1)[0]
        self._status, self._job, start = None, None, time.monotonic()
        self._guard(lambda: self._route(method, path), anthropic_errors=path in MESSAGES_PATHS)
        if log.isEnabledFor(logging.INFO):
            log.info("%s", request_line(method, path, self._status, self._job, self.server, start))

    def _route(self, method: str, path: str):
        if path not in PUBLIC:
            self._authorize()
        route = ROUTES.get((method, path))
        if route is None:
            raise APIError(404, f"no such endpoint: {method} {path}", code="not_found")
        route(self)

    def _authorize(self):
        key = self.server.config.api_key
        if key is None:
            return
        bearer = self.headers.get("Authorization", "")
        given = bearer[7:] if bearer[:7].lower() == "bearer " else self.headers.get("x-api-key")
        if given is None or not hmac.compare_digest(given.encode(), key.encode()):
            raise APIError(
                401,
                "a valid API key is required: 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                type_="authentication_error",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def do_OPTIONS(self):  # a CORS preflight: no key (browsers send none), no body
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", CORS_HEADERS)
        self.send_header("Access-Control-Max-Age", "600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _body_length(self) -> int:
        """The request's Content-Length, or the APIError that refuses it (none: where the
        body ends is unknown; not a number; over MAX_BODY)."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise APIError(411, "a Content-Length header is required")
        try:
            length = int(length)
        except ValueError:
            raise APIError(400, "the Content-Length header is not a number") from None
        if length < 0 or length > MAX_BODY:
            raise APIError(413, f"the request body is {length} bytes; the limit is {MAX_BODY}")
        return length

    def read_body(self):
        length = self._body_length()
        raw = self.rfile.read(length)
        self._body_read = True
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON ({e})") from None

    def answer(self, req: Request, answer):
        """Run `req` on the engine and send it with `answer(handler, req)`."""
        self._job = req.job
        self.submit(req.job)
        self.server.track(+1)
        try:
            answer(self, req)
        finally:
            self.server.track(-1)
            req.job.cancelled.set()  # no-op when finished; frees the batch slot otherwise

    def submit(self, job: Job):
        engine, config = self.server.engine, self.server.config
        retry = {"Retry-After": RETRY_AFTER_S}
        if not engine.healthy:
            raise APIError(503, "the generation engine is not running", type_="server_error")
        if self.server.draining:
            raise APIError(503, "the server is shutting down", type_="server_error", headers=retry)
        if engine.load() >= config.max_concurrency + config.max_queue:
            raise APIError(
                503,
                f"the server is busy ({engine.load()} requests running or queued); retry later",
                type_="server_error",
                code="overloaded",
                headers=retry,
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


def request_line(method: str, path: str, status, job: Optional[Job], server, start: float) -> str:
    """The log line of one request: method, path, status, and for a generation the model,
    prompt and completion tokens, time to first token and decode tokens/s; then its time."""
    parts = [method, path, str(status or "-")]
    if job is not None:
        parts += [
            f"model={server.config.model_name}",
            f"prompt={len(job.prompt)}",
            f"cached={job.cached_tokens}",
            f"completion={job.tokens}",
        ]
        if job.first_token_at is not None:
            parts.append(f"ttft={job.first_token_at - job.started:.3f}s")
            span = (job.last_token_at or job.first_token_at) - job.first_token_at
            if job.tokens > 1 and span > 0:
                parts.append(f"{(job.tokens - 1) / span:.1f} tok/s")
    parts.append(f"{time.monotonic() - start:.3f}s")
    return " ".join(parts)


def _health(h: Handler):
    ok = h.server.engine.healthy and not h.server.draining
    h.send_json(
        200 if ok else 503,
        {
            "status": "ok" if ok else ("draining" if h.server.draining else "error"),
            "active": len(h.server.engine.active),
        },
    )


def _models(h: Handler):
    srv = h.server
    data = [
        {"id": name, "object": "model", "created": srv.created, "owned_by": "mlx-ternary"}
        for name in srv.config.names
    ]
    h.send_json(200, {"object": "list", "data": data})


def _openai(chat: bool):
    def route(h: Handler):
        srv = h.server
        req = parse_request(h.read_body(), srv.tokenizer, srv.config, chat, srv.grammars)
        h.answer(req, answers.stream if req.stream else answers.whole)

    return route


def _messages(h: Handler):
    req = anthropic.parse(h.read_body(), h.server)
    h.answer(req, anthropic.stream if req.stream else anthropic.whole)


# (method, path) -> route(handler): every endpoint, in one table.
ROUTES = {
    ("GET", "/health"): _health,
    ("GET", "/"): endpoints.chat_page,
    **{("GET", p): _models for p in ("/v1/models", "/models")},
    **{("POST", p): _openai(True) for p in CHAT_PATHS},
    **{("POST", p): _openai(False) for p in COMPLETION_PATHS},
    **{("POST", p): _messages for p in MESSAGES_PATHS},
    ("POST", "/tokenize"): endpoints.tokenize,
    ("POST", "/detokenize"): endpoints.detokenize,
    ("GET", "/tokenizer_info"): endpoints.tokenizer_info,
    ("GET", "/metrics"): endpoints.metrics,
}


def _openapi(handler):
    from .. import __version__  # the package root imports the whole library: only here

    handler.send_json(200, openapi.document(ROUTES, "mlx-ternary", __version__))


ROUTES[("GET", "/openapi.json")] = _openapi


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
        draft_model=None,
    ):
        self.engine = make_engine(model, tokenizer, config, engine_class or Engine, draft_model)
        self.grammars = self.engine.grammars
        self.tokenizer, self.config, self.created = tokenizer, config, int(time.time())
        self.draining = False
        self.metrics = self.engine.metrics = Metrics()
        self.connections = self.in_flight = 0
        self.open_sockets = set()  # of the connections open now, closed by server_close
        self._count = threading.Lock()
        self.request_queue_size = max(128, min(config.max_connections, 4096))  # the backlog
        super().__init__((host, port), Handler)
        self.engine.start()

    def track(self, n: int):
        with self._count:
            self.in_flight += n

    def process_request(self, request, client_address):
        """One thread per connection, up to --max-connections; past it a 503 and close."""
        with self._count:
            full = self.connections >= self.config.max_connections
            self.connections += not full
            if not full:
                self.open_sockets.add(request)
        if not full:
            return super().process_request(request, client_address)
        body = json.dumps(
            APIError(503, "too many open connections; retry later", type_="server_error").body()
        ).encode()
        try:
            request.sendall(BUSY % (RETRY_AFTER_S, len(body), body))
        except OSError:
            pass
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._count:
                self.connections -= 1
                self.open_sockets.discard(request)

    def drain(self, timeout: Optional[float] = None) -> bool:
        """Refuse new requests (503), let the in-flight ones finish (up to `timeout`, the
        config's drain_timeout by default), then stop serve_forever. True if all finished."""
        self.draining = True
        deadline = time.monotonic() + (self.config.drain_timeout if timeout is None else timeout)
        while (self.in_flight or self.engine.load()) and time.monotonic() < deadline:
            time.sleep(0.05)
        done = not (self.in_flight or self.engine.load())
        self.shutdown()
        return done

    def server_close(self):
        """Stop listening, end the open (keep-alive) connections and wait for their threads
        (up to CLOSE_WAIT_S), then stop the engine: nothing of the server outlives it."""
        super().server_close()
        with self._count:
            sockets = list(self.open_sockets)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        self.engine.stop()


def bind_error(host: str, port: int) -> Optional[str]:
    """Why the server could not listen on (host, port), in one sentence; None when it can
    (checked by binding a socket as the server does, then closing it). Port 0 always can."""
    if port == 0:
        return None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, Server.address_family, socket.SOCK_STREAM
        )[0]
    except OSError as e:
        return (
            f"cannot listen on {host}:{port}: {e.strerror or e}; --host takes an IPv4 "
            "address or a name that resolves to one"
        )
    try:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Server does
            sock.bind(address)
    except OSError as e:
        advice = "; pick another --port" + (
            " (8080 is also mlx_lm.server's and llama-server's default)" if port == 8080 else ""
        )
        return f"cannot listen on {host}:{port}: {e.strerror or e}{advice}"
    return None


def exposure_warning(host: str, api_key: Optional[str]) -> Optional[str]:
    """A warning when `host` is reachable from other machines and no API key is set."""
    if api_key or host in ("localhost", ""):
        return None if api_key or host == "localhost" else _exposed(host)
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: loopback only if it resolves there
        try:
            if all(ipaddress.ip_address(a[4][0]).is_loopback for a in socket.getaddrinfo(host, 0)):
                return None
        except OSError:
            pass
    return _exposed(host)


def _exposed(host: str) -> str:
    return (
        f"serving on {host or 'all addresses'} without an API key: anyone who can reach "
        "it can use it; set --api-key (or $MLX_TERNARY_API_KEY)"
    )


def drain_on_signals(server: Server, signals=(signal.SIGTERM, signal.SIGINT), force=None):
    """Make SIGTERM/SIGINT drain `server` (Server.drain on a thread of its own, since
    serve_forever runs on the thread that gets the signal); call from the main thread.
    A second signal while draining calls `force(signum)` when given (the CLI exits)."""

    def handler(signum, frame):
        if not server.draining:
            log.warning(
                "%s: draining (%d in flight); again to force",
                signal.Signals(signum).name,
                server.in_flight,
            )
            threading.Thread(target=server.drain, name="mlx-ternary-drain").start()
        elif force is not None:
            force(signum)

    for sig in signals:
        signal.signal(sig, handler)


def make_engine(
    model, tokenizer, config: ServeConfig, engine_class=None, draft_model=None
) -> Engine:
    """The generation engine for `config` (not started); `engine_class` defaults to Engine
    (serve.lockstep.LockstepEngine runs one rank of a tensor-parallel group); with
    `draft_model` a request running alone decodes speculatively (drafting.py)."""
    materialize(model)
    make_cache(model, config.kv_bits, config.kv_group_size)  # refuses what cannot be
    if draft_model is not None:
        for name, m in (("the model", model), ("the draft model", draft_model)):
            check_rewindable(make_cache(m, config.kv_bits, config.kv_group_size), name)
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
        draft_model=draft_model,
        num_draft_tokens=config.num_draft_tokens,
    )


def _grammars(model, tokenizer):
    """llguidance's view of the tokenizer (built on the first constrained request)."""
    from .constrain import Grammars

    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    return Grammars(tokenizer, vocab or len(tokenizer.get_vocab()))


def load_lazily(path: str, adapter_path: Optional[str] = None, activations: Optional[str] = None):
    """(model, tokenizer) for `serve`, loaded lazily so the memory plan runs first; LoRA/DoRA
    adapters (mlx-lm's format) applied when `adapter_path` is given."""
    from ..checkpoint.load import load

    return load(path, lazy=True, adapter_path=adapter_path, activations=activations)
