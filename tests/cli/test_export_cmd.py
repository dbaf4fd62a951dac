"""`kubetrain export` (and `generate --chat`) on the command line: outputs, one-line errors, exit 2."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGUFReader

from kubetrain.cli import main
from kubetrain.files import umask
from tests.conftest import cli_env


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as done:
        main([str(a) for a in args])
    out, err = capsys.readouterr()
    return int(done.value.code or 0), out, err


def test_a_gpt_lora_run_to_gguf_and_hf(
    gpt_lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["export", gpt_lora_run, "-f", "gguf", "-o", tmp_path / "m.gguf", "--merge", "--json"]
    code, out, _ = run(args, capsys)
    assert code == 0
    done = json.loads(out.strip().splitlines()[-1])
    assert done["kind"] == "merged" and done["format"] == "gguf" and done["step"] == 4
    assert done["modelfile"] == str(tmp_path / "Modelfile")
    assert (tmp_path / "Modelfile").read_text().splitlines()[1:] == [
        "FROM ./m.gguf", 'TEMPLATE """{{ .Prompt }}"""', 'PARAMETER stop "<|endoftext|>"', "PARAMETER num_ctx 32"]
    names = {t.name for t in GGUFReader(str(tmp_path / "m.gguf")).tensors}
    assert "output.weight" in names  # the trained copy of the head, no longer tied to the embedding
    code, out, _ = run(["export", gpt_lora_run, "-o", tmp_path / "hf", "--merge", "--checkpoint", "latest"],
                       capsys)
    assert code == 0 and out.startswith("wrote merged model of ")
    assert (tmp_path / "hf" / "config.json").is_file()
    # readable by the server it is for, like every other output (safetensors' writer left model.safetensors 0600)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [*(tmp_path / "hf").iterdir(), tmp_path / "m.gguf"]}
    assert set(modes.values()) == {0o666 & ~umask()} and "model.safetensors" in modes
    # a second GGUF beside the first keeps the first's Modelfile, and says where its own went
    code, out, _ = run(["export", gpt_lora_run, "-f", "gguf", "-o", tmp_path / "m2.gguf", "--merge"], capsys)
    assert code == 0 and out.splitlines()[1] == (
        f"wrote the Ollama Modelfile {tmp_path / 'm2.Modelfile'} (the Modelfile there is another export's): "
        f"ollama create NAME -f {tmp_path / 'm2.Modelfile'}")
    assert "FROM ./m.gguf" in (tmp_path / "Modelfile").read_text()


def test_generate_chat_on_a_lora_run(lora_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", lora_run, "--chat", "--prompt", "reverse: red cat", "--max-new-tokens", "6",
            "--temperature", "0"]
    code, out, _ = run(args, capsys)
    assert code == 0 and out.startswith("reverse: red cat")


@pytest.mark.parametrize(("args", "message"), [
    (["-f", "onnx", "-o", "{tmp}/x"], "--format must be one of hf, gguf, not 'onnx'"),
    ([], "export needs -o OUT"),
    (["-o", "{tmp}/x", "--checkpoint", "first"], "--checkpoint must be 'best' or 'latest'"),
    (["-f", "gguf", "-o", "{tmp}/x.gguf", "--dtype", "bfloat16"], "GGUF export writes float32 or float16"),
    (["-o", "{tmp}/x", "--dtype", "int8"], "--dtype must be one of auto, float32, float16, bfloat16"),
    (["-o", "{tmp}"], "already exists"),
    (["-f", "gguf", "-o", "{tmp}/x.gguf"], "is a LoRA run and GGUF holds whole models: add --merge"),
    (["-o", "{tmp}/x"], "is a LoRA run and an adapter alone needs a Hugging Face base: add --merge"),
])
def test_bad_input_is_one_line_and_exit_2(
    gpt_lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    (tmp_path / "keep").write_text("not to be overwritten")
    code, _, err = run(["export", gpt_lora_run, *[a.format(tmp=tmp_path) for a in args]], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("error: ") and message in err
    assert (tmp_path / "keep").read_text() == "not to be overwritten"


def test_a_run_that_is_not_there_or_not_lora(
    lora_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = run(["export", tmp_path / "nowhere", "-o", tmp_path / "x"], capsys)
    assert code == 2 and err.strip() == f"error: no such run directory or checkpoint: {tmp_path / 'nowhere'}"
    merged = tmp_path / "merged"
    assert run(["export", lora_run, "-o", merged, "--merge"], capsys)[0] == 0
    code, _, err = run(["export", merged, "-o", tmp_path / "y"], capsys)
    assert code == 2 and "is not a run directory" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["hf", pytest.param("gguf", marks=pytest.mark.ci)])  # gguf: CI's stage
def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing(gpt_lora_run: Path, tmp_path: Path, fmt: str) -> None:
    # A full disk for real: a 16 KiB tmpfs, mounted in a user and mount namespace of its own (unshare)
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True, check=False) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("unshare -rm (user and mount namespaces) is not available here")
    (tmp_path / "small").mkdir()
    out = tmp_path / "small" / ("m.gguf" if fmt == "gguf" else "hf")
    export = [sys.executable, "-m", "kubetrain", "export", str(gpt_lora_run), "-f", fmt, "-o", str(out), "--merge"]
    small = tmp_path / "small"
    script = f"mount -t tmpfs -o size=16k tmpfs {small} && {shlex.join(export)}; echo $?; ls -A {small}"
    done = subprocess.run([unshare or "unshare", "-rm", "sh", "-c", script], env=cli_env(), capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.stderr == (f"error: no space left on the device of {out.parent}: nothing was exported; free some "
                           f"space there or choose another -o\n")
    assert done.stdout.splitlines() == ["2"]  # the exit code, and nothing left in the folder
