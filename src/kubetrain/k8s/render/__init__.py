"""Rendering: a config becomes Kubernetes objects (one renderer per workload, one shared pod template), and
those objects are validated strictly, offline."""
