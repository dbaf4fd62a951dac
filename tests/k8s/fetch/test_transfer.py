"""The local side of fetch, over the local transport: the pod program runs as a process on a folder that stands
for the claim (the same program and code path as through exec in a pod)."""

from __future__ import annotations

import io
import json
import os
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from kubetrain import checkpoint
from kubetrain.errors import UserInputError
from kubetrain.k8s.fetch.program import NOTES
from kubetrain.k8s.fetch.transfer import MANIFEST, FetchError, LocalTransport, fetch_run
from tests.checkpoint.conftest import save_step


@pytest.fixture
def claim(tmp_path: Path) -> Path:
    """A run directory as training leaves it on the claim, with the in-progress names fetch must skip."""
    run = tmp_path / "claim" / "run1"
    ckpts = run / "checkpoints"
    for step, best in ((3, True), (6, False), (9, False)):
        save_step(ckpts, step, keep_last=3, best=best)
    (run / "config.yaml").write_text("run:\n  name: run1\n")
    (run / "meta.json").write_text(json.dumps({"status": "running"}))
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "phases" / "code" / "checkpoints").mkdir(parents=True)
    save_step(run / "phases" / "code" / "checkpoints", 2)
    (ckpts / "step-000012.tmp").mkdir()  # a save in progress
    (ckpts / "step-000012.tmp" / "model.safetensors").write_bytes(b"partial")
    (ckpts / ".upload" / "step-000009.1").mkdir(parents=True)  # the uploader's hard links
    (ckpts / ".upload" / "step-000009.1" / "meta.json").write_text("{}")
    return run


def test_latest_then_only_what_changed(claim: Path, tmp_path: Path) -> None:
    local = tmp_path / "local" / "run1"
    first = fetch_run(LocalTransport(), str(claim), local)
    assert sorted(first.checkpoints) == ["checkpoints/step-000009", "phases/code/checkpoints/step-000002"]
    assert checkpoint.pointer(local / "checkpoints", "latest") == "step-000009"
    assert checkpoint.pointer(local / "checkpoints", "best") is None  # best (step 3) was not asked for
    assert not any(".tmp" in p.name or p.name == ".upload" for p in local.rglob("*"))
    checkpoint.verify(local / "checkpoints" / "step-000009")
    assert (local / "metrics.jsonl").read_text() == '{"step": 1}\n'

    again = fetch_run(LocalTransport(), str(claim), local)
    assert again.copied == [] and again.nbytes == 0
    with open(claim / "metrics.jsonl", "a") as f:  # the run goes on
        f.write('{"step": 2}\n')
    save_step(claim / "checkpoints", 12, keep_last=3)
    third = fetch_run(LocalTransport(), str(claim), local)
    assert third.checkpoints == ["checkpoints/step-000012"]
    new = {f"checkpoints/step-000012/{f.name}" for f in (claim / "checkpoints" / "step-000012").iterdir()}
    assert set(third.copied) == new | {"metrics.jsonl"}
    assert (local / "metrics.jsonl").read_text().count("step") == 2
    assert checkpoint.pointer(local / "checkpoints", "latest") == "step-000012"
    assert (local / "checkpoints" / "step-000009").is_dir()  # nothing already fetched is removed
    assert "metrics.jsonl" in json.loads((local / MANIFEST).read_text())


def test_best_all_and_none(claim: Path, tmp_path: Path) -> None:
    best = fetch_run(LocalTransport(), str(claim), tmp_path / "best", "best")
    assert "checkpoints/step-000003" in best.checkpoints
    assert checkpoint.pointer(tmp_path / "best" / "checkpoints", "best") == "step-000003"
    assert checkpoint.pointer(tmp_path / "best" / "checkpoints", "latest") == "step-000003"  # the newest here
    every = fetch_run(LocalTransport(), str(claim), tmp_path / "all", "all")
    assert len(every.checkpoints) == 4
    none = fetch_run(LocalTransport(), str(claim), tmp_path / "none", "none")
    assert none.checkpoints == [] and (tmp_path / "none" / "metrics.jsonl").is_file()
    with pytest.raises(FetchError, match=r"no run directory at .*run2 \(run directories there: run1\)"):
        fetch_run(LocalTransport(), str(claim.parent / "run2"), tmp_path / "x")


def test_a_checkpoint_that_fails_its_checksum_is_not_kept(claim: Path, tmp_path: Path) -> None:
    model = claim / "checkpoints" / "step-000009" / checkpoint.MODEL_FILE
    data = bytearray(model.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes: only the checksum tells
    model.write_bytes(bytes(data))
    result = fetch_run(LocalTransport(), str(claim), tmp_path / "local")
    assert result.failed == ["checkpoints/step-000009: model.safetensors fails its checksum"]
    assert not (tmp_path / "local" / "checkpoints" / "step-000009").exists()
    assert not list((tmp_path / "local").rglob("*.fetch.tmp"))


def test_an_interrupted_fetch_leaves_no_half_checkpoint(claim: Path, tmp_path: Path) -> None:
    class Cut(LocalTransport):
        """The connection drops in the middle of the tar stream."""

        def run(self, args: list[str]):  # type: ignore[no-untyped-def]
            inner = super().run(args)
            if args[0] == "list":
                return inner
            return _cut(inner)

    local = tmp_path / "local"
    with pytest.raises(ConnectionResetError):
        fetch_run(Cut(), str(claim), local)
    assert not (local / "checkpoints" / "step-000009").exists()
    assert not list(local.rglob("*.fetch.tmp"))
    assert fetch_run(LocalTransport(), str(claim), local).checkpoints  # the next fetch completes it


class _Half:
    """A stream that breaks 600 bytes into the first file of checkpoint step 9 (its meta.json comes last)."""

    def __init__(self, stream) -> None:  # type: ignore[no-untyped-def]
        self.stream, self.seen, self.left = stream, b"", None

    def read(self, n: int = -1) -> bytes:
        if self.left is not None and self.left <= 0:
            raise ConnectionResetError("connection lost")
        data = bytes(self.stream.read(min(n, 512) if n >= 0 else 512))
        self.seen = (self.seen + data)[-4096:]
        if self.left is None and b"checkpoints/step-000009/" in self.seen:
            self.left = 600
        if self.left is not None:
            self.left -= len(data)
        return data


@contextmanager
def _cut(inner):  # type: ignore[no-untyped-def]
    with inner as stream:
        yield _Half(stream)


def test_files_are_copied_with_their_content(claim: Path, tmp_path: Path) -> None:
    local = tmp_path / "local"
    fetch_run(LocalTransport(), str(claim), local, "all")
    for path in claim.rglob("*"):
        rel = path.relative_to(claim)
        if path.is_file() and ".tmp" not in str(rel) and ".upload" not in rel.parts:
            assert (local / rel).read_bytes() == path.read_bytes(), rel
    shutil.rmtree(local / "checkpoints" / "step-000006")
    os.remove(local / "config.yaml")
    again = fetch_run(LocalTransport(), str(claim), local, "all")
    assert "config.yaml" in again.copied and "checkpoints/step-000006" in again.checkpoints


class UntrustedPod:
    """A pod that sends a listing and an archive of its own choosing: what a compromised image, or a claim someone
    else can write, may send instead of what the real pod program (used everywhere else here) sends."""

    def __init__(self, members: dict[str, bytes], listed: list[str] | None = None,
                 pointers: dict[str, str] | None = None) -> None:
        self.members, self.listed, self.pointers = members, listed or list(members), pointers or {}

    @contextmanager
    def run(self, args: list[str]) -> Iterator[IO[bytes]]:
        if args[0] == "list":
            files = [[name, len(self.members.get(name, b"")), 1] for name in self.listed]
            yield io.BytesIO(json.dumps({"files": files, "pointers": self.pointers}).encode())
            return
        out = io.BytesIO()
        with tarfile.open(fileobj=out, mode="w|") as tar:
            for name, data in [*self.members.items(), (NOTES, b'{"gone": [], "changed": []}')]:
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        out.seek(0)
        yield out


def _all(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("name", ["../evil", "checkpoints/../../evil", "/tmp/kt-fetch-evil", "", ".", "a//b"])
def test_a_pod_that_lists_a_name_outside_the_run_directory_is_refused_before_any_copy(
    tmp_path: Path, name: str
) -> None:
    local = tmp_path / "work" / "run1"
    pod = UntrustedPod({"metrics.jsonl": b"{}\n", name: b"pwned"})
    with pytest.raises(UserInputError, match=r"the pod sent .*which would land outside .*the fetch stopped there"):
        fetch_run(pod, "/claim/run1", local)
    assert _all(tmp_path / "work") == {"run1"} and not Path("/tmp/kt-fetch-evil").exists()


def test_an_archive_member_outside_the_run_directory_is_refused(tmp_path: Path) -> None:
    local = tmp_path / "work" / "run1"
    pod = UntrustedPod({"metrics.jsonl": b"{}\n", "../../evil": b"pwned"}, listed=["metrics.jsonl"])
    with pytest.raises(UserInputError, match=r"the pod sent '../../evil', which would land outside"):
        fetch_run(pod, "/claim/run1", local)
    assert "evil" not in _all(tmp_path)


def test_an_archive_member_that_is_a_link_is_refused(tmp_path: Path) -> None:
    class LinkingPod(UntrustedPod):
        @contextmanager
        def run(self, args: list[str]) -> Iterator[IO[bytes]]:
            if args[0] == "list":
                with super().run(args) as out:
                    yield out
                return
            out = io.BytesIO()
            with tarfile.open(fileobj=out, mode="w|") as tar:
                link = tarfile.TarInfo("metrics.jsonl")
                link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
                tar.addfile(link)
            out.seek(0)
            yield out

    local = tmp_path / "work" / "run1"
    with pytest.raises(UserInputError, match=r"the pod sent 'metrics.jsonl', which is not a plain file"):
        fetch_run(LinkingPod({"metrics.jsonl": b"{}\n"}), "/claim/run1", local)
    assert _all(tmp_path / "work") == {"run1"}


def test_a_pointer_outside_or_naming_no_step_folder_is_not_followed(claim: Path, tmp_path: Path) -> None:
    with pytest.raises(UserInputError, match="would land outside"):
        fetch_run(UntrustedPod({}, pointers={"../../checkpoints/latest": "step-000003"}), "/claim/run1",
                  tmp_path / "a")
    files = {f"checkpoints/step-000003/{f.name}": f.read_bytes() for f in (claim / "checkpoints" / "step-000003")
             .iterdir()}
    pod = UntrustedPod(files, pointers={"checkpoints/latest": "../../../elsewhere"})
    fetched = fetch_run(pod, "/claim/run1", tmp_path / "b", "all")
    assert fetched.checkpoints == ["checkpoints/step-000003"]
    assert (tmp_path / "b" / "checkpoints" / "latest").read_text() == "step-000003\n"  # the newest here instead


def test_a_link_in_the_local_folder_that_leads_outside_is_refused(claim: Path, tmp_path: Path) -> None:
    local, elsewhere = tmp_path / "local" / "run1", tmp_path / "elsewhere"
    local.mkdir(parents=True)
    elsewhere.mkdir()
    (local / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(UserInputError, match=r"'checkpoints/.*would land outside .*through a link"):
        fetch_run(LocalTransport(), str(claim), local)
    assert list(elsewhere.iterdir()) == []
