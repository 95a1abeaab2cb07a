"""The Lightning Trainer strategies: one device (``single.py``), data parallel (``ddp.py``), what they share
(``base.py``), the precision plugin that owns the optimizer step, sharded checkpoints and the logging callback."""
