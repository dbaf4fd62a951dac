"""The `track:` section: which metric sinks are on."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrackConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    console: bool = Field(True, description="Progress on stdout (rich on a terminal, plain lines otherwise).")
