"""mlx-lm's own commands (`mlx-ternary lm TOOL`) with model loading routed through mlx-ternary.

Every mlx-lm tool loads a model through `mlx_lm.utils.load` or `sharded_load`, and both
look up the module-level `mlx_lm.utils.load_model` when they run. Replacing that one
function while a tool runs routes every tool, whatever names it imported and whatever
flags it has: a ternary checkpoint (the ternary format, or Hugging Face BitNet) is built by
`load.load_model`; anything else goes to mlx-lm's own loader, untouched. mlx-lm then
attaches adapters and loads the tokenizer itself, as for any model. Two more mlx-lm
functions are swapped while a tool runs, both delegating to mlx-lm for non-ternary
layers: the LoRA converter (mlx-lm asks layers for no DoRA hook) and `dequantize_model`
(`fuse --dequantize` of a ternary base).
"""

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, List

from .checkpoint.readers import hf_bitnet, ternary
from .errors import TernaryError

# mlx-lm 0.32's subcommands (mlx_lm/cli.py) and the module each runs.
TOOLS: Dict[str, str] = {
    **{
        t: t
        for t in (
            "benchmark",
            "cache_prompt",
            "chat",
            "convert",
            "evaluate",
            "fuse",
            "generate",
            "lora",
            "manage",
            "perplexity",
            "server",
            "upload",
            "share",
        )
    },
    **{t: f"quant.{t}" for t in ("awq", "dwq", "dynamic_quant", "gptq")},
}
# Tools that re-quantize a model's float layers: ternary layers are not theirs to change.
REQUANTIZERS = ("convert", "awq", "dwq", "dynamic_quant", "gptq")
PIP_NAMES = {"lm_eval": "lm-eval"}  # import name -> the distribution to install


def is_ternary_checkpoint(model_path) -> bool:
    """True for a directory mlx-ternary loads and stock mlx-lm cannot (ternary format, HF BitNet).

    MLX 2-bit affine packs (Ternary-Bonsai) stay with mlx-lm, which runs them as they are.
    """
    path = Path(model_path)
    try:
        return ternary.detect(path) or hf_bitnet.detect(path)
    except TernaryError:
        return False  # an unreadable config: mlx-lm's loader reports it


def _routed_load_model(mlx_load_model, tool: str):
    def load_model(
        model_path,
        lazy=False,
        strict=True,
        model_config=None,
        get_model_classes=None,
        trust_remote_code=False,
    ):
        if not is_ternary_checkpoint(model_path):
            kwargs = {} if get_model_classes is None else {"get_model_classes": get_model_classes}
            return mlx_load_model(
                model_path,
                lazy,
                strict,
                model_config,
                trust_remote_code=trust_remote_code,
                **kwargs,
            )
        if tool in REQUANTIZERS:
            raise TernaryError(
                f"{model_path}: a ternary checkpoint; mlx-lm's {tool} re-quantizes float "
                "layers and would not know its ternary ones. Use `mlx-ternary convert` "
                "(-q BITS for a stock MLX checkpoint, -d for float, --to-gguf for llama.cpp)"
            )
        if get_model_classes is not None:
            return _own_classes(mlx_load_model, model_path, lazy, strict, get_model_classes)
        overrides = sorted(k for k, v in (model_config or {}).items() if v)
        if overrides:
            raise TernaryError(
                f"{model_path}: {', '.join(overrides)} do not apply to ternary "
                "checkpoints (mlx-ternary builds mlx-lm's class for the config "
                "as it is); drop them"
            )
        from .checkpoint.load import load_model as ternary_load_model

        return ternary_load_model(Path(model_path), lazy=lazy)

    return load_model


def _own_classes(mlx_load_model, model_path, lazy, strict, get_model_classes):
    """mlx-lm's `load_model` with the caller's classes: they get the checkpoint's tensors as
    stored (packed trits and scales under the format's names), as mlx-lm hands any model its
    file's tensors; the format's quantization block is held back (mlx-lm has no layer for it)."""
    model, config = mlx_load_model(
        Path(model_path), lazy, strict, {"quantization": None}, get_model_classes=get_model_classes
    )
    config.pop("quantization", None)
    return model, config


@contextmanager
def routed(tool: str = "python"):
    """While inside, mlx-lm's loaders, LoRA converter and dequantizer handle ternary models.

    `with mlx_ternary.lm.routed(): model, tok = mlx_lm.load(path)` works in Python too.
    """
    import mlx_lm.utils as mlx_utils
    from mlx_lm.tuner import utils as tuner

    from .runtime import adapters, patches

    replacements = {  # patches.py says why each is replaced
        mlx_utils.load_model: _routed_load_model(mlx_utils.load_model, tool),
        tuner.linear_to_lora_layers: adapters.linear_to_lora_layers,
        mlx_utils.dequantize_model: adapters.dequantize_model,
    }
    with patches.swapped(replacements):
        yield


def import_tool(tool: str):
    """The mlx-lm module that implements `tool`, with one clear error when it cannot run."""
    if tool not in TOOLS:
        raise TernaryError(
            f"unknown mlx-lm tool {tool!r}; mlx-lm's tools are {', '.join(sorted(TOOLS))}"
        )
    try:
        return importlib.import_module(f"mlx_lm.{TOOLS[tool]}")
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] == "mlx_lm":
            raise
        package = PIP_NAMES.get(e.name.split(".")[0], e.name.split(".")[0])
        raise TernaryError(
            f"mlx-lm's {tool} needs the Python package {package}, which is not "
            f"installed: pip install {package}"
        ) from None


MODEL_FLAGS = ("--model", "--draft-model")


def gguf_args(args: List[str], notify=None) -> List[str]:
    """`--model FILE.gguf` -> the ternary-format directory it is converted to once (gguf_cache), so
    mlx-lm finds a config, weights and tokenizer there."""
    from .checkpoint.gguf_cache import ternary_dir
    from .checkpoint.readers import gguf

    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if eq and flag in MODEL_FLAGS and gguf.detect(Path(value)):
            out[i] = f"{flag}={ternary_dir(Path(value), notify=notify)}"
        elif arg in MODEL_FLAGS and i + 1 < len(out) and gguf.detect(Path(out[i + 1])):
            out[i + 1] = str(ternary_dir(Path(out[i + 1]), notify=notify))
    return out


def run_tool(tool: str, args: List[str], notify=None) -> None:
    """Run mlx-lm's `tool` with command-line `args`, ternary checkpoints loading as any other.

    A .gguf file given as --model is converted once into the cache (`notify` says so)."""
    module = import_tool(tool)
    saved = sys.argv
    sys.argv = [f"mlx-ternary lm {tool}", *gguf_args(args, notify)]
    try:
        with routed(tool):
            module.main()
    finally:
        sys.argv = saved
