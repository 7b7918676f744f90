"""The server's OpenAPI 3.1 document (GET /openapi.json): every route, its body, its errors.

Request bodies are stated with the limits the parsers enforce (openai.py, anthropic.py,
endpoints.py import nothing from here; the numbers come from their constants), so the
document serves client generators and drives the schemathesis run of the tests and of
scripts/fuzz_server.py. Error answers have the API's own shape: OpenAI's
{"error": {message, type, param, code}} or, on /v1/messages, Anthropic's
{"type": "error", "error": {type, message}}.
"""

from typing import Iterable, Tuple

from . import anthropic
from .openai import MAX_TOP_LOGPROBS, UNSUPPORTED

NUMBER = {"type": "number"}
TEXT = {"type": "string"}
STOP = {"oneOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 4}]}
CONTENT = {"oneOf": [TEXT, {"type": "array", "items": {"type": "object"}}]}
MESSAGE = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
        "content": {"oneOf": [CONTENT, {"type": "null"}]},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "tool_call_id": TEXT,
        "name": TEXT,
    },
}


def _range(lo, hi, kind="number") -> dict:
    return {"type": kind, "minimum": lo, "maximum": hi}


SAMPLING = {
    "model": TEXT,
    "temperature": _range(0, 2),
    "top_p": _range(0, 1),
    "top_k": _range(0, 1 << 31, "integer"),
    "min_p": _range(0, 1),
    "seed": {"type": "integer"},
    "frequency_penalty": _range(-2, 2),
    "presence_penalty": _range(-2, 2),
    "repetition_penalty": _range(0, 10),
    "logit_bias": {"type": "object", "additionalProperties": NUMBER},
    "stop": STOP,
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "max_tokens": _range(1, 1 << 31, "integer"),
    "n": {"const": 1},
    "best_of": {"const": 1},
}
CHAT = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        **SAMPLING,
        "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
        "max_completion_tokens": _range(1, 1 << 31, "integer"),
        "logprobs": {"type": "boolean"},
        "top_logprobs": _range(0, MAX_TOP_LOGPROBS, "integer"),
        "tools": {"type": "array", "items": {"type": "object"}},
        "tool_choice": {"oneOf": [TEXT, {"type": "object"}]},
        "parallel_tool_calls": {"type": "boolean"},
        "response_format": {"type": "object"},
    },
}
COMPLETION = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        **SAMPLING,
        "prompt": {"oneOf": [TEXT, {"type": "array", "items": {"type": "integer", "minimum": 0}}]},
        "echo": {"type": "boolean"},
        "logprobs": _range(0, MAX_TOP_LOGPROBS, "integer"),
    },
}
MESSAGES = {
    "type": "object",
    "required": ["max_tokens", "messages"],
    "additionalProperties": False,
    "properties": {
        name: schema
        for name, schema in {
            "model": TEXT,
            "max_tokens": _range(1, 1 << 31, "integer"),
            "messages": {"type": "array", "items": MESSAGE, "minItems": 1},
            "system": CONTENT,
            "stop_sequences": {"type": "array", "items": TEXT, "maxItems": 16},
            "stream": {"type": "boolean"},
            "temperature": _range(0, 1),
            "top_p": _range(0, 1),
            "top_k": _range(0, 1 << 31, "integer"),
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_choice": {"type": "object"},
            "metadata": {"type": "object"},
        }.items()
        if name in anthropic.SUPPORTED
    },
}
TOKENIZE = {
    "type": "object",
    "properties": {
        "model": TEXT,
        "content": TEXT,
        "prompt": TEXT,
        "add_special": {"type": "boolean"},
        "add_special_tokens": {"type": "boolean"},
        "with_pieces": {"type": "boolean"},
    },
}
DETOKENIZE = {
    "type": "object",
    "required": ["tokens"],
    "properties": {
        "model": TEXT,
        "tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    },
}
OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type"],
            "properties": {
                "message": TEXT,
                "type": TEXT,
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {"type": TEXT, "message": TEXT},
        },
    },
}
# path (without /v1) -> request body schema, for the POST routes
BODIES = {
    "/chat/completions": CHAT,
    "/completions": COMPLETION,
    "/messages": MESSAGES,
    "/tokenize": TOKENIZE,
    "/detokenize": DETOKENIZE,
}


def _operation(method: str, path: str) -> dict:
    error = ANTHROPIC_ERROR if path.endswith("/messages") else OPENAI_ERROR
    problem = {"description": "refused", "content": {"application/json": {"schema": error}}}
    op = {
        "operationId": f"{method.lower()}{path.replace('/', '_') or '_root'}",
        "responses": {
            "200": {"description": "the answer (JSON, or text/event-stream when streaming)"},
            "4XX": problem,
            "503": problem,
        },
    }
    body = BODIES.get(path.removeprefix("/v1"))
    if method == "POST" and body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    return op


def document(routes: Iterable[Tuple[str, str]], title: str, version: str) -> dict:
    """The OpenAPI 3.1 document of `routes` ((method, path) pairs the server answers)."""
    paths: dict = {}
    for method, path in sorted(routes, key=lambda r: (r[1], r[0])):
        paths.setdefault(path, {})[method.lower()] = _operation(method, path)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": title,
            "version": version,
            "description": "OpenAI- and Anthropic-compatible endpoints of mlx-ternary serve; "
            f"not accepted: {', '.join(UNSUPPORTED)}",
        },
        "components": {
            "securitySchemes": {
                "bearer": {"type": "http", "scheme": "bearer"},
                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        },
        "paths": paths,
    }
