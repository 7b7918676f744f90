"""Checkpoints: where a model lives, reading every ternary format, writing ours and others'.

load.py (a path, hub id or .gguf -> mlx-lm model) and verify.py sit on gguf_cache.py
(a .gguf converted once), which sits on convert.py (a reader streamed into a writer);
readers/ and writers/ never see each other; hub.py finds or downloads a model directory;
store.py lists and removes what is downloaded and converted.
"""
