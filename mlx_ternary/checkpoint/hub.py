"""Where a model lives: a local directory, or a Hugging Face repo id downloaded on request."""

from pathlib import Path
from typing import Optional

from ..errors import TernaryError

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]


def _download(repo: str, revision: Optional[str]) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        return Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_PATTERNS))
    except GatedRepoError:
        raise TernaryError(
            f"{repo}: the repository is gated; accept its terms on the Hub "
            "and log in with `hf auth login`"
        ) from None
    except RepositoryNotFoundError:
        raise TernaryError(
            f"{repo}: no such model directory here and no such repository on the "
            "Hugging Face Hub (if private, log in with `hf auth login`)"
        ) from None
    except RevisionNotFoundError:
        raise TernaryError(f"{repo}: revision {revision!r} not found on the Hub") from None
    except (LocalEntryNotFoundError, OSError) as e:
        raise TernaryError(
            f"{repo}: not a local directory, and downloading it from the Hugging "
            f"Face Hub failed ({type(e).__name__}); check the path, or the "
            "network, or pass a local copy"
        ) from None


def model_dir(path_or_hf_repo: str, revision: Optional[str] = None) -> Path:
    """A local model directory, downloading a hub repo id when it is not a local path."""
    p = Path(path_or_hf_repo).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        raise TernaryError(
            f"{p}: is a file, not a model directory (or a .gguf file); other "
            "single files are not models mlx-ternary reads"
        )
    repo = str(path_or_hf_repo)
    if repo.count("/") != 1 or repo.startswith((".", "/", "~")):
        raise TernaryError(
            f"{path_or_hf_repo}: no such model directory (and not a Hugging Face "
            "repo id of the form owner/name)"
        )
    return _download(repo, revision)
