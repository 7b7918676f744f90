"""The runtime: TernaryLinear, the backends it dispatches to, and what rides on it.

layers.py (TernaryLinear) -> dispatch.py (backend choice, per-layer launch plans) ->
metal/ (Metal launchers) | cpu/ (the native C++ CPU backend) | reference.py (pure-MLX twins);
probe.py (safe first use), tune.py (self-tuning), lora.py, adapters.py, shard.py (sharded layers),
shard_head.py (the output layer by vocabulary), samehost.py (ranks sharing a machine) and
shard_plans.py (model.shard) on top, and
patches.py, the one module that reaches into mlx-lm.
"""
