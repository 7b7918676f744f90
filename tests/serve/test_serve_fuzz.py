"""schemathesis over /openapi.json, short run: no 5xx, errors in the API's own shape, and
the engine still answers afterwards (the long run is scripts/fuzz_server.py)."""

import json
import urllib.request

import fuzz_server as fs
import pytest
from hypothesis import HealthCheck, given, settings

from mlx_ternary.serve.http import ROUTES


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    server, url = fs.start_server(tmp_path_factory.mktemp("fuzz-serve"))
    yield url
    fs.stop_server(server)


def test_openapi_document_lists_every_route(live):
    with urllib.request.urlopen(f"{live}/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    listed = {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops}
    assert listed == set(ROUTES) and doc["openapi"].startswith("3.1")
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    assert "messages" in body["content"]["application/json"]["schema"]["required"]


def test_generated_requests_never_get_a_server_error(live):
    ops, requests = fs.requests(live)
    # every endpoint (schemathesis leaves out the document's own URL)
    assert {op.label for op in ops} == {f"{m} {p}" for m, p in ROUTES} - {"GET /openapi.json"}
    problems, statuses = [], set()

    @settings(
        max_examples=60,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def run(case):
        response = case.call(base_url=live, timeout=60)
        statuses.add(response.status_code // 100)
        problems.extend([p for p in [fs.problem(case, response)] if p])

    run()
    assert not problems, problems[:3]
    assert statuses >= {2, 4}  # both valid and refused requests were generated
    text, n = fs.still_answers(live)
    assert n >= 1 and isinstance(text, str)


def test_a_prompt_with_no_tokens_is_a_400(live):
    """The first failure schemathesis found (an empty prompt after tokenizing was a 500)."""
    req = urllib.request.Request(
        f"{live}/v1/completions",
        json.dumps({"prompt": "\x90", "max_tokens": 2}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 400 and json.loads(e.value.read())["error"]["param"] == "prompt"


def test_top_k_beyond_the_vocabulary_keeps_every_token(live):
    """Found by the long run: top_k >= the vocabulary failed mid-generation (a 500); it
    now means every token: a seeded answer matches the one without top_k."""

    def complete(**extra):
        body = {"prompt": "hello", "max_tokens": 4, "temperature": 1.0, "seed": 7, **extra}
        req = urllib.request.Request(
            f"{live}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())["choices"][0]["text"]

    assert complete(top_k=11404468) == complete()


@pytest.mark.parametrize(
    "seed,status", [(-1, 200), (2**64 - 1, 200), (2**64, 400), (-(2**63) - 1, 400)]
)
def test_seeds_of_int64_and_uint64_range(live, seed, status):
    """Found by the long run: a negative seed reached mx.random.key (a 500)."""
    body = {"prompt": "hello", "max_tokens": 2, "temperature": 1.0, "seed": seed}
    req = urllib.request.Request(
        f"{live}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            got = r.status
    except urllib.error.HTTPError as e:
        got = e.code
        assert json.loads(e.read())["error"]["param"] == "seed"
    assert got == status
