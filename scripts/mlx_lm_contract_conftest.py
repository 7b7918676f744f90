"""The redirection under mlx-lm's own test files: copied as conftest.py next to them by
scripts/mlx_lm_contract.py, which sets, for each run:

    MLX_LM_CONTRACT_SIDE   "ternary" or "float"
    MLX_LM_CONTRACT_MODEL  the local model directory every hub repo id resolves to

pytest imports this file before it collects the test modules, so every name the tests bind
at import (`from mlx_lm.utils import load`) is already the redirected one.

Both sides: `huggingface_hub.snapshot_download`, as mlx-lm's `_download` and
`hf_repo_to_path` call it, answers any repo id with the local model directory (the tests'
`HF_MODEL_PATH = "mlx-community/Qwen1.5-0.5B-Chat-4bit"`, ...) and records the id, and
`hf_hub_download` (mlx-lm's `convert` reads the model card with it) gives that directory's
file; no download is attempted. On the float side nothing else changes: stock mlx-lm loads
the float twin.

Ternary side, in addition:
- `mlx_lm.utils.load`, in every mlx-lm module that bound it, resolves the path as mlx-lm does
  and hands a ternary checkpoint to `mlx_ternary.load(..., backend="native")` (anything else
  to mlx-lm's own `load`);
- `mlx_ternary.lm.routed()` for the whole session, so direct calls of mlx-lm's
  `load_model` (its `convert`, `test_load_model_*`) build the ternary model too;
- `MLX_TERNARY_BACKEND=native`, so every ternary layer runs on the native CPU kernel.
"""

import os
from contextlib import ExitStack
from pathlib import Path

SIDE_ENV = "MLX_LM_CONTRACT_SIDE"
MODEL_ENV = "MLX_LM_CONTRACT_MODEL"
SIDES = ("ternary", "float")
REDIRECTED = []  # the hub repo ids asked for, in order


def local_snapshot(model_dir: Path):
    """A `snapshot_download` that answers every repo id with `model_dir`."""

    def snapshot_download(repo_id, *args, **kwargs):
        REDIRECTED.append(repo_id)
        return str(model_dir)

    return snapshot_download


def local_file(model_dir: Path):
    """An `hf_hub_download` that answers every repo id with `model_dir`'s file."""

    def hf_hub_download(repo_id, filename, *args, **kwargs):
        REDIRECTED.append(repo_id)
        path = Path(model_dir) / filename
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no {filename} in the local model for {repo_id}")
        return str(path)

    return hf_hub_download


def ternary_load(mlx_load):
    """mlx-lm's `load` with ternary checkpoints sent to `mlx_ternary.load` (native backend)."""

    def load(
        path_or_hf_repo,
        tokenizer_config=None,
        model_config=None,
        adapter_path=None,
        lazy=False,
        return_config=False,
        revision=None,
        trust_remote_code=False,
    ):
        import mlx_lm.utils

        import mlx_ternary
        from mlx_ternary.lm import is_ternary_checkpoint

        path = mlx_lm.utils._download(path_or_hf_repo, revision=revision)
        if not is_ternary_checkpoint(path):
            return mlx_load(
                path_or_hf_repo,
                tokenizer_config,
                model_config,
                adapter_path,
                lazy,
                return_config,
                revision,
                trust_remote_code,
            )
        if model_config:
            raise ValueError(f"model_config {sorted(model_config)} given for a ternary model")
        return mlx_ternary.load(
            str(path),
            tokenizer_config=tokenizer_config,
            adapter_path=adapter_path,
            lazy=lazy,
            return_config=return_config,
            backend="native",
        )

    return load


def install(side: str, model_dir) -> ExitStack:
    """Put the redirection for `side` in place; closing the returned stack undoes it."""
    if side not in SIDES:
        raise ValueError(f"${SIDE_ENV} must be one of {SIDES}, got {side!r}")
    import huggingface_hub
    import huggingface_hub.repocard
    import mlx_lm.convert  # noqa: F401 (imported so that its names are rebound too)
    import mlx_lm.generate  # noqa: F401
    import mlx_lm.utils

    from mlx_ternary.runtime.patches import swapped

    stack = ExitStack()
    hub = {
        huggingface_hub.snapshot_download: local_snapshot(Path(model_dir)),
        huggingface_hub.hf_hub_download: local_file(Path(model_dir)),
    }
    stack.enter_context(swapped(hub, extra=[vars(huggingface_hub), vars(huggingface_hub.repocard)]))
    if side == "ternary":
        from mlx_ternary.lm import routed
        from mlx_ternary.runtime.dispatch import ENV_BACKEND

        previous = os.environ.get(ENV_BACKEND)
        os.environ[ENV_BACKEND] = "native"
        stack.callback(_restore_env, ENV_BACKEND, previous)
        stack.enter_context(swapped({mlx_lm.utils.load: ternary_load(mlx_lm.utils.load)}))
        stack.enter_context(routed())
    return stack


def _restore_env(name: str, value) -> None:
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


if os.environ.get(SIDE_ENV):  # as conftest.py: for the whole session, never undone
    SESSION = install(os.environ[SIDE_ENV], os.environ[MODEL_ENV])


def pytest_report_header(config):
    side = os.environ.get(SIDE_ENV)
    return f"mlx-lm contract: {side} side, hub ids -> {os.environ.get(MODEL_ENV)}" if side else None


def pytest_terminal_summary(terminalreporter):
    if REDIRECTED:
        ids = ", ".join(sorted(set(REDIRECTED)))
        terminalreporter.write_line(f"mlx-lm contract: hub ids redirected: {ids}")
