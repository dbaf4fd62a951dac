"""The NetworkPolicy: ingress from the job's own pods (+ metrics); with egress on, only the job's pods,
cluster DNS and the endpoints the config names, validated strictly like every other object."""

from __future__ import annotations

from typing import Any

import pytest

from kubetrain.config import load_config
from kubetrain.errors import UserInputError
from kubetrain.k8s.render import validate
from kubetrain.k8s.render.manifest import render

OWN = {"podSelector": {"matchLabels": {"kubetrain.dev/job": "tiny"}}}


def policy(*overrides: str) -> dict[str, Any]:
    objects = render(load_config(None, "tiny", list(overrides)))
    obj = next(o for o in objects if o["kind"] == "NetworkPolicy")
    assert validate.problems([obj]) == []  # strict, like every rendered object
    return dict(obj["spec"])


def test_network_policy_admits_own_pods_and_metrics_namespace() -> None:
    spec = policy("k8s.metrics.scrape_namespace=prom")
    assert spec["podSelector"]["matchLabels"] == {"kubetrain.dev/job": "tiny"}
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec  # egress is opt-in
    own, metrics = spec["ingress"]
    assert own == {"from": [{"podSelector": {"matchLabels": {"kubetrain.dev/job": "tiny"}}}]}
    assert metrics["from"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "prom"}
    assert metrics["ports"] == [{"port": "metrics", "protocol": "TCP"}, {"port": "launcher", "protocol": "TCP"}]
    assert "NetworkPolicy" not in [o["kind"] for o in render(load_config(None, "tiny", ["k8s.network_policy=false"]))]


def test_egress_reaches_own_pods_dns_and_the_named_endpoints() -> None:
    spec = policy("k8s.network_policy.egress=true", "track.mlflow.enabled=true",
                  "track.mlflow.tracking_uri=http://mlflow.mlops.svc.cluster.local:5000",
                  'k8s.network_policy.egress_cidrs=["10.20.0.0/16"]')
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    own, dns, mlflow, cidrs = spec["egress"]
    assert own == {"to": [OWN]}
    assert dns["to"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                          "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}}}]
    assert dns["ports"] == [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]
    assert mlflow == {"to": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "mlops"}}}],
                      "ports": [{"port": 5000, "protocol": "TCP"}]}
    assert cidrs == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}]}
    by_address = policy("k8s.network_policy.egress=true", "track.mlflow.enabled=true",
                        "track.mlflow.tracking_uri=postgresql://kt@10.0.5.7/runs")
    assert by_address["egress"][2] == {"to": [{"ipBlock": {"cidr": "10.0.5.7/32"}}],
                                       "ports": [{"port": 5432, "protocol": "TCP"}]}


def test_a_host_outside_the_cluster_needs_its_addresses() -> None:
    sets = ["k8s.network_policy.egress=true", "track.mlflow.enabled=true",
            "track.mlflow.tracking_uri=https://mlflow.example.com"]
    with pytest.raises(UserInputError, match=r"names host 'mlflow\.example\.com'.*egress_cidrs"):
        render(load_config(None, "tiny", sets))
    assert len(policy(*sets, 'k8s.network_policy.egress_cidrs=["203.0.113.0/24"]')["egress"]) == 3
    with pytest.raises(UserInputError, match="not a CIDR"):
        load_config(None, "tiny", ['k8s.network_policy.egress_cidrs=["mlflow.example.com"]'])


STORE = ["k8s.network_policy.egress=true", "checkpoint.uri=s3://ckpts/team"]


def test_egress_reaches_the_object_store() -> None:
    by_address = policy(*STORE, "checkpoint.endpoint_url=http://10.0.9.4:9000")
    assert by_address["egress"][2] == {"to": [{"ipBlock": {"cidr": "10.0.9.4/32"}}],
                                       "ports": [{"port": 9000, "protocol": "TCP"}]}
    in_cluster = policy(*STORE, "checkpoint.endpoint_url=http://minio.storage.svc.cluster.local:9000")
    assert in_cluster["egress"][2]["to"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "storage"}}}]
    assert len(policy("k8s.network_policy.egress=true", "checkpoint.uri=/mnt/nas/ckpts")["egress"]) == 2  # a path


def test_an_object_store_outside_the_cluster_needs_its_addresses() -> None:
    with pytest.raises(UserInputError, match=r"^k8s\.network_policy\.egress: checkpoint\.endpoint_url names host "
                       r"'minio\.example\.com'.*egress_cidrs$"):
        render(load_config(None, "tiny", [*STORE, "checkpoint.endpoint_url=https://minio.example.com"]))
    with pytest.raises(UserInputError, match=r"checkpoint\.uri s3://ckpts/team goes to AWS S3.*egress_cidrs"):
        render(load_config(None, "tiny", STORE))
    with pytest.raises(UserInputError, match="a cloud object store"):
        render(load_config(None, "tiny", ["k8s.network_policy.egress=true", "checkpoint.uri=gs://ckpts/team"]))
    listed = policy(*STORE, 'k8s.network_policy.egress_cidrs=["52.216.0.0/15"]')
    assert listed["egress"][-1] == {"to": [{"ipBlock": {"cidr": "52.216.0.0/15"}}]}
    assert len(policy("checkpoint.uri=s3://ckpts/team")) == 3 and "egress" not in policy("checkpoint.uri=s3://a/b")


def test_a_trainjob_with_egress_reaches_the_trainer_controllers_status_server() -> None:
    def egress(*overrides: str) -> list[dict[str, Any]]:
        objects = render(load_config(None, "tiny", ["k8s.network_policy.egress=true", *overrides]),
                         workload="trainjob")
        obj = next(o for o in objects if o["kind"] == "NetworkPolicy")
        assert validate.problems([obj]) == []
        return list(obj["spec"]["egress"])

    _own, _dns, controller = egress()
    trainer_namespace = {"kubernetes.io/metadata.name": "kubeflow-system"}  # where Trainer v2 installs
    assert controller == {"to": [{"namespaceSelector": {"matchLabels": trainer_namespace}}],
                          "ports": [{"port": 10443, "protocol": "TCP"}]}
    moved = egress("track.kubeflow_trainer.controller_namespace=kubeflow",
                   "track.kubeflow_trainer.controller_port=9444")
    assert moved[2]["to"][0]["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "kubeflow"}
    assert moved[2]["ports"] == [{"port": 9444, "protocol": "TCP"}]
    assert len(egress("track.kubeflow_trainer.enabled=false")) == 2
    assert len(policy("k8s.network_policy.egress=true")["egress"]) == 2  # an Indexed Job has no such controller
