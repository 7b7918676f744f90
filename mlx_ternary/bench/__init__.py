"""`mlx-ternary bench`: formats.py (one model in several representations), kernels.py
(kernels against stock MLX), overhead.py (graph-building time), ceiling.py (bandwidth ceilings),
llamacpp.py (llama.cpp on the same GGUF)."""
