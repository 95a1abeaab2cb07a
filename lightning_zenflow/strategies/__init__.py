"""The Lightning Trainer strategies: one device (``single.py``), data parallel (``ddp.py``), FSDP2 (``fsdp.py``), what
they share (``base.py``), the precision plugin that owns the optimizer step and the logging callback. Their checkpoint
hooks are a room of their own beside them: ``lightning_zenflow/checkpoints/``."""
