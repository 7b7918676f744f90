"""User-facing errors: each names the file, tensor or field at fault and says what to do."""

import json
from pathlib import Path


class TernaryError(ValueError):
    """A problem with the user's input (model, checkpoint, flag) rather than a bug.

    The CLI prints these as one line without a traceback.
    """


class FormatError(TernaryError):
    """A checkpoint that does not match what its config or the format promises."""


def read_json(path: Path):
    """The parsed JSON file at `path`, or a FormatError naming it."""
    try:
        return json.loads(Path(path).read_text())
    except ValueError as e:
        raise FormatError(f"{path}: not valid JSON ({e}); re-download or re-create it") from None
