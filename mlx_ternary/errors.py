"""User-facing errors: each names the file, tensor or field at fault and says what to do."""


class TernaryError(ValueError):
    """A problem with the user's input (model, checkpoint, flag) rather than a bug.

    The CLI prints these as one line without a traceback.
    """


class FormatError(TernaryError):
    """A checkpoint that does not match what its config or the format promises."""
