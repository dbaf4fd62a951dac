"""The `train.profile:` section: a trace of a few steps, written into the run folder."""

from __future__ import annotations

from pydantic import Field, field_validator

from kubetrain.config.section import Section


class ProfileConfig(Section):
    """`train.profile`: which steps of which ranks torch's profiler traces (train/profile.py)."""

    start: int = Field(
        5, ge=1, description="The first traced step, counted from where this process started (1: its first step; "
        "a resumed run is traced too). The step before it warms the profiler up; the first steps compile and warm "
        "the allocator."
    )
    steps: int = Field(3, ge=1, description="How many steps are traced.")
    ranks: list[int] = Field(
        [0], description="The ranks that trace; each writes its own files (trace-rank<N>-..., ops-rank<N>-...)."
    )

    @field_validator("ranks")
    @classmethod
    def _no_negative_rank(cls, value: list[int]) -> list[int]:
        if any(r < 0 for r in value):
            raise ValueError("ranks are 0 or more")
        return value
