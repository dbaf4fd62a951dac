"""The `k8s:` section: how the job is rendered for Kubernetes."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class K8sConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    namespace: str = Field("default")
    image: str = Field("ghcr.io/kubetrain/kubetrain:0.1.0")
    nnodes: int = Field(1, ge=1)
    nproc_per_node: int = Field(1, ge=1)
