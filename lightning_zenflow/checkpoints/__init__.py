"""Checkpoints of the Lightning strategies, beside them: the hooks that save and load a full ``.ckpt`` file or a
sharded directory and check it first (``hooks.py``; FSDP2's row shards: ``fsdp.py`` and ``fsdp_state.py``), and the
sharded directory's format (``sharded.py``). The engine's own state and its checks are ``engine/state.py`` and
``engine/state_checks.py``; ``lightning_zenflow.CheckpointError`` is the error a checkpoint that cannot be resumed
raises."""
