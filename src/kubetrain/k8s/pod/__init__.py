"""What runs inside a training pod: the entrypoint (node rank, rendezvous wait, the elastic agent) and the
liveness probe. Kept free of heavy imports so the probe starts fast."""
