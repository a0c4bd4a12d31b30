"""Training: the loop, optimizers, metrics, checkpoints and the run directory."""
