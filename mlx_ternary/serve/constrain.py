"""Constrained decoding for `serve`: JSON schemas and tool calls enforced with llguidance.

A request's grammar is compiled once when the request is parsed (so a bad schema is a 400
before anything runs); during generation a `GrammarProcessor` is one more mlx-lm logits
processor: it feeds the tokens sampled since its last call to an `llguidance.LLMatcher`
and masks every token the grammar does not allow. JSON is compact (no free whitespace)
and bounded where the schema bounds it (maxLength, minimum/maximum, enum, maxItems), so a
bounded schema always finishes; once it is complete only end-of-sequence is allowed.
"""

import json
import threading
from typing import List, Optional

import mlx.core as mx
import numpy as np

# JSON Schema keywords (2020-12 core, applicator, validation, meta-data, format): llguidance
# rejects those it does not implement; anything outside this list is refused here, since a
# validator would silently ignore it.
SCHEMA_KEYWORDS = {
    "$schema",
    "$id",
    "$ref",
    "$defs",
    "definitions",
    "$comment",
    "$anchor",
    "$vocabulary",
    "$dynamicRef",
    "$dynamicAnchor",
    "title",
    "description",
    "default",
    "examples",
    "deprecated",
    "readOnly",
    "writeOnly",
    "type",
    "enum",
    "const",
    "properties",
    "required",
    "additionalProperties",
    "patternProperties",
    "propertyNames",
    "minProperties",
    "maxProperties",
    "dependentRequired",
    "dependentSchemas",
    "items",
    "prefixItems",
    "additionalItems",
    "contains",
    "minContains",
    "maxContains",
    "minItems",
    "maxItems",
    "uniqueItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "contentEncoding",
    "contentMediaType",
    "contentSchema",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "anyOf",
    "oneOf",
    "allOf",
    "not",
    "if",
    "then",
    "else",
}
# Keywords whose value is a map of names to subschemas, or a list of subschemas.
_SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
_SCHEMA_LISTS = {"anyOf", "oneOf", "allOf", "prefixItems"}
_SCHEMA_ONE = {
    "items",
    "additionalProperties",
    "propertyNames",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "additionalItems",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contentSchema",
}
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A schema or grammar that cannot be enforced; the message says which part."""


def check_schema(schema, where: str = "schema"):
    """Refuse keywords that are not JSON Schema (a validator would ignore them silently)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise GrammarError(f"{where} must be a JSON Schema object")
    for key, value in schema.items():
        if key.startswith("x-"):
            raise GrammarError(f"{where}.{key}: extension keywords are not supported")
        if key not in SCHEMA_KEYWORDS:
            raise GrammarError(
                f"{where}.{key} is not a JSON Schema keyword this server enforces; remove it"
            )
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                check_schema(sub, f"{where}.{key}.{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                check_schema(sub, f"{where}.{key}[{i}]")
        elif key in _SCHEMA_ONE and isinstance(value, (dict, bool)):
            check_schema(value, f"{where}.{key}")


class Grammars:
    """llguidance's view of one tokenizer; compiles grammars and makes processors.

    The view is built on first use (seconds for a 150k vocabulary), so a server that never
    gets a constrained request never pays for it.
    """

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance

        self._llg = llguidance
        self._source, self.vocab_size = tokenizer, vocab_size
        self._view, self._lock = None, threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._view is None:
                from llguidance.hf import from_tokenizer

                tok = self._source
                eos = sorted(getattr(tok, "eos_token_ids", None) or [tok.eos_token_id])
                try:
                    self._view = from_tokenizer(
                        getattr(tok, "_tokenizer", tok), n_vocab=self.vocab_size, eos_token=eos
                    )
                except (ValueError, TypeError, AttributeError) as e:
                    raise GrammarError(
                        f"constrained decoding is unavailable for this "
                        f"tokenizer ({e}); it needs a fast Hugging Face "
                        "tokenizer"
                    ) from None
            return self._view

    def _check(self, grammar: str) -> str:
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return grammar

    def json_schema(self, schema) -> str:
        """The grammar of compact JSON matching `schema`."""
        check_schema(schema)
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        return self._check(grammar)

    def tool_call(self, tools: List[dict], start: str, end: str, name: Optional[str] = None) -> str:
        """The grammar of one call `start{"name": ..., "arguments": {...}}end` to one of
        `tools` (OpenAI function objects), or to the one named `name`."""
        options = []
        for tool in tools:
            fn = tool["function"]
            if name is not None and fn["name"] != name:
                continue
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            check_schema(params, f"tools[{fn['name']}].parameters")
            options.append(
                {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["name", "arguments"],
                    "properties": {"name": {"const": fn["name"]}, "arguments": params},
                }
            )
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = dict(schema, **{"x-guidance": JSON_OPTIONS})
        lark = (
            f"start: {json.dumps(start)} call {json.dumps(end)}\ncall: %json {json.dumps(schema)}\n"
        )
        return self._check(self._llg.LLMatcher.grammar_from_lark(lark))

    def processor(self, grammar: str) -> "GrammarProcessor":
        return GrammarProcessor(
            self._llg.LLMatcher(self.tokenizer, grammar, log_level=0), self.vocab_size
        )


class GrammarProcessor:
    """An mlx-lm logits processor: (tokens so far, logits (1, vocab)) -> masked logits."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.seen: Optional[int] = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.size
        if self.seen is not None and n > self.seen:  # the tokens sampled since last time
            for t in tokens[self.seen :].tolist():
                self.matcher.consume_token(t)
        self.seen = n
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed: {self.matcher.get_error()}")
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: logits.shape[-1]].astype(bool)
        if allowed.size < logits.shape[-1]:
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.size))
        return mx.where(mx.array(allowed), logits, -mx.inf)
