"""What every training script in scripts/ would otherwise repeat, one job per module; each script
keeps its own model, flags, Accelerator and training loop, so it reads as one straight story."""
