"""The `k8s:` config section: defaults, and bad values rejected with one clear line."""

from __future__ import annotations

import pytest

from kubetrain.config import load_config
from kubetrain.errors import ConfigError


def test_defaults_render_a_single_node_indexed_job() -> None:
    k = load_config(None, "tiny").k8s
    assert (k.workload, k.nnodes, k.nproc_per_node) == ("indexed-job", 1, 1)
    assert k.volumes.checkpoints.size and k.volumes.checkpoints.claim is None
    assert k.metrics.liveness and k.network_policy.enabled and not k.network_policy.egress


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("k8s.workload=deployment", "k8s.workload"),
        ("k8s.nnodes=0", "k8s.nnodes"),
        ("k8s.namespace=Not_A_Name", "k8s.namespace"),
        ('k8s.env={"MY_API_KEY": "abc"}', "looks like a secret"),
        ('k8s.env={"RANK": "3"}', "cannot be overridden"),
        ('k8s.env={"PET_NNODES": "3"}', "cannot be overridden"),
        ('k8s.env={"9BAD": "x"}', "not a valid environment variable name"),
        ('k8s.volumes.checkpoints={"claim": "a", "size": "1Gi"}', "exactly one of"),
        ('k8s.volumes.checkpoints={}', "exactly one of"),
        ('k8s.volumes.data={"claim": "a", "access_mode": "ReadWriteMany"}', "apply to a created claim"),
        ("k8s.volumes.checkpoints.size=lots", "k8s.volumes.checkpoints.size"),
        ('k8s.tolerations=[{"key": "a", "operator": "Exists", "value": "b"}]', "takes no value"),
        ('k8s.tolerations=[{"key": "a", "toleration_seconds": 5}]', "needs effect 'NoExecute'"),
        ('k8s.secrets.hf_token={"name": "hf"}', "k8s.secrets.hf_token.key"),
        ("k8s.resources.gpu_resource=gpu", "k8s.resources.gpu_resource"),
        ("k8s.reources.gpu=1", "did you mean 'resources'"),
    ],
)
def test_bad_values_are_one_line_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(None, "tiny", [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_secret_references_are_accepted() -> None:
    k = load_config(None, "tiny", [
        'k8s.secrets.hf_token={"name": "hf-token", "key": "token"}',
        'k8s.secrets.env={"MLFLOW_TRACKING_PASSWORD": {"name": "mlflow", "key": "password"}}',
    ]).k8s
    assert k.secrets.hf_token is not None and k.secrets.hf_token.name == "hf-token"
    assert k.secrets.env["MLFLOW_TRACKING_PASSWORD"].key == "password"
