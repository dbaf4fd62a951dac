"""`kubetrain k8s fetch`: a launched job's run directory, copied from its claim to a local folder."""
