"""Host time per ternary layer call and per decode token, against stock nn.QuantizedLinear.

Graph-construction time (Python and MLX op creation; nothing is evaluated in the timed
part), in one run, interleaved: TernaryLinear on the Metal path with its launches stubbed
(no Mac needed), on the reference path, and in training mode, with and without int8
activation quantization; then one decode step of a 30-layer model against stock q2/q4.
Targets (issue 12): <= 1.5x nn.QuantizedLinear without activation quantization, <= 2.5x
with it. `mlx-ternary bench --host` prints the same tables.

    python scripts/bench_host.py [--rounds 40] [--json host.json]
"""

import argparse
import json

from mlx_ternary.bench import host


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=host.ROUNDS)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    result = host.report(layers=args.layers, rounds=args.rounds)
    for line in host.lines(result):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
