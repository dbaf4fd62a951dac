"""Launcher tests start processes the same way as the training tests, with the same cleanup."""

from tests.train.conftest import _no_leftover_processes as _no_leftover_processes
