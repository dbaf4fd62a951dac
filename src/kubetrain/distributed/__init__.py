"""Distributed: read rank/world from the environment, init and tear down the process group, wrap DDP/FSDP."""
