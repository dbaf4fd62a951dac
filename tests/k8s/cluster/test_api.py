"""The API layer against a real HTTP round-trip: connection, authentication and every error as one line."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from kubetrain.k8s.cluster import api_errors
from kubetrain.k8s.cluster.connect import connect

Cli = Callable[..., tuple[int, str, str]]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_unreachable_server_is_one_line_naming_what_was_tried(tmp_path: Path, cli: Cli) -> None:
    port = closed_port()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "lab",
                "clusters": [
                    {
                        "name": "lab",
                        "cluster": {
                            "server": f"https://127.0.0.1:{port}",
                            "insecure-skip-tls-verify": True,
                        },
                    }
                ],
                "users": [{"name": "me", "user": {"token": "t"}}],
                "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "me"}}],
            }
        )
    )
    code, _, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 2
    assert err.strip() == (
        f"error: cannot reach the API server at https://127.0.0.1:{port} "
        f"(kubeconfig {kubeconfig}, context lab): connection refused"
    )


def test_missing_kubeconfig_and_unknown_context(tmp_path: Path, apiserver: Any, cli: Cli) -> None:
    code, _, err = cli("k8s", "list", "--kubeconfig", str(tmp_path / "nope"))
    assert code == 2 and f"no kubeconfig at {tmp_path / 'nope'}" in err
    kubeconfig = apiserver.kubeconfig(tmp_path)
    code, _, err = cli("k8s", "list", "--kubeconfig", str(kubeconfig), "--context", "prod")
    assert code == 2 and "has no context 'prod' (it has: test)" in err


def test_token_and_context_namespace_are_used(tmp_path: Path, apiserver: Any) -> None:
    cluster = connect(apiserver.kubeconfig(tmp_path, namespace="team-a"))
    assert cluster.default_namespace == "team-a"
    assert cluster.list("Pod") == []
    request = apiserver.requests[-1]
    assert request["path"] == "/api/v1/namespaces/team-a/pods"
    assert request["authorization"] == "Bearer test-token"


@pytest.mark.parametrize(
    ("status", "recorded", "error", "text"),
    [
        (401, "unauthorized", api_errors.ClusterError, "unauthorized (401): the credentials of"),
        (403, "forbidden_patch_job", api_errors.Forbidden, 'cannot patch resource "jobs"'),
        (409, "conflict_job_being_deleted", api_errors.Conflict, "object is being deleted"),
        (422, "invalid_job_immutable", api_errors.ClusterError, "field is immutable"),
    ],
)
def test_error_statuses_become_one_clear_line(
    tmp_path: Path, apiserver: Any, status: int, recorded: str, error: type[Exception], text: str
) -> None:
    server = apiserver
    server.answer("GET", "/apis/batch/v1/namespaces/ml/jobs/tiny", status, server.recorded(recorded))
    cluster = connect(server.kubeconfig(tmp_path))
    with pytest.raises(error) as e:
        cluster.get("Job", "tiny")
    message = str(e.value)
    assert message.startswith("get Job tiny in namespace ml: ") and text in message
    assert f"{server.url} (kubeconfig " in message
    assert "\n" not in message and e.value.exit_code == 2


def test_not_found_and_discovery(tmp_path: Path, apiserver: Any) -> None:
    server = apiserver
    cluster = connect(server.kubeconfig(tmp_path))
    assert cluster.find("ConfigMap", "nope-config") is None
    # a group the server does not have answers like the real one: plain text
    server.answer(
        "GET", "/apis/jobset.x-k8s.io/v1alpha2", 404, b"404 page not found\n", "text/plain; charset=utf-8"
    )
    assert cluster.served("JobSet") is False
    with pytest.raises(api_errors.ClusterError, match=r"does not serve JobSet \(jobset.x-k8s.io/v1alpha2\)"):
        cluster.require("JobSet")
    server.answer("GET", "/apis/kubeflow.org/v1", 200, server.recorded("discovery_kubeflow_v1"))
    assert cluster.served("PyTorchJob") is True


def test_log_lines_stream(tmp_path: Path, apiserver: Any) -> None:
    server = apiserver
    server.answer(
        "GET",
        "/api/v1/namespaces/ml/pods/tiny-0/log",
        200,
        b"step 1/3 | loss 5.5\nstep 2/3 | loss 5.1\npartial",
        "text/plain",
    )
    cluster = connect(server.kubeconfig(tmp_path))
    lines = list(cluster.log_lines("tiny-0", container="trainer", follow=True, tail=10))
    assert lines == ["step 1/3 | loss 5.5", "step 2/3 | loss 5.1", "partial"]
    query = server.requests[-1]["query"]
    assert query == {"follow": ["true"], "container": ["trainer"], "tailLines": ["10"]}


def test_a_kubeconfig_that_is_not_yaml_is_one_line(tmp_path: Path, cli: Cli) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("apiVersion: v1\nclusters:\n  - name: x\n   cluster: {server: https://h:6443}\n")
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert code == 2 and out == ""
    assert err == f"error: kubeconfig {kubeconfig} is not valid YAML at line 4, column 4: expected <block end>, " \
        "but found '<block mapping start>'\n"


MAPPING = "must be a mapping (apiVersion, clusters, contexts, users)"


@pytest.mark.parametrize(("content", "why"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00\xff", "is not UTF-8 text (invalid byte at offset 0)"),
    (b"- apiVersion: v1\n- clusters: []\n", f"{MAPPING}, not a YAML list"),
    (b"just a string\n", f"{MAPPING}, not a YAML str"),
])
def test_a_kubeconfig_that_is_binary_or_not_a_mapping_is_one_line(tmp_path: Path, cli: Cli, content: bytes,
                                                                  why: str) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_bytes(content)
    code, out, err = cli("k8s", "status", "tiny", "--kubeconfig", str(kubeconfig))
    assert (code, out) == (2, "")
    assert err == f"error: kubeconfig {kubeconfig} {why}\n"
