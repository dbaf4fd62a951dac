"""Checkpoints: the on-disk format, verification, and copies in object storage (`remote`)."""
