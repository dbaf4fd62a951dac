"""Data: tokenizers, sources, `prepare` into token shards, and the resumable loader."""
