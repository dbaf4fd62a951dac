"""Kubernetes: render objects from a config, talk to the API server, the pod entrypoint, local pod simulation.

Import the submodules; this package itself stays empty so that the liveness probe starts fast.
"""
