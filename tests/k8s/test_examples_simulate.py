"""Every example in examples/k8s/ runs as `kubetrain k8s simulate` runs it: rendered, each pod a local process, its
claims bound with --volume to folders holding tiny stand-ins for its data and models (slow: real processes).

Only what cannot run here is overridden: the device (CPU), the size (a tiny model, two steps, one process per pod,
one pod; two for the c10d example the issue found broken, whose pods once fought over a port), the vocabulary a BPE
tokenizer trains, and torch.compile. The workload, the volumes and where each input lives on them, the phases,
LoRA, FSDP are the example's own. Marked `ci` as well: `.ci/run` runs it, `scripts/test` leaves it out (about
four minutes on a loaded 2-core machine).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.hf_models import chat_rows

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "k8s"
KJV = Path(__file__).resolve().parents[2] / "src" / "kubetrain" / "data" / "corpus" / "kjv.txt"
TINY = ["run.device=cpu", "run.threads=1", "train.max_steps=2", "train.micro_batch_size=2", "train.grad_accum_steps=1",
        "train.warmup_steps=1", "train.log_every_steps=1", "train.precision=auto", "train.compile=false",
        "checkpoint.every_steps=2", "eval.every_steps=2", "eval.windows=1", "eval.sample_prompt=null",
        "k8s.nproc_per_node=1"]
# block 128: a chatml conversation of the chat fixtures fits, its assistant turn kept (16 cut every one)
GPT = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "model.block_size=128", "data.tokenizer.vocab_size=300"]
HF = ["model.block_size=32"]


def _text(path: Path, chars: int = 20_000) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(KJV.read_text(encoding="utf-8")[:chars], encoding="utf-8")


def _chat(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in chat_rows(400)), encoding="utf-8")


@pytest.fixture(scope="module")
def claims(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    """One folder per claim the examples mount, holding what each example reads from it (the same paths)."""
    root = tmp_path_factory.mktemp("claims")
    data = root / "data"
    _text(data / "corpus" / "kjv.txt")  # /data/corpus/*.txt and /data/corpus/**/*.txt
    _text(data / "approved" / "kjv.txt")
    _chat(data / "chat" / "train.jsonl")
    text = KJV.read_text(encoding="utf-8")[:20_000].split("\n\n")
    (data / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in text if t.strip()))
    for name in ("Llama-3.2-1B-Instruct", "qwen2.5-0.5b"):  # any causal LM folder: the tiny Llama stands in
        shutil.copytree(llama_dir, root / "models" / name)
    corpora = root / "checkpoints" / "corpora"  # homelab keeps its corpora on the checkpoint claim
    _text(corpora / "code" / "lib" / "words.py")
    for name in ("instruct", "specialist", "consensus"):
        _chat(corpora / f"{name}.jsonl")
    return root


def _overrides(example: Path) -> list[str]:
    raw = yaml.safe_load(example.read_text())
    k8s = raw.get("k8s", {})
    pods = 2 if example.stem == "c10d-4x1gpu" else 1
    out = [*TINY, *(HF if raw["model"]["kind"] == "hf" else GPT), f"k8s.nnodes={min(int(k8s.get('nnodes', 1)), pods)}"]
    out += [f"phases.{i}.train.max_steps=2" for i, phase in enumerate(raw.get("phases", []))
            if "max_steps" in phase.get("train", {})]
    return out


@pytest.mark.slow
@pytest.mark.ci
# homelab-3090 chains five phases under one BPE tokenizer: this test found that each phase trained its own (and
# refused the previous phase's checkpoint); a later phase now tokenizes with the one the first trained
@pytest.mark.parametrize("example", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.stem)
def test_each_shipped_example_simulates_to_the_end(example: Path, claims: Path, tmp_path: Path) -> None:
    raw = yaml.safe_load(example.read_text())
    volumes = [v for v in ("data", "models") if v in raw["k8s"].get("volumes", {})]
    binds = [a for v in volumes for a in ("--volume", f"{v}={claims / v}")]
    if "corpora" in example.read_text():
        work = tmp_path / "checkpoints"  # the run writes to this claim: a copy per test
        shutil.copytree(claims / "checkpoints", work)
        binds += ["--volume", f"checkpoints={work}"]
    sets = [a for item in _overrides(example) for a in ("--set", item)]
    done = subprocess.run([sys.executable, "-m", "kubetrain", "k8s", "simulate", str(example), "--root",
                           str(tmp_path / "sim"), *sets, *binds, "--timeout", "400"],
                          capture_output=True, text=True, check=False, timeout=500)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-5000:]
    assert "ok: all" in done.stdout and "Address already in use" not in out, out[-5000:]
