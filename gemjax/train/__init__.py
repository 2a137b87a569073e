"""Training: optimizer, jitted step, checkpoints, the loop and its CLI."""
