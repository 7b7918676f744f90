"""The long server fuzzing run: schemathesis requests from /openapi.json against a live
tiny server. Counts answers by status class; prints every 5xx or malformed error.

    nice -n 19 python scripts/fuzz_server.py --requests 20000
"""

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzz_server as fs  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=20_000)
    args = ap.parse_args()
    server, url = fs.start_server(Path(tempfile.mkdtemp(prefix="fuzz-serve-")))
    ops, requests = fs.requests(url)
    counts, problems = Counter(), []

    @settings(
        max_examples=args.requests,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(requests)
    def run(case):
        response = case.call(base_url=url, timeout=60)
        counts[f"{response.status_code // 100}xx"] += 1
        p = fs.problem(case, response)
        if p:
            problems.append(p)
            print("problem:", p, flush=True)

    start = time.time()
    run()
    text, n = fs.still_answers(url)
    print(
        f"{sum(counts.values())} requests over {len(ops)} operations in "
        f"{time.time() - start:.0f} s: {dict(counts)}; problems {len(problems)}; "
        f"the engine answers afterwards ({n} tokens: {text!r})",
        flush=True,
    )
    fs.stop_server(server)


if __name__ == "__main__":
    main()
