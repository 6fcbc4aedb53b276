"""Helpers that every training script in scripts/ would otherwise repeat.

Only plumbing lives here (flags, data files, metrics, checkpoints); each script keeps
its own model, Accelerator and training loop so it reads as one straight story.
"""
