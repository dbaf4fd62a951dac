"""`kubetrain k8s backup`: through the test API server (the pod program really runs on a folder standing for the
claim) into a real S3 server (SeaweedFS, over HTTP); restored with `runs sync` and verified."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kubetrain import checkpoint
from tests.k8s.fetch.test_pods import launched  # noqa: F401  (a fixture: job tiny, its claim with two checkpoints)
from tests.object_store import Bucket, bucket, s3_endpoint  # noqa: F401  (fixtures)

Cli = Callable[..., tuple[int, str, str]]


def backup(cli: Cli, kubeconfig: Path, bucket: Bucket, via: Path) -> tuple[int, str, str]:  # noqa: F811
    return cli("k8s", "backup", "tiny", bucket.uri, "--via", str(via), "--endpoint-url", bucket.endpoint,
               "--kubeconfig", str(kubeconfig))


@pytest.mark.slow
def test_backup_then_restore_anywhere(tmp_path: Path, apiserver: Any, cli: Cli, launched: tuple[Path, Path],  # noqa: F811
                                      bucket: Bucket) -> None:  # noqa: F811
    kubeconfig, run = launched
    apiserver.start(apiserver.pod("tiny", 0))
    code, out, err = backup(cli, kubeconfig, bucket, tmp_path / "via")
    assert code == 0, out + err
    last = out.splitlines()[-1]
    assert last.startswith(f"{bucket.uri}/tiny: ") and "checkpoints verified on the way: step-000003, step-000006" \
        in last, last
    assert bucket.fs.exists(bucket.path("tiny/checkpoints/step-000006/meta.json"))

    restored = tmp_path / "restored"
    code, out, err = cli("runs", "sync", f"{bucket.uri}/tiny", str(restored), "--endpoint-url", bucket.endpoint)
    assert code == 0, err
    for step in ("step-000003", "step-000006"):
        checkpoint.verify(restored / "checkpoints" / step)  # every checksum holds after both legs
    assert (restored / "metrics.jsonl").read_text() == (run / "metrics.jsonl").read_text()
    assert checkpoint.pointer(restored / "checkpoints", "latest") == "step-000006"

    # training went on: the next backup carries only the new checkpoint and the changed files
    from tests.checkpoint.conftest import save_step

    save_step(run / "checkpoints", 9)
    (run / "metrics.jsonl").write_text('{"step": 6}\n{"step": 9}\n')
    code, out, err = backup(cli, kubeconfig, bucket, tmp_path / "via")
    assert code == 0, out + err
    assert "checkpoints verified on the way: step-000009" in out.splitlines()[-1]
    pushed = int(out.splitlines()[-1].split(": ", 1)[1].split(" files")[0])
    assert 0 < pushed < 12  # the new checkpoint, its pointer and the metrics; not the whole run again
    assert bucket.fs.exists(bucket.path("tiny/checkpoints/step-000003/meta.json"))  # nothing deleted


def test_a_bad_uri_is_refused_before_anything_is_copied(tmp_path: Path, apiserver: Any, cli: Cli,
                                                        launched: tuple[Path, Path]) -> None:  # noqa: F811
    kubeconfig, _ = launched
    code, _, err = cli("k8s", "backup", "tiny", "ftp2://nowhere/x", "--via", str(tmp_path / "via"),
                       "--kubeconfig", str(kubeconfig))
    assert code == 2 and err.startswith("error:"), err
    assert not (tmp_path / "via").exists()
