"""Glue for training loops outside Lightning's Trainer (each module imports its own framework)."""
