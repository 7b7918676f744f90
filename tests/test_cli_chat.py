"""`mlx-ternary chat` through a pseudo-terminal, as a person types it, on the embedded model:
each answer is what mlx-lm generates from the whole conversation recomputed from scratch."""

import pytest
from click.testing import CliRunner
from mlx_lm import generate as mlx_lm_generate
from pty_session import PtySession

import mlx_ternary
from mlx_ternary.cli import main
from mlx_ternary.generate import EMBEDDED_MODEL, Chat, ContextFull

PROMPT = ">>> "
MAX_TOKENS = 8
TTY = {"TERM": "dumb"}  # no escape sequences from line editing


@pytest.fixture(scope="module")
def embedded():
    return mlx_ternary.load(str(EMBEDDED_MODEL))


def reference(model, tokenizer, messages):
    """mlx-lm's greedy answer to `messages`, templated and prefilled from nothing."""
    tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return mlx_lm_generate(model, tokenizer, tokens, max_tokens=MAX_TOKENS)


def answer_of(output: str, typed: str) -> str:
    """The answer in the terminal's output after the echoed input line, before the prompt."""
    echoed, _, rest = output.partition("\n")
    assert echoed == typed, output
    assert rest.endswith("\n" + PROMPT), output
    return rest[: -len("\n" + PROMPT)]


def test_chat_keeps_the_conversation_resets_and_exits(embedded):
    model, tokenizer = embedded
    s = PtySession("chat", "-m", str(MAX_TOKENS), env=TTY)
    s.read_until(PROMPT)
    history = []
    for text in ("ROMEO:", "JULIET:"):
        s.send(text + "\n")
        got = answer_of(s.read_until(PROMPT), text)
        history.append({"role": "user", "content": text})
        want = reference(model, tokenizer, history)
        assert got == want
        history.append({"role": "assistant", "content": got})
    # Negative control: turn 2 differs from JULIET: asked alone, so the history mattered.
    alone = reference(model, tokenizer, [{"role": "user", "content": "JULIET:"}])
    assert history[-1]["content"] != alone
    s.send("/reset\n")
    s.read_until(PROMPT)
    s.send("JULIET:\n")
    assert answer_of(s.read_until(PROMPT), "JULIET:") == alone
    s.send("/nonsense\n")
    s.read_until(PROMPT)
    s.send("/exit\n")
    assert s.wait() == 0
    err = s.stderr()
    assert "(conversation forgotten)" in err and "unknown command /nonsense" in err
    assert "Traceback" not in err


def test_chat_ends_at_end_of_input_and_says_where_it_is():
    s = PtySession("chat", "--system-prompt", "Speak in verse.", "--max-context", "200", env=TTY)
    s.read_until(PROMPT)
    s.send("\x04")  # Ctrl-D at an empty prompt
    assert s.wait() == 0
    err = s.stderr()
    assert "context 200 tokens" in err and "/exit or Ctrl-D" in err and "Traceback" not in err


def test_chat_reuses_the_cache_and_refuses_past_the_context(embedded):
    model, tokenizer = embedded
    chat = Chat(model, tokenizer, max_context=40)
    first = "".join(r.text for r in chat.reply("ROMEO:", max_tokens=MAX_TOKENS))
    held = chat.context_used()
    assert held > len(chat.tokens(chat.messages[:1]))  # the prompt and the answer stayed
    second = list(chat.reply("JULIET:", max_tokens=MAX_TOKENS))
    # Only what the cache did not hold was prefilled for turn 2.
    assert second[0].prompt_tokens < len(chat.tokens(chat.messages[:3]))
    assert first == reference(model, tokenizer, [{"role": "user", "content": "ROMEO:"}])
    with pytest.raises(ContextFull, match="context limit of 40; /reset"):
        list(chat.reply("O Romeo, Romeo, wherefore art thou Romeo? " * 4))
    assert len(chat.messages) == 4  # the refused turn left the conversation as it was
    chat.reset()
    assert chat.messages == [] and chat.context_used() == 0


def test_an_answer_cut_short_is_kept_and_the_next_turn_still_matches(embedded):
    model, tokenizer = embedded
    chat = Chat(model, tokenizer)
    answer = chat.reply("ROMEO:", max_tokens=MAX_TOKENS)
    partial = next(answer).text
    answer.close()  # what Ctrl-C does in the terminal
    assert chat.messages[-1] == {"role": "assistant", "content": partial}
    got = "".join(r.text for r in chat.reply("JULIET:", max_tokens=MAX_TOKENS))
    assert got == reference(model, tokenizer, chat.messages[:-1])


@pytest.mark.parametrize(
    "args, expect",
    [
        (["--max-context", "1"], "1 is not in the range x>=2"),
        (["--temp", "-1"], "-1.0 is not in the range x>=0"),
        (["--threads", "0"], "0 is not in the range x>=1"),
        (["-m", "0"], "0 is not in the range x>=1"),
        (["--top-p", "2"], "2.0 is not in the range 0<=x<=1"),
    ],
)
def test_chat_refuses_bad_options_in_one_line(args, expect):
    r = CliRunner().invoke(main, ["chat", *args])
    assert r.exit_code == 2 and expect in r.output and "Traceback" not in r.output


def test_chat_refuses_a_context_that_does_not_fit():
    r = CliRunner().invoke(main, ["chat", "--max-context", "100000000", "--kv-bits", "8"])
    assert r.exit_code == 1 and "does not fit" in r.output and "--max-context" in r.output
    assert "max_position_embeddings (256)" in r.output  # and it was warned about first
