"""`python -m mlx_ternary.cli`: the same as `mlx-ternary`."""

from . import main

main()
