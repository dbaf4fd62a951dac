"""Talking to the API server: connect, apply, delete, list, stream logs; the commands launch, stop, status,
list, logs and doctor built on that."""
