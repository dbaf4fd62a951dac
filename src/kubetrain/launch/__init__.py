"""Launch: run a config here, as one process or as N processes under PyTorch's elastic agent."""
