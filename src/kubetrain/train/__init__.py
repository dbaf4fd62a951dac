"""Training: the loop, optimizer and schedule, evaluation, checkpoints, graceful stop, phases."""
