"""Server fuzzing: schemathesis drives every endpoint of /openapi.json against a live tiny
server; each answer must be 2xx, or 4xx in the API's own error shape (never 5xx).

Shared by tests/serve/test_serve_fuzz.py (short run) and scripts/fuzz_server.py (long).
"""

import json
import threading
from pathlib import Path

import jsonschema
import schemathesis
from hypothesis import strategies as st
from schemathesis import GenerationMode

from mlx_ternary.serve.openapi import ANTHROPIC_ERROR, OPENAI_ERROR


def start_server(tmp: Path):
    """A Server on a free local port with a tiny random ternary llama; (server, url)."""
    from tiny import ternary_checkpoint

    import mlx_ternary
    from mlx_ternary.serve.http import ServeConfig, Server

    path, _ = ternary_checkpoint(tmp, "llama")
    model, tok = mlx_ternary.load(str(path))
    config = ServeConfig(model_name="tiny", max_context=128, prefill_step_size=32)
    server = Server(model, tok, config, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def stop_server(server) -> None:
    server.shutdown()
    server.server_close()


def requests(url: str):
    """Valid and invalid requests of every operation the document lists."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    return ops, st.one_of([op.as_strategy(generation_mode=m) for op in ops for m in modes])


def problem(case, response) -> str:
    """Why an answer breaks the rule, or "" when it keeps it."""
    status = response.status_code
    where = f"{case.method} {case.path} {json.dumps(case.body, default=str)[:300]}"
    if status >= 500:
        return f"{status} for {where}: {response.text[:300]}"
    if 400 <= status < 500:
        shape = ANTHROPIC_ERROR if case.path.endswith("/messages") else OPENAI_ERROR
        try:
            jsonschema.validate(response.json(), shape)
        except (ValueError, jsonschema.ValidationError) as e:
            return f"{status} not in the API's error shape for {where}: {str(e)[:200]}"
    return ""


def still_answers(url: str) -> str:
    """The text of a short greedy completion: the engine still generates after the run."""
    import urllib.request

    body = json.dumps({"prompt": "hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{url}/v1/completions", body, {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        answer = json.loads(r.read())
    return answer["choices"][0]["text"], answer["usage"]["completion_tokens"]
