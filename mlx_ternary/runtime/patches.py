"""Every place mlx-ternary reaches into mlx-lm, and why; nothing else patches it.

mlx-lm picks its functions by name at call time from the namespace of the module that
imported them (`from .utils import load_model`), so a replacement must reach every copy.
Six callers use the four mechanisms below:

- `swapped` (for the length of a block, then restored):
  - `lm.routed`: mlx-lm's `load_model`, `linear_to_lora_layers` and `dequantize_model`,
    so mlx-lm's own tools (`mlx-ternary lm TOOL`) load, LoRA-wrap and fuse ternary models;
  - `runtime.shard_plans`: mlx's `shard_linear` / `shard_inplace` as seen by a model's own
    `shard()` method, so mlx-lm's tensor-parallel plans shard TernaryLinear too.
- `rebind_for_life` (for the life of the process, inert for other models):
  - `runtime.adapters.route_dora` (called by `load()`): mlx-lm's `linear_to_lora_layers`,
    whose DoRA branch asks no layer hook and refuses TernaryLinear, becomes
    `adapters.linear_to_lora_layers`, which converts ternary layers to TernaryDoRALinear and
    hands everything else (and any model without ternary layers) to mlx-lm's own. Reaches
    mlx-lm's callers (`load_adapters`, the lora trainer) and any later
    `from mlx_lm.tuner.utils import linear_to_lora_layers`; a name bound before the first
    `load()` keeps mlx-lm's function.
- `route_function` (for the life of the process, inert for other models):
  - `runtime.cpu.attention` (`route_attention`): mlx-lm's `scaled_dot_product_attention` in
    the modules of one model's classes, and that model's class `__call__`, so the native CPU
    attention runs inside that model only;
  - `runtime.cpu.activation` (`route_swiglu`): mlx-lm's `swiglu` the same way, so the
    native SwiGLU runs inside that model only.
- `route_blocks` (for the life of the model, inert for other models):
  - `runtime.cpu.block`: the class of each of one model's mlx-lm decoder blocks of a
    supported class (llama's, qwen2's and qwen3's TransformerBlock) becomes a subclass of the same name whose
    `__call__` first tries the fused native block and otherwise runs mlx-lm's own, so a
    decode step issues three native ops a layer instead of ~25 MLX ops; the block's own
    conditions (runtime/cpu/block.py) keep everything else - training, LoRA, other caches,
    other devices - on mlx-lm's path.
"""

import sys
from contextlib import contextmanager
from functools import lru_cache, wraps
from typing import Callable, Dict, Iterable, List


def mlx_lm_namespaces() -> List[dict]:
    """The global namespaces of every imported mlx-lm module."""
    return [
        vars(m)
        for name, m in list(sys.modules.items())
        if m is not None and (name == "mlx_lm" or name.startswith("mlx_lm."))
    ]


def _rebind(replacements: Dict[Callable, Callable], namespaces: Iterable[dict]) -> list:
    """Bind each name bound to a key of `replacements` to its value; returns the undo list."""
    by_id = {id(old): (old, new) for old, new in replacements.items()}
    undo = []
    for namespace in namespaces:
        for name, value in list(namespace.items()):
            old, new = by_id.get(id(value), (None, None))
            if old is value:
                undo.append((namespace, name, value))
                namespace[name] = new
    return undo


def rebind_for_life(replacements: Dict[Callable, Callable]) -> None:
    """For the rest of the process, every name in an imported mlx-lm module bound to a key
    of `replacements` is bound to its value (calling it again is harmless)."""
    _rebind(replacements, mlx_lm_namespaces())


@contextmanager
def swapped(replacements: Dict[Callable, Callable], extra: Iterable[dict] = ()):
    """Within the block, every name in an mlx-lm module (and in the `extra` namespaces) that
    is bound to a key of `replacements` is bound to its value; restored on exit."""
    undo = _rebind(replacements, [*extra, *mlx_lm_namespaces()])
    try:
        yield
    finally:
        for namespace, name, value in reversed(undo):
            namespace[name] = value


@lru_cache(maxsize=None)
def _wrapped_class(cls, around: Callable):
    @wraps(cls.__call__)  # its signature stays the class's: mlx-lm inspects it
    def __call__(self, *args, **kwargs):
        with around():
            return cls.__call__(self, *args, **kwargs)

    attrs = {"__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls,), attrs)


def route_function(
    model, name: str, original: Callable, dispatcher: Callable[[Callable], Callable], around
) -> bool:
    """Replace mlx-lm's function `original`, bound as `name`, with `dispatcher(original)` in
    the modules that define `model`'s classes, and run `model`'s calls inside `around()` (a
    context manager the dispatcher checks, so other models keep mlx-lm's function).

    The model's class is swapped for a subclass of the same name whose `__call__` adds only
    `around()`. Returns False (and changes nothing) when no module of the model calls
    `original` by that name.
    """
    original = getattr(original, "__wrapped__", original)
    found = False
    for module_name in {type(m).__module__ for m in model.modules()}:
        module = sys.modules.get(module_name)
        fn = getattr(module, name, None)
        if fn is original:
            replacement = dispatcher(original)
            replacement.__wrapped__ = original
            setattr(module, name, replacement)
            found = True
        elif getattr(fn, "__wrapped__", None) is original:
            found = True
    if found and getattr(type(model), "_routed_around", None) is not around:
        model.__class__ = _wrapped_class(type(model), around)
        model.__class__._routed_around = around
    return found


def is_routed(model, name: str, original: Callable, around) -> bool:
    """Whether `route_function` routed `model`'s calls of `original` (bound as `name`) inside
    `around()`: its class runs in `around()` and one of its modules binds the replacement."""
    if getattr(type(model), "_routed_around", None) is not around:
        return False
    original = getattr(original, "__wrapped__", original)
    modules = {type(m).__module__ for m in model.modules()}
    return any(
        getattr(getattr(sys.modules.get(m), name, None), "__wrapped__", None) is original
        for m in modules
    )


def route_attention(model, dispatcher: Callable[[Callable], Callable], around: Callable) -> bool:
    """`route_function` for mlx-lm's `scaled_dot_product_attention`."""
    from mlx_lm.models import base

    return route_function(
        model, "scaled_dot_product_attention", base.scaled_dot_product_attention, dispatcher, around
    )


def attention_routed(model, around: Callable) -> bool:
    """`is_routed` for mlx-lm's `scaled_dot_product_attention`."""
    from mlx_lm.models import base

    return is_routed(
        model, "scaled_dot_product_attention", base.scaled_dot_product_attention, around
    )


def swiglu_routed(model, around: Callable) -> bool:
    """`is_routed` for mlx-lm's `swiglu`."""
    from mlx_lm.models import activations

    return is_routed(model, "swiglu", activations.swiglu, around)


def route_swiglu(model, dispatcher: Callable[[Callable], Callable], around: Callable) -> bool:
    """`route_function` for mlx-lm's `swiglu` (the gate of llama-style MLPs)."""
    from mlx_lm.models import activations

    return route_function(model, "swiglu", activations.swiglu, dispatcher, around)


@lru_cache(maxsize=None)
def _fused_class(cls, fused: Callable):
    @wraps(cls.__call__)  # the signature stays the class's
    def __call__(self, *args, **kwargs):
        out = fused(self, *args, **kwargs)
        return cls.__call__(self, *args, **kwargs) if out is None else out

    attrs = {
        "__call__": __call__,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_fused_from": cls,
    }
    return type(cls.__name__, (cls,), attrs)


def route_blocks(model, fused: Dict[type, Callable]) -> bool:
    """Swap the class of each module of `model` whose class is a key of `fused` for a
    subclass of the same name whose `__call__` returns `fused[cls](block, *args, **kwargs)`
    unless that is None, and else runs the class's own `__call__`. Returns whether any
    module was routed (or already was)."""
    found = False
    for m in model.modules():
        cls = type(m)
        base = getattr(cls, "_fused_from", None)
        if base is not None and cls.__dict__.get("_fused_from") is base:
            found = True
        elif cls in fused:
            m.__class__ = _fused_class(cls, fused[cls])
            found = True
    return found


def blocks_routed(model) -> bool:
    """Whether `route_blocks` routed any module of `model`."""
    return any("_fused_from" in type(m).__dict__ for m in model.modules())
