"""`mlx-ternary serve`: an OpenAI- and Anthropic-compatible server over mlx-lm's batching.

http.py (the server) -> openai.py / anthropic.py (the request shapes) -> engine.py (the
generation thread) -> prompt_cache.py, kv_quant.py, constrain.py.
"""
