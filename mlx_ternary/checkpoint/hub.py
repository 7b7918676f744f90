"""Where a model lives: a local directory, or a Hugging Face repo id downloaded on request.

A repo id downloads what a model directory needs (HUB_PATTERNS) into huggingface_hub's
cache; `owner/repo:Q` (or `gguf_file=NAME`) picks one GGUF file of a GGUF repo and
downloads only that file, as `llama-cli -hf owner/repo:Q` does. Each file is fetched with
`hf_hub_download`, which resumes an interrupted transfer with a Range request and checks
the size; the hash it does not check (huggingface_hub 2.4 compares sizes only): every
file downloaded here is hashed against the Hub's record (sha256 for LFS files, the git
blob id otherwise) and a mismatch is removed and refused. Files already in the cache are
not downloaded or hashed again.

Timeouts are huggingface_hub's: HF_HUB_ETAG_TIMEOUT (default 10 s) for the listing and
each file's metadata, HF_HUB_DOWNLOAD_TIMEOUT for a transfer without a byte, after which
it retries 5 times, resuming, a second apart. Its default (10 s) makes a stalled transfer
fail after 6 x 11 = 66 s; unless HF_HUB_DOWNLOAD_TIMEOUT is set, downloads here wait
STALL_TIMEOUT (7 s: 48 s in all). The library reports through callbacks; the CLI prints.
Written against huggingface_hub 2.4 (httpx); nothing here names its HTTP library, so
the requests-based 0.x releases answer the same way.
"""

import fnmatch
import hashlib
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, List, Optional, Tuple

from ..errors import TernaryError

HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.txt", "*.jinja"]
GGUF_SHARD = re.compile(r"-\d{5}-of-\d{5}\.gguf$")

HTTP_MODULES = ("huggingface_hub", "httpx", "httpx2", "httpcore", "requests", "urllib3")
STALL_TIMEOUT = 7  # s without a byte, unless HF_HUB_DOWNLOAD_TIMEOUT says otherwise
Progress = Callable[[str, int, int], None]  # (file name, bytes done, bytes total)
Notify = Callable[[str], None]  # one line: what is downloaded, and where


def split_spec(spec: str) -> Tuple[str, Optional[str]]:
    """`owner/repo:Q` -> ("owner/repo", "Q"); `owner/repo` -> ("owner/repo", None)."""
    repo, sep, quant = spec.partition(":")
    return repo, (quant or None) if sep else None


def is_repo_id(spec: str) -> bool:
    repo = split_spec(spec)[0]
    return repo.count("/") == 1 and not repo.startswith((".", "/", "~")) and all(repo.split("/"))


def fmt_size(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _callback_bar(name: str, progress: Optional[Progress]):
    """A class huggingface_hub builds as its progress bar (tqdm's calls only), that hands
    each update to `progress`."""

    class Bar:
        def __init__(self, *args, total=None, initial=0, **kwargs):
            self.total, self.n = total, initial

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, n=1):
            self.n += n
            if progress:
                progress(name, self.n, self.total or 0)

        def close(self):
            pass

    return Bar


@contextmanager
def _stall_limit():
    """huggingface_hub's transfer timeout at STALL_TIMEOUT for the block, unless the user
    set HF_HUB_DOWNLOAD_TIMEOUT (it reads the module constant at each transfer)."""
    from huggingface_hub import constants

    old = constants.HF_HUB_DOWNLOAD_TIMEOUT
    if "HF_HUB_DOWNLOAD_TIMEOUT" not in os.environ:
        constants.HF_HUB_DOWNLOAD_TIMEOUT = min(old, STALL_TIMEOUT)
    try:
        yield
    finally:
        constants.HF_HUB_DOWNLOAD_TIMEOUT = old


def _errors():
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    return GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError


def _timed_out(e: BaseException) -> bool:
    """A timeout anywhere in the exception's chain (httpx's or requests' *Timeout*)."""
    while e is not None:
        if isinstance(e, TimeoutError) or any("Timeout" in c.__name__ for c in type(e).__mro__):
            return True
        e = e.__cause__ or e.__context__
    return False


def _from_http(e: BaseException) -> bool:
    """Raised by huggingface_hub or the HTTP library under it (not a bug of ours)."""
    return type(e).__module__.split(".")[0] in HTTP_MODULES


def _unanswered(e: BaseException) -> bool:
    """No HTTP answer at all (connection refused or reset, a timeout), not an HTTP error."""
    return getattr(e, "response", None) is None


def _hub_error(repo: str, revision: Optional[str], e: Exception) -> TernaryError:
    """One line for what huggingface_hub raised."""
    from huggingface_hub import constants

    gated, local_missing, not_found, bad_revision = _errors()
    if isinstance(e, gated):
        return TernaryError(
            f"{repo}: the repository is gated; accept its terms on the Hub "
            "and log in with `hf auth login`"
        )
    if isinstance(e, not_found):
        return TernaryError(
            f"{repo}: no such model directory here and no such repository on the "
            "Hugging Face Hub (if private, log in with `hf auth login`)"
        )
    if isinstance(e, bad_revision):
        return TernaryError(f"{repo}: revision {revision!r} not found on the Hub")
    if _timed_out(e):  # perhaps under the cache fallback's error
        return TernaryError(
            f"{repo}: the Hugging Face Hub ({constants.ENDPOINT}) stopped answering "
            f"(no reply within {constants.HF_HUB_ETAG_TIMEOUT} s for the file list, "
            f"{constants.HF_HUB_DOWNLOAD_TIMEOUT} s for file data; HF_HUB_ETAG_TIMEOUT and "
            "HF_HUB_DOWNLOAD_TIMEOUT set them); check the network, or pass a local copy"
        )
    if isinstance(e, (local_missing, OSError)) or _from_http(e):
        return TernaryError(
            f"{repo}: not a local directory, and downloading it from the Hugging "
            f"Face Hub ({constants.ENDPOINT}) failed ({type(e).__name__}); check the "
            "path, or the network, or pass a local copy"
        )
    raise e


def snapshot_folder(repo: str, commit: str) -> Path:
    """Where huggingface_hub's cache keeps a repo's files at a commit."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    name = repo_folder_name(repo_id=repo, repo_type="model")
    return Path(constants.HF_HUB_CACHE) / name / "snapshots" / commit


def _git_blob_sha1(path: Path) -> str:
    h = hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_hash(repo: str, sibling, path: Path) -> None:
    """The downloaded file against the Hub's record; a mismatch is removed and refused."""
    lfs = getattr(sibling, "lfs", None)
    if lfs is not None:
        want, got, kind = lfs.sha256, _sha256(path), "sha256"
    elif getattr(sibling, "blob_id", None):
        want, got, kind = sibling.blob_id, _git_blob_sha1(path), "git blob id"
    else:
        return
    if want == got:
        return
    blob = path.resolve()
    for p in (path, blob):
        p.unlink(missing_ok=True)
    raise TernaryError(
        f"{repo}: {sibling.rfilename}: the downloaded file's {kind} {got[:16]}… differs "
        f"from the Hub's {want[:16]}…; it was removed. Run the command again (a damaged "
        "transfer); if it fails again, the repository's file is damaged"
    )


def _pick_gguf(repo: str, names: List[str], quant: Optional[str], gguf_file: Optional[str]):
    """The one GGUF file that `:quant` or gguf_file names in a repo's file list."""
    ggufs = sorted(n for n in names if n.endswith(".gguf"))
    if gguf_file is not None:
        if gguf_file in ggufs:
            return gguf_file
        raise TernaryError(
            f"{repo}: no file {gguf_file!r}; its GGUF files: {', '.join(ggufs) or 'none'}"
        )
    if quant is None:
        if len(ggufs) == 1:
            return ggufs[0]
        raise TernaryError(
            f"{repo}: a GGUF repository with {len(ggufs)} files; pick one as "
            f"{repo}:QUANT or with --gguf-file NAME: {', '.join(ggufs)}"
        )
    tag = re.compile(rf"(^|[-_.]){re.escape(quant)}([-_.]|$)", re.IGNORECASE)
    found = [n for n in ggufs if tag.search(Path(n).stem)]
    single = [n for n in found if not GGUF_SHARD.search(n)]
    if len(single) == 1:
        return single[0]
    if found and not single:
        raise TernaryError(
            f"{repo}: the {quant} GGUF is split into {len(found)} files; mlx-ternary reads "
            "one-file GGUFs (merge them with llama.cpp's llama-gguf-split --merge)"
        )
    raise TernaryError(
        f"{repo}: {'no' if not single else len(single)} GGUF files match {quant!r}; "
        f"pick one with --gguf-file NAME: {', '.join(ggufs) or 'none'}"
    )


def _wanted(repo: str, names: List[str], quant, gguf_file) -> List[str]:
    """The files to fetch: one GGUF when asked for (or when the repo holds only GGUF
    files), else what a model directory needs."""
    has_weights = any(n.endswith(".safetensors") for n in names)
    if (
        quant is not None
        or gguf_file is not None
        or (not has_weights and any(n.endswith(".gguf") for n in names))
    ):
        return [_pick_gguf(repo, names, quant, gguf_file)]
    return [n for n in names if any(fnmatch.fnmatch(n, p) for p in HUB_PATTERNS)]


def _cached(repo: str, revision: Optional[str], quant, gguf_file) -> Path:
    """What the cache holds for the request, without the network (HF_HUB_OFFLINE, or
    after the Hub failed to answer)."""
    from huggingface_hub import snapshot_download

    folder = Path(snapshot_download(repo, revision=revision, local_files_only=True))
    names = [p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()]
    files = _wanted(repo, names, quant, gguf_file)
    if quant is None and gguf_file is None and not files[0].endswith(".gguf"):
        return folder
    return folder / files[0]


def download(
    spec: str,
    revision: Optional[str] = None,
    *,
    gguf_file: Optional[str] = None,
    progress: Optional[Progress] = None,
    notify: Optional[Notify] = None,
) -> Path:
    """Download a repo (`owner/repo`) or one GGUF file of it (`owner/repo:Q`, gguf_file)
    into huggingface_hub's cache.

    Returns:
        The snapshot directory, or the path of the GGUF file picked.

    Raises:
        TernaryError: an unknown, gated or unreachable repository, a revision not found,
            no (or several) GGUF files matching, a file whose hash differs from the Hub's.
    """
    with _stall_limit():  # errors name the limit that applied
        return _fetch(spec, revision, gguf_file, progress, notify)


def _fetch(spec, revision, gguf_file, progress, notify) -> Path:
    from huggingface_hub import HfApi, constants, hf_hub_download, try_to_load_from_cache

    repo, quant = split_spec(spec)
    if constants.HF_HUB_OFFLINE:
        try:
            return _cached(repo, revision, quant, gguf_file)
        except _errors()[1] as e:
            raise _hub_error(repo, revision, e) from None
    try:
        info = HfApi().model_info(
            repo, revision=revision, files_metadata=True, timeout=constants.HF_HUB_ETAG_TIMEOUT
        )
    except Exception as e:
        if not (_from_http(e) and _unanswered(e)) or isinstance(e, _errors()):
            raise _hub_error(repo, revision, e) from None
        try:  # no answer: what the cache holds
            return _cached(repo, revision, quant, gguf_file)
        except Exception:
            raise _hub_error(repo, revision, e) from None
    siblings = {s.rfilename: s for s in info.siblings or []}
    files = _wanted(repo, list(siblings), quant, gguf_file)
    missing = [
        f for f in files if not isinstance(try_to_load_from_cache(repo, f, revision=info.sha), str)
    ]
    folder = snapshot_folder(repo, info.sha)
    if missing and notify:
        size = sum(siblings[f].size or 0 for f in missing)
        notify(f"{spec}: downloading {len(missing)} file(s), {fmt_size(size)}, into {folder}")
    for f in files:
        try:
            path = Path(
                hf_hub_download(
                    repo,
                    f,
                    revision=revision,  # a branch name: its ref is kept, for offline use
                    tqdm_class=_callback_bar(f, progress),
                    etag_timeout=constants.HF_HUB_ETAG_TIMEOUT,
                )
            )
        except Exception as e:
            raise _hub_error(repo, revision, e) from None
        if f in missing:
            _check_hash(repo, siblings[f], path)
    if len(files) == 1 and files[0].endswith(".gguf"):
        return folder / files[0]
    return folder


def model_dir(
    path_or_hf_repo: str,
    revision: Optional[str] = None,
    *,
    gguf_file: Optional[str] = None,
    progress: Optional[Progress] = None,
    notify: Optional[Notify] = None,
) -> Path:
    """A local model directory, or a hub repo id downloaded when it is not a local path
    (a GGUF file's path for `owner/repo:Q` or gguf_file; see `download`)."""
    p = Path(path_or_hf_repo).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        raise TernaryError(
            f"{p}: is a file, not a model directory (or a .gguf file); other "
            "single files are not models mlx-ternary reads"
        )
    if not is_repo_id(str(path_or_hf_repo)):
        raise TernaryError(
            f"{path_or_hf_repo}: no such model directory (and not a Hugging Face "
            "repo id of the form owner/name)"
        )
    return download(
        str(path_or_hf_repo), revision, gguf_file=gguf_file, progress=progress, notify=notify
    )
