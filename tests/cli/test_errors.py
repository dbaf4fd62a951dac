"""Bad input through the real entry point: one `error:` line on stderr, exit code 2, no traceback."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY, Cli, RunMain, cli_env


def setup_case(case: str, tmp: Path) -> list[str]:
    """Arguments of a `kubetrain` command that must fail with one line, after writing what it needs."""
    tiny = [arg for kv in TINY for arg in ("--set", kv)]
    text = ["--set", "data.sources.0.kind=text", "--set", f"data.sources.0.path={tmp / 'data.txt'}"]
    if case == "unknown key in a file":
        (tmp / "c.yaml").write_text("train:\n  max_stepz: 3\n")
        return ["train", str(tmp / "c.yaml")]
    if case == "mistyped --set key":
        return ["train", "--set", "train.lrr=0.1"]
    if case == "wrong type":
        return ["train", "--set", "train.max_steps=many"]
    if case == "wrong type in a file":
        (tmp / "c.yaml").write_text("model:\n  n_layer: two\n")
        return ["config", "validate", str(tmp / "c.yaml")]
    if case == "malformed --set":
        return ["train", "--set", "train.lr"]
    if case == "unknown preset":
        return ["train", "--preset", "huge"]
    if case == "config and preset":
        (tmp / "c.yaml").write_text("{}\n")
        return ["train", str(tmp / "c.yaml"), "--preset", "tiny"]
    if case == "missing config file":
        return ["train", str(tmp / "nope.yaml")]
    if case == "bad yaml":
        (tmp / "c.yaml").write_text("train: [\n")
        return ["config", "show", str(tmp / "c.yaml")]
    if case == "missing data path":
        return ["train", *tiny, *text]
    if case == "empty corpus":
        (tmp / "data.txt").write_text("")
        return ["train", *tiny, *text]
    if case == "non-UTF-8 text":
        (tmp / "data.txt").write_bytes(b"caf\xe9 au lait\n" * 50)
        return ["train", *tiny, *text]
    if case == "block size larger than the data":
        (tmp / "data.txt").write_text("only a few words\n")
        return ["train", *tiny, *text, "--set", "data.val_fraction=0"]
    if case == "validation split too small":
        (tmp / "data.txt").write_text("a few more words in here\n" * 10)
        return ["train", *tiny, *text]
    if case == "prepare with a missing path":
        return ["prepare", *text]
    if case == "generate from a folder that is no run":
        return ["generate", str(tmp), "--prompt", "hi"]
    if case == "train on a run directory":
        (tmp / "runs" / "r").mkdir(parents=True)
        (tmp / "runs" / "r" / "config.yaml").write_text("{}\n")
        return ["train", str(tmp / "runs" / "r")]
    if case == "runs show on a folder that is no run":
        return ["runs", "show", str(tmp)]
    if case == "no processes":
        return ["train", "--nproc", "0"]
    if case == "hsdp shard group that does not divide the world":
        return ["train", "--nproc", "2", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:1",
                "--set", "dist.strategy=hsdp", "--set", "dist.shard_size=3"]
    if case == "generate from a missing run":
        return ["generate", str(tmp / "runs" / "nope"), "--prompt", "hi"]
    if case == "render -o naming a file":
        (tmp / "out.yaml").write_text("kept\n")
        return ["k8s", "render", "-o", str(tmp / "out.yaml")]
    if case == "run name that leaves output_dir":
        return ["train", *tiny, "--set", "run.name=../evil"]
    if case == "run name with a folder, in render":
        return ["k8s", "render", "--set", "run.name=team/evil"]
    if case == "duplicate key in a file":
        (tmp / "c.yaml").write_text("train:\n  max_steps: 3\n  lr: 0.01\n  max_steps: 5\n")
        return ["config", "validate", str(tmp / "c.yaml")]
    if case == "runs list of a missing folder":
        return ["runs", "list", str(tmp / "nonexistent")]
    if case == "prepare with no processes":
        return ["prepare", "--nproc", "0"]
    if case == "an infinite learning rate":
        return ["train", *tiny, "--set", "train.lr=inf"]
    if case == "NaN in a file":
        (tmp / "c.yaml").write_text("train:\n  weight_decay: .nan\n")
        return ["config", "validate", str(tmp / "c.yaml")]
    if case == "an infinite number in a phase":
        (tmp / "c.yaml").write_text("phases:\n  - name: a\n    train: {lr: .inf}\n")
        return ["train", str(tmp / "c.yaml"), *tiny]
    if case == "two phases with one name":
        (tmp / "c.yaml").write_text("phases:\n  - name: a\n  - name: b\n  - name: a\n")
        return ["config", "validate", str(tmp / "c.yaml")]
    if case == "a store URL with an unknown scheme":
        return ["train", *tiny, "--set", "checkpoint.uri=ftp://host/x", "--dry-run"]
    if case == "a store URL with no bucket":
        return ["train", *tiny, "--set", "checkpoint.uri=s3://", "--dry-run"]
    if case == "a store URL that is neither a URL nor a path":
        return ["config", "validate", "--set", "checkpoint.uri=bogus:/x"]
    if case == "a prompt that is not UTF-8":
        return ["generate", str(tmp), "--prompt", b"caf\xe9".decode("utf-8", "surrogateescape")]
    if case == "a --set value that is not UTF-8":
        return ["config", "validate", "--set", "run.name=" + b"r\xff".decode("utf-8", "surrogateescape")]
    if case == "dry run resuming from a path that does not exist":
        return ["train", *tiny, "--dry-run", "--resume", str(tmp / "nope")]
    if case == "a node rank of a node the job does not have":
        return ["train", *tiny, "--node-rank", "5", "--dry-run"]
    if case == "the null device as data":
        return ["prepare", "--set", "data.sources.0.kind=text", "--set", "data.sources.0.path=/dev/null"]
    if case == "a FIFO as data":
        os.mkfifo(tmp / "fifo")
        return ["prepare", "--set", "data.sources.0.kind=text", "--set", f"data.sources.0.path={tmp / 'fifo'}"]
    if case == "the null device as config":
        return ["config", "validate", "/dev/null"]
    if case == "more processes than memory allows":
        return ["train", *tiny, "--nproc", "100000", "--dry-run", "--oversubscribe"]
    if case == "more processes than cores":
        return ["train", *tiny, "--nproc", "100000", "--dry-run"]
    if case == "runs sync to a store with no bucket":
        (tmp / "r").mkdir()
        (tmp / "r" / "metrics.jsonl").write_text("{}\n")
        return ["runs", "sync", str(tmp / "r"), "s3://"]
    if case == "runs sync to a store URL with one slash":
        (tmp / "r").mkdir()
        (tmp / "r" / "metrics.jsonl").write_text("{}\n")
        return ["runs", "sync", str(tmp / "r"), "bogus:/x"]  # it pushed into a folder named 'bogus:'
    if case == "an unknown flag":
        return ["train", "--bogus"]
    if case == "an unknown subcommand":
        return ["trian"]
    if case == "an extra argument":
        return ["config", "validate", "a.yaml", "b.yaml"]
    if case == "a flag without its value":
        return ["train", "--nproc"]
    raise AssertionError(case)


CASES = {
    "unknown key in a file": "unknown key 'train.max_stepz'; did you mean 'max_steps'?",
    "mistyped --set key": "--set: unknown key 'train.lrr'; did you mean 'lr'?",
    "wrong type": "train.max_steps: Input should be a valid integer",
    "wrong type in a file": "model.n_layer: Input should be a valid integer",
    "malformed --set": "--set needs KEY=VALUE, got 'train.lr'",
    "unknown preset": "unknown preset 'huge'",
    "config and preset": "give either a CONFIG file or --preset, not both",
    "missing config file": "config file not found",
    "bad yaml": "not valid YAML (line 2",
    "missing data path": "data path not found:",
    "empty corpus": "the corpus is empty",
    "non-UTF-8 text": "not UTF-8 text (invalid byte at offset 3)",
    "block size larger than the data": "fewer than one window of block_size + 1 (33)",
    "validation split too small": "the validation split has 12 tokens, fewer than block_size + 1 (33)",
    "prepare with a missing path": "data path not found:",
    "generate from a folder that is no run": "is not a run directory",
    "generate from a missing run": "no such run directory or checkpoint",
    "train on a run directory": "is a directory, not a config file; to continue the run in it, pass its config: ",
    "runs show on a folder that is no run": "is not a run directory (no meta.json, config.yaml or phases/)",
    "no processes": "--nproc: must be at least 1, got 0",
    "hsdp shard group that does not divide the world": "hsdp: dist.shard_size 3 must divide the world size 4",
    "render -o naming a file": "out.yaml: that is a file; name a folder",
    "run name that leaves output_dir": "run.name: '../evil' must be one folder name",
    "run name with a folder, in render": "run.name: 'team/evil' must be one folder name",
    "duplicate key in a file": "not valid YAML (line 4, column 3): duplicate key 'max_steps' (first on line 2)",
    "runs list of a missing folder": "no such folder: ",
    "prepare with no processes": "--nproc: must be at least 1, got 0",
    "an infinite learning rate": "train.lr: Input should be a finite number (got 'inf')",
    "NaN in a file": "train.weight_decay: Input should be a finite number (got nan)",
    "an infinite number in a phase": "phase 'a': train.lr: Input should be a finite number (got inf)",
    "two phases with one name": "phases: more than one phase is named 'a'; each trains in phases/<name>, so every "
                                "name must be unique",
    "a store URL with an unknown scheme": "checkpoint.uri: 'ftp://host/x' is not a store kubetrain can use (ftp://): "
                                          "give s3://BUCKET/PREFIX, gs://BUCKET/PREFIX",
    "a store URL with no bucket": "checkpoint.uri: 's3://' names no bucket: give s3://BUCKET/PREFIX",
    "a store URL that is neither a URL nor a path": "checkpoint.uri: 'bogus:/x' is not a store kubetrain can use "
                                                    "(bogus:/)",
    "a prompt that is not UTF-8": "--prompt is not UTF-8 text (byte 0xe9 at character 3)",
    "a --set value that is not UTF-8": "--set run.name: the value is not UTF-8 text",
    "dry run resuming from a path that does not exist": "--resume: no such checkpoint or run directory: ",
    "a node rank of a node the job does not have": "--node-rank 5: a job of 1 node (--nnodes 1) has node ranks 0 to 0",
    "the null device as data": "data path is not a regular file or folder: /dev/null (a character device)",
    "a FIFO as data": "fifo (a FIFO); name a file, a folder or a glob",
    "the null device as config": "/dev/null is not a regular file (a character device)",
    "more processes than memory allows": "error: --nproc 100000: this run needs about ",
    "more processes than cores": "error: --nproc 100000: more CPU processes than the ",
    "runs sync to a store with no bucket": "error: 's3://' names no bucket: give s3://BUCKET/PREFIX",
    "runs sync to a store URL with one slash": "error: 'bogus:/x' is not a store kubetrain can use (bogus:/)",
    "an unknown flag": "error: no such option: --bogus (see 'kubetrain train -h')",
    "an unknown subcommand": "error: no such command 'trian'. Did you mean 'train'? (see 'kubetrain -h')",
    "an extra argument": "error: got unexpected extra argument(s) (b.yaml) (see 'kubetrain config validate -h')",
    "a flag without its value": "error: option '--nproc' requires an argument",
}


def assert_one_error_line(code: int, err: str, message: str) -> None:
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("error: ")
    assert err.count("\n") == 1 and err.endswith("\n"), err
    assert message in err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_and_exit_2(case: str, run_main: RunMain, tmp_cwd: Path) -> None:
    code, _, err = run_main(*setup_case(case, tmp_cwd))
    assert_one_error_line(code, err, CASES[case])
    assert not (tmp_cwd / "runs" / "tiny").exists()  # nothing half-made is left behind
    assert not (tmp_cwd.parent / "evil").exists()
    assert not (tmp_cwd / "bogus:").exists()
    assert not (tmp_cwd / "out.yaml").exists() or (tmp_cwd / "out.yaml").read_text() == "kept\n"


@pytest.mark.slow
def test_an_output_folder_on_a_read_only_mount_is_one_line(tmp_cwd: Path, tiny_args: list[str]) -> None:
    # A read-only filesystem (EROFS: a pod's read-only root, a ro bind mount) refuses even root: mounted for real
    # in a user and mount namespace of its own (unshare), where the machine allows one
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True, check=False) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("unshare -rm (user and mount namespaces) is not available here")
    (tmp_cwd / "ro").mkdir()
    train = [sys.executable, "-m", "kubetrain", "train", *tiny_args, "--set", "run.output_dir=ro"]
    script = f"mount --bind -o ro ro ro && exec {shlex.join(train)}"
    done = subprocess.run([unshare or "unshare", "-rm", "sh", "-c", script], cwd=tmp_cwd, env=cli_env(),
                          capture_output=True, text=True, timeout=300, check=False)
    assert_one_error_line(done.returncode, done.stderr, "error: Read-only file system: ro/")


def test_debug_shows_the_traceback(run_main: RunMain, tmp_cwd: Path) -> None:
    code, _, err = run_main("--debug", *setup_case("missing data path", tmp_cwd))
    assert code == 2
    assert "Traceback (most recent call last)" in err
    assert "DataError" in err
    assert err.splitlines()[-1].startswith("error: data path not found:")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mistyped --set key", "non-UTF-8 text", "block size larger than the data"])
def test_bad_input_in_a_real_process(case: str, cli: Cli, tmp_cwd: Path) -> None:
    done = cli(*setup_case(case, tmp_cwd))
    assert_one_error_line(done.returncode, done.stderr, CASES[case])


@pytest.mark.slow
def test_debug_in_a_real_process(cli: Cli, tmp_cwd: Path) -> None:
    done = cli(*setup_case("empty corpus", tmp_cwd), "--debug")
    assert done.returncode == 2
    assert "Traceback (most recent call last)" in done.stderr
    assert done.stderr.splitlines()[-1].startswith("error: the corpus is empty")


@pytest.mark.parametrize("case", ["wrong type", "missing data path", "malformed --set", "a flag without its value"])
def test_json_gets_one_object_on_stdout_whatever_happens(case: str, run_main: RunMain, tmp_cwd: Path) -> None:
    """A script that asked for --json reads stdout only: a refusal is an object there too, beside the error line."""
    args = setup_case(case, tmp_cwd)
    code, out, err = run_main(*args[:1], "--json", *args[1:])
    assert code == 2 and err.startswith("error: ")
    assert json.loads(out) == {"error": err.strip().removeprefix("error: ").split(" (see '")[0], "exit": 2}


@pytest.mark.slow
def test_json_from_the_launcher_is_one_object_too(cli: Cli, tmp_cwd: Path, tiny_args: list[str]) -> None:
    """--nproc 2: the workers print none; the launcher's exit is the one object, with the workers' reason."""
    done = cli("train", *tiny_args, "--nproc", "2", "--json", "--set", "train.profile.ranks=[5]")
    assert done.returncode == 2, done.stderr
    [line] = done.stdout.strip().splitlines()[-1:]
    result = json.loads(line)
    assert result["exit"] == 2 and result["error"].startswith("train.profile.ranks: no rank 5"), result
    assert sum(1 for x in done.stdout.splitlines() if x.startswith("{")) == 1
