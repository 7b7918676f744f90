"""The text `serve` sends is `tokenizer.decode` of exactly the tokens it generated.

Two tokenizers: the embedded model's byte-level BPE, and a SentencePiece-style one (a
Metaspace BPE with byte fallback, built here with `tokenizers`). Clients: the `openai` and
`anthropic` SDKs over loopback. Negative control: mlx-lm's streaming detokenizer, which
the server used before, drops the first token's leading space.
"""

import json
import threading
from contextlib import contextmanager

import anthropic
import openai
import pytest
from tiny import ternary_checkpoint

import mlx_ternary
from mlx_ternary.generate import EMBEDDED_MODEL
from mlx_ternary.serve.http import ServeConfig, Server
from mlx_ternary.serve.openai import render_chat
from mlx_ternary.serve.text import REPLACEMENT, TextStream

LEAD = "First Lord:\nMy lord,"  # the embedded model answers " I am sure, ..."
MULTI = "héllo wörld ✓ 日本語 €uro "


def generated(model, tokenizer, prompt, n):
    """Greedy token ids from mlx-lm's own generator (end-of-sequence excluded)."""
    from mlx_lm import stream_generate

    ids, last = [], None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=n):
        ids.append(last.token)
    if last.finish_reason == "stop":
        ids.pop()
    return ids


def in_context(tokenizer, prompt, ids):
    """The answer's text as `decode(prompt + answer)` reads it after `decode(prompt)`."""
    whole, head = tokenizer.decode(prompt + ids), tokenizer.decode(prompt)
    assert whole.startswith(head)
    return whole[len(head) :]


def streamed(tokenizer, prompt, ids):
    s = TextStream(tokenizer, prompt)
    return [s.add(t) for t in ids] + [s.flush()]


@contextmanager
def serving(model, tokenizer, **cfg):
    server = Server(model, tokenizer, ServeConfig(model_name="m", **cfg), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield (
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=120),
        )
    finally:
        server.shutdown()
        server.server_close()


def sp_tokenizer(out, byte_fallback=True):
    """A SentencePiece-style tokenizer (Metaspace, byte fallback) saved into `out`; without
    the byte pieces every token is whole characters (what a random model can generate)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256 * byte_fallback)]
    pieces += ["▁"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + list(",.:!?")
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "k"), ("i", "n"), ("▁k", "in")]
    merges += [("▁kin", "g"), ("▁", "a"), ("o", "r"), ("▁", "l"), ("▁l", "or")]
    pieces += ["".join(m) for m in merges]
    vocab = {p: i for i, p in enumerate(pieces)}
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=byte_fallback))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>"}
    config.update(eos_token="</s>", unk_token="<unk>", model_max_length=4096)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return len(vocab)


@pytest.fixture(scope="module")
def embedded():
    return mlx_ternary.load(str(EMBEDDED_MODEL))


def sp_model(tmp, byte_fallback):
    n = sp_tokenizer(tmp, byte_fallback)
    path, _ = ternary_checkpoint(tmp, "llama", vocab_size=n)
    sp_tokenizer(path, byte_fallback)  # over the byte-level one the checkpoint came with
    return mlx_ternary.load(str(path))


@pytest.fixture(scope="module")
def sp_bytes(tmp_path_factory):
    return sp_model(tmp_path_factory.mktemp("sp"), True)


@pytest.fixture(scope="module")
def sp_whole(tmp_path_factory):
    return sp_model(tmp_path_factory.mktemp("spw"), False)


def test_stream_is_decode_and_never_half_a_character(embedded, sp_bytes):
    for _, tok in (embedded, sp_bytes):
        prompt = tok.encode(LEAD)
        ids = tok.encode(MULTI * 8)
        pieces = streamed(tok, prompt, ids)
        assert "".join(pieces) == in_context(tok, prompt, ids)
        assert not any(REPLACEMENT in p for p in pieces)  # no half character, ever
        assert sum(1 for p in pieces if p) < len(ids)  # some were held for their rest
    _, tok = embedded
    ids = tok.encode(MULTI * 8)
    assert "".join(streamed(tok, [], ids)) == tok.decode(ids)  # byte-level: decode(ids)


def test_an_unfinished_character_is_flushed_at_the_end(embedded):
    _, tok = embedded
    ids = tok.encode("ab日")
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith(REPLACEMENT))
    pieces = streamed(tok, [], ids[:cut])
    assert "".join(pieces) == tok.decode(ids[:cut]) and pieces[-1].endswith(REPLACEMENT)


def test_the_old_detokenizer_drops_the_leading_space(embedded):
    model, tok = embedded
    prompt = tok.encode(LEAD)
    ids = generated(model, tok, prompt, 12)
    want = tok.decode(ids)
    assert want.startswith(" ")
    assert "".join(streamed(tok, prompt, ids)) == want
    old = tok.detokenizer  # negative control: mlx-lm's streaming detokenizer
    old.reset()
    for t in ids:
        old.add_token(t)
    old.finalize()
    assert old.text != want and old.text == want[1:]


def answers(client, claude, tok, prompt_text, max_tokens, stop=None):
    """Every text shape the server sends for one prompt: completions, chat, messages,
    streamed and whole."""
    kw = dict(model="m", max_tokens=max_tokens, temperature=0, stop=stop)
    out = {"completion": client.completions.create(prompt=prompt_text, **kw).choices[0].text}
    chunks = client.completions.create(prompt=prompt_text, stream=True, **kw)
    out["completion stream"] = "".join(c.choices[0].text for c in chunks)
    msgs = [{"role": "user", "content": prompt_text}]
    out["chat"] = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
    chunks = client.chat.completions.create(messages=msgs, stream=True, **kw)
    out["chat stream"] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    akw = dict(model="m", max_tokens=max_tokens, messages=msgs, extra_body={"temperature": 0})
    if stop:
        akw["stop_sequences"] = stop
    out["messages"] = "".join(b.text for b in claude.messages.create(**akw).content)
    with claude.messages.stream(**akw) as s:
        out["messages stream"] = "".join(s.text_stream)
    return out


def references(model, tok, prompt_text, n, stop=None):
    prompt = tok.encode(prompt_text)
    chat = render_chat(tok, [{"role": "user", "content": prompt_text}], None)  # the server's
    refs = {}
    for kind, p in (("completion", prompt), ("chat", chat)):
        text = in_context(tok, p, generated(model, tok, p, n))
        if stop and stop[0] in text:
            text = text[: text.find(stop[0])]
        refs[kind] = text
    return refs


def check(got, refs):
    for shape, text in got.items():
        want = refs["completion" if shape.startswith("completion") else "chat"]
        assert text == want, shape


def test_every_shape_is_the_decoded_tokens_byte_level(embedded):
    model, tok = embedded
    refs = references(model, tok, LEAD, 12)
    assert refs["completion"] == tok.decode(generated(model, tok, tok.encode(LEAD), 12))
    assert refs["completion"].startswith(" I")  # the case
    with serving(model, tok, max_context=256, prefill_step_size=64) as (client, claude):
        check(answers(client, claude, tok, LEAD, 12), refs)
        stop = [refs["completion"][5:8]]  # cut where it starts, inside the answer
        cut = references(model, tok, LEAD, 12, stop)
        assert cut["completion"] == refs["completion"][:5]
        check(answers(client, claude, tok, LEAD, 12, stop), cut)


def test_every_shape_is_the_decoded_tokens_sentencepiece(sp_whole):
    model, tok = sp_whole
    prompt_text = "my lord, the king is"  # answered "▁king..."
    refs = references(model, tok, prompt_text, 16)
    alone = tok.decode(generated(model, tok, tok.encode(prompt_text), 16))
    # decode(answer) alone strips the space SentencePiece puts first; in context it stays
    assert refs["completion"].startswith(" ") and refs["completion"][1:] == alone
    with serving(model, tok, max_context=512, prefill_step_size=64) as (client, claude):
        check(answers(client, claude, tok, prompt_text, 16), refs)
