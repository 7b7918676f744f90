"""config.json checked against the architecture's own ModelArgs before a model is built.

mlx-lm's `ModelArgs.from_dict` keeps the config keys that are fields of the dataclass
and passes them on unchecked: a `hidden_size` of 0, 1.5 or null surfaces later as a
ZeroDivisionError, a TypeError from mx.random or a bare assert. `check_args` reads the
field types off the dataclass (`dataclasses.fields` + type hints), so every field the
class reads is held to its declared type, and size-like fields to a positive range.
"""

import dataclasses
import json
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Optional

from ...errors import FormatError

# Fields that count or size something: at least 1 (at least 0 where the class's own
# default is 0, e.g. num_shared_experts of a dense variant).
SIZE_FIELD = re.compile(
    r"(^num_|_size$|_heads$|_layers$|_dim$|_experts$|^vocab_size$|^max_position_embeddings$)"
)
# Float fields that must be strictly positive (norm epsilons, RoPE bases).
POSITIVE_FLOAT = re.compile(r"(eps|theta)")
_NONE = type(None)
_UNIONS = (typing.Union, types.UnionType)


def _describe(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        return " or ".join(_describe(a) for a in args)
    if hint is _NONE:
        return "null"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if hint in names:
        return names[hint]
    base = origin or hint
    if base in (list, tuple):
        return "a list"
    if base is dict:
        return "an object"
    return str(hint)


def _fits(value: Any, hint) -> bool:
    """Whether a JSON value fits a type hint (containers: the container, scalar items)."""
    if hint is Any or hint is None:
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in _UNIONS:
        return any(_fits(value, a) for a in args)
    if hint is _NONE:
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    base = origin or hint
    if base in (list, tuple):
        item = args[0] if args else Any
        scalar = item in (int, float, str, bool)
        return isinstance(value, list) and (not scalar or all(_fits(v, item) for v in value))
    if base is dict:
        return isinstance(value, dict)
    return True  # a type this check does not model: left to the class


def _range_problem(name: str, value: Any, default: Any) -> Optional[str]:
    if isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return "a finite number"
    if isinstance(value, int) and SIZE_FIELD.search(name):
        low = 0 if isinstance(default, int) and default <= 0 else 1
        if value < low:
            return f"an integer >= {low}"
    if isinstance(value, (int, float)) and POSITIVE_FLOAT.search(name) and value <= 0:
        return "a number > 0"
    return None


def _refuse(where: Path, name: str, value: Any, expected: str) -> FormatError:
    return FormatError(
        f"{where}: field {name} is {_show(value)} (a JSON {_json(value)}); expected {expected}; "
        "fix config.json or re-download the model"
    )


def _show(value: Any) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _json(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), "array" if isinstance(value, list) else "object"
    )


def check_args(config: dict, args_class, where: Path) -> None:
    """Refuse a config whose fields do not fit `args_class` (one FormatError naming the field).

    Args:
        where: the file the config came from (config.json, or a .gguf file's metadata).
    """
    if not dataclasses.is_dataclass(args_class):
        return
    try:
        hints = typing.get_type_hints(args_class)
    except Exception:  # an annotation this Python cannot resolve: nothing to check against
        return
    for f in dataclasses.fields(args_class):
        if not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if f.name not in config:
            if required:
                raise _refuse(where, f.name, None, f"{_describe(hints.get(f.name))} (required)")
            continue
        value, hint = config[f.name], hints.get(f.name, Any)
        default = None if required else f.default
        if value is None and not required and not SIZE_FIELD.search(f.name):
            continue  # an optional setting left unset: the class's default path
        if not _fits(value, hint):
            raise _refuse(where, f.name, value, _describe(hint))
        problem = _range_problem(f.name, value, default)
        if problem:
            raise _refuse(where, f.name, value, problem)
    _check_heads(config, where)


def _check_heads(config: dict, where: Path) -> None:
    """The attention head counts the layers divide by."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    kv = config.get("num_key_value_heads")
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (hidden, heads))
    if ints and heads > 0 and config.get("head_dim") is None and hidden % heads:
        raise _refuse(
            where,
            "num_attention_heads",
            heads,
            f"a divisor of hidden_size {hidden} (or a head_dim field)",
        )
    kv_int = isinstance(kv, int) and not isinstance(kv, bool) and kv > 0
    if kv_int and isinstance(heads, int) and not isinstance(heads, bool) and heads % kv:
        raise _refuse(where, "num_key_value_heads", kv, f"a divisor of num_attention_heads {heads}")


def check_scale(config: dict, where: Path, weight_bytes: int) -> None:
    """Refuse sizes the weights cannot hold, before a class builds layer objects for them.

    Every layer of every architecture holds at least `hidden_size` norm weights of at
    least one byte, and the embedding at least one bit per entry: a config claiming more
    than its files hold (a corrupt num_hidden_layers of 2**32) is refused here instead of
    building billions of modules.
    """
    ints = {
        k: config.get(k)
        for k in ("num_hidden_layers", "hidden_size", "vocab_size")
        if isinstance(config.get(k), int)
    }
    if weight_bytes <= 0 or len(ints) < 3:
        return
    layers, hidden, vocab = ints["num_hidden_layers"], ints["hidden_size"], ints["vocab_size"]
    for name, need in (("num_hidden_layers", layers * hidden), ("vocab_size", vocab * hidden // 8)):
        if need > weight_bytes:
            raise _refuse(
                where,
                name,
                config[name],
                f"a size the {weight_bytes}-byte weights can hold (hidden_size {hidden})",
            )


def check_counts(config: dict, names, where: Path) -> None:
    """The named fields are integers >= 1 (for a reader that divides by them)."""
    for name in names:
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise _refuse(where, name, value, "an integer >= 1")
