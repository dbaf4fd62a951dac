"""kubetrain: train and fine-tune decoder-only language models from one YAML config."""

__version__ = "0.1.0"
