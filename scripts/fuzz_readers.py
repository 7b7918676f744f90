"""The long reader fuzzing run: hypothesis mutations of every format's valid seed.

Each input must end in a successful read or one FormatError naming the file, within
5 s of CPU time. Failures are kept under tests/fixtures/fuzz/ (test_fuzz_readers.py replays them)
and counted by kind. Run it niced in the background:

    nice -n 19 python scripts/fuzz_readers.py --inputs 100000 [--format gguf ...]
"""

import argparse
import signal
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fuzz_harness as fh  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402

TIME_LIMIT_S = 5


def _alarm(signum, frame):
    raise TimeoutError(f"an input ran past {TIME_LIMIT_S} s of CPU time")


def _limit(seconds: float) -> None:
    """Arm (or with 0, disarm) the per-input limit, counted in this process's CPU time.

    CPU time, not wall time: on a loaded machine a niced run is descheduled for seconds at a
    time, and a wall-clock limit would report that as a hang. A parser that loops spends CPU.
    """
    signal.setitimer(signal.ITIMER_PROF, seconds)


def fuzz(target: fh.Target, inputs: int, scratch: Path) -> dict:
    """{inputs, loaded, refused, failures: {kind: count}} of one format's run."""
    seed = (target.seed_dir / target.file).read_bytes()
    counts, failures = Counter(), Counter()

    @settings(
        max_examples=inputs, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    @given(fh.mutations(target, seed))
    def run(data):
        counts["inputs"] += 1
        if counts["inputs"] % 5000 == 0:
            print(f"{target.name}: {dict(counts)} failures {sum(failures.values())}", flush=True)
        _limit(TIME_LIMIT_S)
        try:
            counts[fh.check(target, data, scratch)] += 1
        except Exception as e:  # a FormatError without the file's name is an AssertionError
            frames = traceback.extract_tb(e.__traceback__)
            frame = frames[-2 if isinstance(e, TimeoutError) and len(frames) > 1 else -1]
            kind = f"{type(e).__name__} at {Path(frame.filename).name}:{frame.lineno}"
            if not failures[kind]:
                fh.save_failure(target, seed, data, f"{kind}: {e}")
                print(f"{target.name}: new failure {kind}: {str(e)[:160]}", flush=True)
            failures[kind] += 1
        finally:
            _limit(0)

    run()
    return {**counts, "failures": dict(failures)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=100_000, help="inputs per format")
    ap.add_argument("--format", action="append", help="formats to run (default: all)")
    args = ap.parse_args()
    signal.signal(signal.SIGPROF, _alarm)
    targets = fh.build_seeds(fh.scratch_dir())
    scratch = fh.scratch_dir()
    for name in args.format or list(targets):
        start = time.time()
        result = fuzz(targets[name], args.inputs, scratch)
        print(f"{name}: {result} in {time.time() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
