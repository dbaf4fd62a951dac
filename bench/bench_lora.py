"""LoRA fine-tuning throughput: kubetrain's loop vs Hugging Face Trainer + PEFT, same model, data and batch.

    PYTHONPATH=src python bench/bench_lora.py [--steps 10] [--warmup 3] [--threads 2] [--repeat 1]

A random-initialised Llama (width 512, 4 layers, vocab 4096) gets LoRA r=16 on every projection and is trained
on the same synthetic chat set (prompt tokens masked) with the same micro-batch (8 x 256 tokens), optimizer
settings and fp32 on this CPU. Throughput is counted in real tokens per second: tokens that are not padding,
from the end of the warm-up steps to the last step. Each variant runs in its own process, so its peak RSS is
its own. Variants:
  kubetrain-packed    the real training loop (kubetrain.train.trainer.train), data.chat.packing: true
  kubetrain-unpacked  the same with one conversation per window (padded to 256)
  hf-trainer          transformers.Trainer + peft, conversations padded to the longest in each batch
  hf-trainer-grouped  the same with train_sampling_strategy group_by_length (less padding)
Results go to bench/results/lora-llama512x4-cpu-<date>.json with the commit they ran on.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from provenance import commit

WIDTH, LAYERS, HEADS, FFN, VOCAB = 512, 4, 8, 1536, 4096
BLOCK, BATCH, LR = 256, 8, 2e-4
LORA: dict[str, Any] = {"r": 16, "alpha": 32, "dropout": 0.05,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
VARIANTS = ("kubetrain-packed", "hf-trainer", "kubetrain-unpacked", "hf-trainer-grouped")


def build_assets(root: Path, n_conversations: int = 600) -> None:
    """Chat JSONL of varied lengths, a byte-level BPE with a chat template and a random Llama, all in root."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(800)]
    rows = []
    for i in range(n_conversations):
        prompt = f"question {i}: " + " ".join(rng.choices(words, k=rng.randint(5, 60)))
        answer = " ".join(rng.choices(words, k=rng.randint(10, 140)))
        rows.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": answer}]})
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<|pad|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator((json.dumps(r) for r in rows), trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1],
                                   pad_token=specials[4])
    fast.chat_template = TEMPLATE
    model_dir = root / "model"
    fast.save_pretrained(str(model_dir))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=2 * BLOCK,
                      bos_token_id=0, eos_token_id=1, pad_token_id=4)
    LlamaForCausalLM(cfg).save_pretrained(str(model_dir))


def kubetrain_config(root: Path, packing: bool, steps: int, threads: int) -> Any:
    from kubetrain.config.loading import validate

    return validate({
        "run": {"name": f"bench-{'packed' if packing else 'unpacked'}", "output_dir": str(root / "runs"),
                "threads": threads, "seed": 0},
        "data": {"sources": [{"kind": "chat", "path": str(root / "chat.jsonl")}], "val_fraction": 0.02,
                 "chat": {"packing": packing}},
        "model": {"kind": "hf", "name_or_path": str(root / "model"), "block_size": BLOCK, "lora": LORA},
        "train": {"max_steps": steps, "micro_batch_size": BATCH, "lr": LR, "warmup_steps": 2,
                  "log_every_steps": 1, "weight_decay": 0.0, "grad_clip": 1.0},
        "eval": {"every_steps": 100_000, "windows": 1, "sample_prompt": None, "sample_tokens": 1},
        "checkpoint": {"every_steps": 100_000},
        "track": {"console": False},
    })


def run_kubetrain(root: Path, packing: bool, warmup: int, steps: int, threads: int) -> dict[str, Any]:
    """The real loop; real tokens per step are recounted by replaying the loader (a pure function of seed)."""
    from kubetrain.data.chat import pad_id
    from kubetrain.data.loader import TokenWindows, TrainLoader
    from kubetrain.data.shards import prepare
    from kubetrain.train.trainer import train

    cfg = kubetrain_config(root, packing, warmup + steps, threads)
    shutil.rmtree(root / "runs" / cfg.run.name, ignore_errors=True)  # a fresh run, not a resume of the last
    prepare(cfg)  # tokenizing is not training: done before the clock, as for the Trainer
    before = peak_rss_gib()
    result = train(cfg, log=lambda m: None)
    records = [json.loads(line) for line in (Path(result.run_dir) / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if r["kind"] == "train"}
    prepared = prepare(cfg)
    pad = pad_id(prepared.tokenizer())
    loader = TrainLoader(TokenWindows(prepared, "train", BLOCK), BATCH, cfg.run.seed)
    real = [int((loader.next_batch().input_ids != pad).sum()) for _ in range(warmup + steps)]
    step_times = [times[s + 1] - times[s] for s in range(warmup, warmup + steps)]
    return {"real_tokens": sum(real[warmup:]), "seconds": times[warmup + steps] - times[warmup],
            "step_rates": [n / t for n, t in zip(real[warmup:], step_times, strict=True)],
            "rss_before_training_gib": before}


def run_hf(root: Path, grouped: bool, warmup: int, steps: int, threads: int) -> dict[str, Any]:
    """Trainer + PEFT on the same conversations (same ids and masks as kubetrain's), padded per batch."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    from kubetrain.config.schema import ChatConfig, SourceConfig
    from kubetrain.data.chat import encode_conversations
    from kubetrain.data.tokenizers import HFTokenizer

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(str(root / "model"))
    src = SourceConfig(kind="chat", path=str(root / "chat.jsonl"))
    rows: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
    for ids, mask in encode_conversations(src, HFTokenizer(tok), ChatConfig(packing=True)):
        ids, mask = ids[:BLOCK], mask[:BLOCK]
        rows["input_ids"].append(ids)
        rows["attention_mask"].append([1] * len(ids))
        rows["labels"].append([t if m else -100 for t, m in zip(ids, mask, strict=True)])
    model = AutoModelForCausalLM.from_pretrained(str(root / "model"), dtype=torch.float32)
    model = get_peft_model(model, LoraConfig(
        r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
        target_modules=LORA["target_modules"], task_type="CAUSAL_LM"))

    marks: dict[int, tuple[float, int]] = {}
    before = peak_rss_gib()

    class Clock(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            marks[state.global_step] = (time.time(), state.num_input_tokens_seen)

    args = TrainingArguments(
        output_dir=str(root / "hf-out"), per_device_train_batch_size=BATCH, max_steps=warmup + steps,
        learning_rate=LR, lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=100_000, save_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        dataloader_num_workers=0, include_num_input_tokens_seen="non_padding",
        train_sampling_strategy="group_by_length" if grouped else "random",
    )
    collator = DataCollatorForSeq2Seq(tok, padding="longest", label_pad_token_id=-100)
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_dict(rows),
                      data_collator=collator, callbacks=[Clock()])
    trainer.train()
    (t0, n0), (t1, n1) = marks[warmup], marks[warmup + steps]
    span = range(warmup, warmup + steps)
    rates = [(marks[s + 1][1] - marks[s][1]) / (marks[s + 1][0] - marks[s][0]) for s in span]
    return {"real_tokens": n1 - n0, "seconds": t1 - t0, "step_rates": rates,
            "rss_before_training_gib": before}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def run_variant(name: str, root: Path, warmup: int, steps: int, threads: int) -> dict[str, Any]:
    if name.startswith("kubetrain"):
        out = run_kubetrain(root, name == "kubetrain-packed", warmup, steps, threads)
    else:
        out = run_hf(root, name == "hf-trainer-grouped", warmup, steps, threads)
    out["tokens_per_second"] = out["real_tokens"] / out["seconds"]
    out["median_step_tokens_per_second"] = statistics.median(out.pop("step_rates"))
    out["peak_rss_gib"] = peak_rss_gib()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=3, help="steps before the clock starts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="rounds over all variants; the best of each is kept")
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.variant:  # a child process: one variant, one JSON line
        print(json.dumps(run_variant(a.variant, a.root, a.warmup, a.steps, a.threads)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        root = Path(tmp)
        build_assets(root)
        best: dict[str, dict[str, Any]] = {}
        for _ in range(a.repeat):
            for name in VARIANTS:
                cmd = [sys.executable, __file__, "--variant", name, "--root", str(root),
                       "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if done.returncode:
                    sys.exit(f"{name} failed:\n{done.stderr[-3000:]}")
                res = json.loads(done.stdout.strip().splitlines()[-1])
                print(f"{name:20s} {res['tokens_per_second']:7.1f} real tok/s (median step "
                      f"{res['median_step_tokens_per_second']:7.1f})  peak RSS {res['peak_rss_gib']:.2f} GiB "
                      f"({res['rss_before_training_gib']:.2f} before training)", flush=True)
                if name not in best or res["tokens_per_second"] > best[name]["tokens_per_second"]:
                    best[name] = res
    ratios = {f"{k} / {h}": best[k]["tokens_per_second"] / best[h]["tokens_per_second"]
              for k in ("kubetrain-packed", "kubetrain-unpacked")
              for h in ("hf-trainer", "hf-trainer-grouped")}
    for name, r in ratios.items():
        print(f"{name:42s} {r:.2f}x")
    report = {"benchmark": "lora-llama512x4", "date": time.strftime("%Y-%m-%d"), "commit": commit(),
              "hardware": f"{platform.processor() or platform.machine()} cpu, {a.threads} threads",
              "shape": {"width": WIDTH, "layers": LAYERS, "heads": HEADS, "ffn": FFN, "vocab": VOCAB,
                        "block": BLOCK, "micro_batch": BATCH, "lora": LORA},
              "steps": a.steps, "warmup": a.warmup, "repeat": a.repeat, "results": best, "ratios": ratios}
    out = Path(__file__).parent / "results" / f"lora-llama512x4-cpu-{time.strftime('%Y%m%d')}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
