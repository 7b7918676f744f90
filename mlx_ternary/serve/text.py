"""The text of generated tokens, exactly: `tokenizer.decode`, streamed a piece at a time.

mlx-lm's streaming detokenizers decode token by token and drop the first token's leading
space (its BPE one trims it; SentencePiece decoders strip it), which glues a completion
to its prompt. `TextStream` decodes the generated tokens behind a few prompt tokens of
context and emits what the decoded text grew by, so a completion of "My lord," reads
" I am" as `tokenizer.decode(prompt + answer)` does. A multi-byte character split across
tokens is held back until it is whole (the decoded text ends in U+FFFD until then), so no
chunk carries half a character; the window is re-anchored as the text grows, keeping
each step's decode a few tokens long.
"""

from typing import List

CONTEXT = 4  # prompt tokens decoded before the answer, for the answer's first space
WINDOW = 64  # tokens decoded per step at most, before the window moves on
REPLACEMENT = "\ufffd"  # what a decoder writes for the bytes of an unfinished character


class TextStream:
    """Feed generated token ids one by one; get the text each adds (may be "")."""

    def __init__(self, tokenizer, prompt: List[int]):
        self.decode = tokenizer.decode
        self._anchor(list(prompt[-CONTEXT:]))

    def _anchor(self, ids: List[int], keep_empty: bool = True):
        """Start the window at `ids` (already sent), trimmed until it decodes cleanly; an
        empty window is taken only at the start (a SentencePiece decoder would strip the
        space of the token after it)."""
        while ids and REPLACEMENT in self.decode(ids[:1]) + self.decode(ids)[-1:]:
            ids = ids[1:]  # a cut character at either end would not stay a prefix
        if ids or keep_empty:
            self.ids, self.base, self.sent = ids, self.decode(ids), 0

    def add(self, token: int) -> str:
        """The new text once `token` is appended; "" while a character is unfinished."""
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith(REPLACEMENT):
            return ""
        return self._take(text)

    def flush(self) -> str:
        """What is left at the end (an unfinished character as U+FFFD)."""
        return self._take(self.decode(self.ids)) if self.ids else ""

    def _take(self, text: str) -> str:
        start = len(self.base) + self.sent
        if not text.startswith(self.base):  # a decoder rewrote the context: keep length
            start = min(start, len(text))
        out = text[start:]
        self.sent += len(out)
        if len(self.ids) > WINDOW:
            self._anchor(self.ids[-CONTEXT:], keep_empty=False)
        return out
