"""Check the native kernel's sources (mlx_ternary/runtime/cpu/csrc) keep their shape:

- every header compiles alone (`-fsyntax-only`): kernels/, arch/ and selfcheck.h with no include
  path at all, ops/ with MLX's and nanobind's (build.py's flags); arch/neon.h with
  aarch64-linux-gnu-g++ when it is installed;
- no `#include` sits inside a namespace, and no header reaches another through a circle;
- kernels/ and arch/ include nothing of MLX, nanobind or ops/.

    python scripts/check_csrc_headers.py [--jobs 2]

Exit status 0 when all hold; each failure is printed with the file it concerns.
"""

import argparse
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "mlx_ternary" / "runtime" / "cpu" / "csrc"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')
ANY_INCLUDE = re.compile(r"^\s*#\s*include\s+[<\"]([^>\"]+)[>\"]")
OPEN_NS = re.compile(r"^\s*namespace\s+[\w:]*\s*\{")
CLOSE_NS = re.compile(r"^\s*\}\s*//\s*namespace")
PORTABLE = ("kernels", "arch")  # MLX-free rooms


def sources() -> list:
    return sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp"))


def local_includes(path: Path) -> list:
    """The csrc files `path` includes (resolved next to it), in order."""
    out = []
    for line in path.read_text().splitlines():
        m = INCLUDE.match(line)
        if m:
            target = (path.parent / m.group(1)).resolve()
            if target.is_relative_to(CSRC) and target.exists():
                out.append(target)
    return out


def include_problems(path: Path) -> list:
    """Includes inside a namespace, and MLX / nanobind / ops includes in the portable rooms."""
    problems, depth = [], 0
    rel = path.relative_to(CSRC)
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if OPEN_NS.match(line):
            depth += 1
        elif CLOSE_NS.match(line):
            depth -= 1
        m = ANY_INCLUDE.match(line)
        if not m:
            continue
        if depth > 0:
            problems.append(f"{rel}:{n}: #include {m.group(1)} inside a namespace")
        if rel.parts[0] in PORTABLE:
            name = m.group(1)
            if name.startswith(("mlx/", "nanobind/")) or "ops/" in name:
                problems.append(f"{rel}:{n}: {rel.parts[0]}/ must not include {name}")
    return problems


def cycles(files: list) -> list:
    graph = {f: local_includes(f) for f in files}
    state, problems = {}, []

    def visit(f, stack):
        state[f] = "open"
        for g in graph.get(f, []):
            if state.get(g) == "open":
                loop = stack[stack.index(g) :] + [g]
                problems.append(
                    "include circle: " + " -> ".join(str(p.relative_to(CSRC)) for p in loop)
                )
            elif g not in state:
                visit(g, stack + [g])
        state[f] = "done"

    for f in files:
        if f not in state:
            visit(f, [f])
    return problems


def ops_flags() -> list:
    sys.path.insert(0, str(CSRC.parents[3]))
    from mlx_ternary.runtime.cpu import build

    return build.ext_flags(build.mlx_build(), build.nanobind())


def compile_alone(path: Path, cxx: str, flags: list) -> str:
    """'' when `path` compiles as the only include of an empty file, else the first errors."""
    cmd = [cxx, *flags, "-fsyntax-only", "-x", "c++", "-"]
    src = f'#include "{path}"\n'
    r = subprocess.run(cmd, input=src, capture_output=True, text=True)
    if r.returncode == 0:
        return ""
    errors = [l for l in r.stderr.splitlines() if "error" in l] or r.stderr.splitlines()
    return f"{path.relative_to(CSRC)} does not compile alone: " + " | ".join(errors[:4])


def compile_jobs(files: list, cxx: str) -> tuple:
    """(jobs, notes): a (path, compiler, flags) per header that can be compiled here."""
    portable = ["-std=c++20", "-march=native"]
    arm = shutil.which("aarch64-linux-gnu-g++")
    jobs, notes, mlx = [], [], None
    for f in files:
        if f.suffix != ".h":
            continue
        rel = f.relative_to(CSRC)
        if rel.name == "neon.h":
            if arm:
                jobs.append((f, arm, ["-std=c++20", "-march=armv8.2-a+dotprod"]))
            else:
                notes.append(f"{rel}: not compiled (no aarch64-linux-gnu-g++)")
        elif rel.parts[0] == "ops":
            mlx = mlx if mlx is not None else [x for x in ops_flags() if not x.startswith("-O")]
            jobs.append((f, cxx, mlx))
        else:
            jobs.append((f, cxx, portable))
    return jobs, notes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cxx", default="g++")
    a = ap.parse_args()
    files = sources()
    problems = [p for f in files for p in include_problems(f)] + cycles(files)
    jobs, notes = compile_jobs(files, a.cxx)
    with ThreadPoolExecutor(a.jobs) as pool:
        problems += [e for e in pool.map(lambda j: compile_alone(*j), jobs) if e]
    for n in notes:
        print(n)
    for p in problems:
        print(p)
    print(f"{len(files)} files, {len(jobs)} headers compiled alone: {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
