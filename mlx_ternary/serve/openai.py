"""OpenAI requests in, `Job`s out; generated text and token records back into OpenAI shapes.

Everything a client can get wrong is caught here, before the engine sees the request, and
answered with one `APIError` naming the field. Tool calls are rendered through the
tokenizer's chat template and parsed back with mlx-lm's tool parser for that template.
"""

import json
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import List, Optional

from ..format import KV_GROUP_SIZE
from ..speculative import DEFAULT_DRAFT_TOKENS
from .engine import Job

MAX_TOP_LOGPROBS = 20
# OpenAI parameters that would change the answer in ways this server does not do: refused,
# never ignored.
UNSUPPORTED = ("functions", "function_call", "suffix", "audio", "prediction", "web_search_options")


class APIError(Exception):
    """An error a client caused: sent as HTTP `status` with OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        param: Optional[str] = None,
        code: Optional[str] = None,
        type_: str = "invalid_request_error",
        headers: Optional[dict] = None,
    ):
        super().__init__(message)
        self.headers = headers or {}
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type_,
        )

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass
class ServeConfig:
    """What `mlx-ternary serve` was started with."""

    model_name: str  # the id /v1/models lists first (short_name of --model)
    max_context: int = 4096
    prefill_step_size: int = 512
    max_concurrency: int = 8
    max_queue: int = 64
    kv_bits: Optional[int] = None
    kv_group_size: int = KV_GROUP_SIZE
    prompt_cache_bytes: Optional[int] = None  # None: as much as the live KV cache's plan
    aliases: List[str] = field(default_factory=list)  # --served-model-name
    api_key: Optional[str] = None  # required on every path but /health when set
    cors_origins: List[str] = field(default_factory=list)  # "*" allows any origin
    read_timeout: float = 60.0  # seconds a connection may send nothing
    max_connections: int = 1024  # open connections; more are answered 503
    drain_timeout: float = 25.0  # seconds in-flight requests get at SIGTERM/SIGINT
    num_draft_tokens: int = DEFAULT_DRAFT_TOKENS  # per round, when serving with a draft model

    @property
    def names(self) -> List[str]:
        """Every name a request may give as `model`, the primary id first."""
        return list(dict.fromkeys([self.model_name, *self.aliases]))


def short_name(model: str) -> str:
    """The id a client types for `model`: a directory's name, a GGUF file's stem, or the
    Hugging Face repo id as given."""
    path = Path(model).expanduser()
    if path.is_file():
        return path.stem
    if path.is_dir():
        return path.resolve().name
    return model.rstrip("/")


@dataclass
class Request:
    """A validated request: the job plus what shapes the answer."""

    job: Job
    chat: bool
    stream: bool = False
    include_usage: bool = False
    tools: Optional[list] = None  # OpenAI function tools, when calls are parsed
    tool_markers: Optional[tuple] = None  # (start, end, parse(text, tools) -> dict)
    echo_text: str = ""
    extra: dict = field(default_factory=dict)


def field_(body, name, types, default=None, lo=None, hi=None):
    """body[name] checked against `types` and [lo, hi]; `default` when absent or null."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        names = " or ".join("number" if t is float else t.__name__ for t in types)
        raise APIError(400, f"'{name}' must be {names}, got {type(value).__name__}", name)
    if lo is not None and value < lo or hi is not None and value > hi:
        raise APIError(400, f"'{name}' must be between {lo} and {hi}, got {value}", name)
    return value


def _text(content, where: str, allow_none: bool = False) -> str:
    if content is None and allow_none:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise APIError(400, f"{where} must be a string or a list of text parts", where)


def _tool_calls(calls, i) -> list:
    where = f"messages[{i}].tool_calls"
    out = []
    if not isinstance(calls, list):
        raise APIError(400, f"{where} must be a list", where)
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(400, f"{where}: each call needs function.name", where)
        args = fn.get("arguments", "{}")
        if not isinstance(args, str):
            args = json.dumps(args)
        try:
            json.loads(args)
        except ValueError:
            raise APIError(
                400, f"{where}: function.arguments must be a JSON string", where
            ) from None
        out.append(
            {
                "id": c.get("id") or new_call_id(),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def chat_messages(msgs) -> List[dict]:
    """OpenAI messages normalized for a chat template (text content, tool calls, tool role)."""
    if not isinstance(msgs, list) or not msgs:
        raise APIError(
            400, "'messages' is required: a non-empty list of {role, content} objects", "messages"
        )
    clean = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(
                400, f"messages[{i}] must be an object with a string 'role'", f"messages[{i}]"
            )
        calls = m.get("tool_calls")
        msg = {
            "role": m["role"],
            "content": _text(m.get("content", ""), f"messages[{i}].content", calls is not None),
        }
        if calls:
            msg["tool_calls"] = _tool_calls(calls, i)
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        clean.append(msg)
    return clean


def render_chat(tokenizer, messages: List[dict], tools: Optional[list]) -> List[int]:
    """Token ids of `messages` through the tokenizer's chat template (mlx-lm's plain layout
    when it has none)."""
    if getattr(tokenizer, "has_chat_template", False):
        try:
            return list(
                tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
            )
        except Exception as e:  # jinja templates raise for roles they do not accept
            raise APIError(
                400, f"the chat template rejected the messages ({e})", "messages"
            ) from None
    if tools:
        raise APIError(
            400, "this model's tokenizer has no chat template, so it cannot be given tools", "tools"
        )
    from mlx_lm.server import convert_chat

    return tokenizer.encode(convert_chat(messages))


def completion_prompt(tokenizer, prompt) -> List[int]:
    """The /v1/completions prompt as token ids: a string, or token ids, or one of either in
    a list."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", "prompt")
        return prompt
    if not isinstance(prompt, str) or not prompt:
        raise APIError(
            400,
            "'prompt' is required: a non-empty string or list of token ids "
            "(one prompt per request)",
            "prompt",
        )
    tokens = tokenizer.encode(prompt)
    if not tokens:  # text the vocabulary has no token for: nothing to start from
        raise APIError(400, "'prompt' encodes to no tokens with this model's tokenizer", "prompt")
    return tokens


def tool_markers(tokenizer) -> Optional[tuple]:
    """(start, end, parse) from mlx-lm's tool parser for this tokenizer's template, or None."""
    if not getattr(tokenizer, "has_tool_calling", False):
        return None
    return tokenizer.tool_call_start, tokenizer.tool_call_end, tokenizer.tool_parser


def _tools(body, tokenizer, grammars):
    """(tools for the template, tools whose calls are parsed, markers, grammar or None)."""
    tools = field_(body, "tools", (list,))
    choice = body.get("tool_choice") or ("auto" if tools else "none")
    if not tools:
        if choice not in (None, "none"):
            raise APIError(400, "'tool_choice' needs 'tools'", "tool_choice")
        return None, None, None, None
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                400,
                f"tools[{i}] must be {{'type': 'function', 'function': {{'name', 'parameters'}}}}",
                f"tools[{i}]",
            )
    markers = tool_markers(tokenizer)
    if markers is None:
        raise APIError(
            400,
            "this model's chat template has no tool-call format mlx-lm can "
            "parse, so it cannot be given tools",
            "tools",
        )
    name = None
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or name not in [t["function"]["name"] for t in tools]:
            raise APIError(
                400,
                "'tool_choice' must name one of the tools: {'type': "
                "'function', 'function': {'name': ...}}",
                "tool_choice",
            )
    elif choice not in ("auto", "none", "required"):
        raise APIError(
            400,
            "'tool_choice' must be 'auto', 'none', 'required' or a named function",
            "tool_choice",
        )
    if choice == "none":
        return tools, None, None, None
    grammar = None
    if choice == "required" or name is not None:
        grammar = constrained(
            grammars,
            "tool_choice",
            lambda g: g.tool_call(tools, markers[0], markers[1], name),
            markers,
        )
    return tools, tools, markers, grammar


def constrained(grammars, param: str, build, markers=None) -> str:
    from .constrain import GrammarError

    if grammars is None:
        raise APIError(400, "this server has no constrained decoding", param)
    if markers is not None and markers[2].__module__.split(".")[-1] != "json_tools":
        raise APIError(
            400,
            "tool_choice 'required' or a named function is enforced for "
            "templates whose calls are JSON between markers; this one is not",
            param,
        )
    try:
        return build(grammars)
    except GrammarError as e:
        raise APIError(400, f"'{param}': {e}", param) from None


def _response_format(body, grammars) -> Optional[str]:
    fmt = field_(body, "response_format", (dict,))
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return constrained(grammars, "response_format", lambda g: g.json_schema({"type": "object"}))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(
                400,
                "response_format.json_schema.schema must be a JSON Schema object",
                "response_format",
            )
        return constrained(grammars, "response_format", lambda g: g.json_schema(spec["schema"]))
    raise APIError(
        400,
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
        "response_format",
    )


def _logprobs(body, chat: bool) -> Optional[int]:
    if chat:
        on = field_(body, "logprobs", (bool,), False)
        top = field_(body, "top_logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)
        if top is not None and not on:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return field_(body, "logprobs", (int,), None, 0, MAX_TOP_LOGPROBS)


def _seed(body) -> Optional[int]:
    """An int64 or uint64 seed as the uint64 key MLX takes (negative ones wrap around)."""
    seed = field_(body, "seed", (int,), None, -(1 << 63), (1 << 64) - 1)
    return None if seed is None else seed % (1 << 64)


def sampling(body) -> dict:
    num, big = (int, float), 1 << 31
    s = {
        "temperature": field_(body, "temperature", num, 1.0, 0, 2),
        "top_p": field_(body, "top_p", num, 1.0, 0, 1),
        "top_k": field_(body, "top_k", (int,), 0, 0, big),
        "min_p": field_(body, "min_p", num, 0.0, 0, 1),
        "seed": _seed(body),
        "frequency_penalty": field_(body, "frequency_penalty", num, None, -2, 2),
        "presence_penalty": field_(body, "presence_penalty", num, None, -2, 2),
        "repetition_penalty": field_(body, "repetition_penalty", num, None, 0, 10),
    }
    bias = field_(body, "logit_bias", (dict,))
    if bias:
        try:
            s["logit_bias"] = {int(k): float(v) for k, v in bias.items()}
        except (TypeError, ValueError):
            raise APIError(
                400, "'logit_bias' must map token ids to numbers", "logit_bias"
            ) from None
    return s


def _fit_top_k(s: dict, tokenizer) -> dict:
    """A top_k of the whole vocabulary or more keeps every token: the same as none (0);
    mlx-lm's sampler refuses it mid-generation."""
    vocab = getattr(tokenizer, "vocab_size", None) or len(tokenizer.get_vocab())
    return {**s, "top_k": 0} if s["top_k"] >= vocab else s


def stop_strings(body, name="stop", most=4) -> List[str]:
    stop = body.get(name)
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if (
        not isinstance(stop, list)
        or len(stop) > most
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise APIError(
            400, f"'{name}' must be a string or a list of up to {most} non-empty strings", name
        )
    return stop


def check_model(body, config: ServeConfig):
    model = field_(body, "model", (str,))
    if model is not None and model not in config.names + ["default_model"]:
        raise APIError(
            404,
            f"the model '{model}' does not exist; this server serves "
            f"{', '.join(repr(n) for n in config.names)} (see /v1/models)",
            "model",
            "model_not_found",
        )


def fit_context(tokens, max_tokens, config: ServeConfig, param: str, zero_ok=False) -> int:
    """max_tokens checked against --max-context (default: all the room left)."""
    room = config.max_context - len(tokens)
    if room < (0 if zero_ok else 1):
        raise APIError(
            400,
            f"the prompt is {len(tokens)} tokens; this server's context is "
            f"{config.max_context} tokens (--max-context), which leaves no room to "
            "generate; shorten the prompt",
            param,
            "context_length_exceeded",
        )
    if max_tokens is not None and max_tokens > room:
        raise APIError(
            400,
            f"the prompt ({len(tokens)} tokens) plus max_tokens "
            f"({max_tokens}) is {len(tokens) + max_tokens} tokens, over this "
            f"server's context of {config.max_context} (--max-context); ask for "
            f"at most {room} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return room if max_tokens is None else max_tokens


def _refuse_unsupported(body, chat: bool):
    """400 for what this server does not do (never silently ignored)."""
    for name in UNSUPPORTED + (("echo",) if chat else ()):
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is not supported by this server", name)
    if field_(body, "best_of", (int,), 1) != 1:
        raise APIError(400, "'best_of' must be 1 (this server returns one choice)", "best_of")
    if body.get("modalities") not in (None, ["text"]):
        raise APIError(400, "'modalities' must be ['text']", "modalities")
    n = field_(body, "n", (int,), 1)
    if n != 1:
        raise APIError(400, f"'n' must be 1 (this server returns one choice), got {n}", "n")


def _chat_prompt(body, tokenizer, grammars, grammar):
    """(prompt tokens, parsed tools, markers, grammar) of a chat request."""
    tools, parsed, markers, tool_grammar = _tools(body, tokenizer, grammars)
    if field_(body, "parallel_tool_calls", (bool,), True) is False and parsed:
        if tool_grammar is None:
            raise APIError(
                400,
                "'parallel_tool_calls': false is kept only with tool_choice "
                "'required' or a named function (one call, by grammar)",
                "parallel_tool_calls",
            )
    if tool_grammar is not None:
        if grammar is not None:
            raise APIError(
                400,
                "'response_format' and a forced tool call cannot be combined",
                "response_format",
            )
        grammar = tool_grammar
    tokens = render_chat(tokenizer, chat_messages(body.get("messages")), tools)
    return tokens, parsed, markers, grammar


def parse_request(body, tokenizer, config: ServeConfig, chat: bool, grammars=None) -> Request:
    """Validate an OpenAI chat or completions body into a Request."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    check_model(body, config)
    _refuse_unsupported(body, chat)
    stream = field_(body, "stream", (bool,), False)
    opts = field_(body, "stream_options", (dict,), {})
    big = 1 << 31
    echo = False if chat else field_(body, "echo", (bool,), False)
    max_tokens = field_(body, "max_completion_tokens", (int,), None, 1, big)
    if max_tokens is None:
        max_tokens = field_(body, "max_tokens", (int,), None, 0 if echo else 1, big)
    logprobs = _logprobs(body, chat)
    grammar = _response_format(body, grammars)
    parsed = markers = None
    if chat:
        tokens, parsed, markers, grammar = _chat_prompt(body, tokenizer, grammars, grammar)
    else:
        tokens = completion_prompt(tokenizer, body.get("prompt"))
    max_tokens = fit_context(
        tokens, max_tokens, config, "messages" if chat else "prompt", zero_ok=echo
    )
    job = Job(
        prompt=tokens,
        max_tokens=max_tokens,
        sampling=_fit_top_k(sampling(body), tokenizer),
        stop=stop_strings(body),
        logprobs=logprobs,
        grammar=grammar,
        echo=echo and logprobs is not None,
    )
    echo_text = tokenizer.decode(tokens) if echo else ""
    return Request(
        job=job,
        chat=chat,
        stream=stream,
        include_usage=bool(opts.get("include_usage", False)),
        tools=parsed,
        tool_markers=markers,
        echo_text=echo_text,
    )


# ----------------------------------------------------------------------------- answers


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]
