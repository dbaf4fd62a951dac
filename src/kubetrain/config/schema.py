"""Pydantic models of the whole config. Every default lives here and is written resolved into the run."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from kubetrain.config.k8s import K8sConfig
from kubetrain.config.names import one_folder_name, store_uri_problem
from kubetrain.config.preflight import PreflightConfig
from kubetrain.config.profile import ProfileConfig
from kubetrain.config.section import Section
from kubetrain.config.track import TrackConfig


class RunConfig(Section):
    name: str = Field("default", description="Run name; the run directory is <output_dir>/<name>.")
    output_dir: str = Field("runs", description="Folder that holds run directories.")
    seed: int = Field(1337, description="Seed for weights (the same initial model for every dist.strategy and world "
                      "size), data order and dropout.")
    device: Literal["auto", "cpu", "cuda", "mps"] = Field(
        "auto", description="auto picks cuda, then mps, then cpu."
    )
    threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU (default: torch's).")
    check_memory: bool = Field(
        True, description="Refuse to start when `kubetrain doctor`'s estimate of the training memory exceeds the "
        "memory free here (false: start anyway, for those who know the estimate is too high)."
    )

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, value: str) -> str:
        # The name is a folder under output_dir, a prefix in object storage and a pod's job name: `../x` or `a/b`
        # would put the run outside output_dir, and `.data` is the prepared-data cache beside the runs.
        return one_folder_name(value)


class SourceConfig(Section):
    kind: Literal["auto", "builtin", "text", "jsonl", "chat", "hf"] = Field(
        "auto",
        description="auto: told from the path's files when the data is prepared (text, jsonl, chat, or hf "
        "for a save_to_disk folder), the builtin corpus when there is no path; builtin: the corpus shipped "
        "with kubetrain; text: files/globs; jsonl: a text field; chat: messages or prompt/response JSONL; "
        "hf: a Hugging Face dataset (hub id or local)."
    )
    path: str | None = Field(
        None, description="File, folder or glob (text/jsonl/chat), or dataset id/folder (hf)."
    )
    text_field: str = Field("text", description="JSONL / dataset field that holds the text.")
    split: str = Field("train", description="Dataset split (hf).")
    name: str | None = Field(None, description="Dataset config name (hf).")
    weight: float = Field(1.0, gt=0, description="Relative share of this source (repeats whole documents).")

    @model_validator(mode="after")
    def _path_needed(self) -> SourceConfig:
        if self.kind == "builtin" and self.path:
            raise ValueError(
                f"a source of kind 'builtin' is the corpus shipped with kubetrain and takes no path "
                f"(got '{self.path}'): set kind to text, jsonl, chat, hf or auto"
            )
        if self.kind not in ("builtin", "auto") and not self.path:
            raise ValueError(f"a data source of kind '{self.kind}' needs a path")
        return self


class TokenizerConfig(Section):
    kind: Literal["byte", "bpe", "hf", "tiktoken"] = Field(
        "byte",
        description="byte: 256 byte ids, no files; bpe: trained on the corpus; hf: a tokenizer folder/id; "
        "tiktoken: a named encoding, read from TIKTOKEN_CACHE_DIR (fetched only when local_files_only is false)."
    )
    path: str | None = Field(
        None, description="Tokenizer folder or hub id (hf); encoding name (tiktoken); a BPE trained before, e.g. a "
        "run's tokenizer/ folder (bpe: reused, not trained; a later phase reuses the previous phase's this way)."
    )
    vocab_size: int = Field(4096, ge=260, description="Vocabulary size when training a BPE tokenizer.")
    local_files_only: bool = Field(
        True, description="Never reach a model hub (or tiktoken's download site) for the tokenizer."
    )


class ChatConfig(Section):
    template: str | None = Field(
        None, description="Chat template instead of the tokenizer's own: a Jinja template, or chatml / llama3."
    )
    mask_prompt: bool = Field(True, description="Leave prompt tokens out of the loss.")
    add_special_tokens: bool = Field(False, description="Let the tokenizer add BOS/EOS around the rendered text.")
    packing: bool = Field(
        False, description="Pack whole conversations into windows (best-fit decreasing, little padding); each "
        "attends only to itself, from position 0, so what is trained is what one conversation per window trains."
    )
    skip_bad_rows: bool = Field(False, description="Skip and count malformed rows instead of failing.")


class DataConfig(Section):
    sources: list[SourceConfig] = Field(
        default_factory=lambda: [SourceConfig()], description="What to train on; several sources are mixed."
    )
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="How text becomes token ids.")
    chat: ChatConfig = Field(default_factory=ChatConfig, description="How chat sources are rendered and masked.")
    attention: Literal["causal", "document"] = Field(
        "causal", description="causal: a window of text attends across the documents in it (nanoGPT, GPT-2); "
        "document: each token attends only to its own document, positions restart at each (the document masking "
        "Llama 3 was trained with). Packed chat always keeps conversations apart."
    )
    val_fraction: float = Field(0.05, ge=0.0, lt=1.0, description="Share of tokens held out for validation.")
    cache_dir: str | None = Field(None, description="Where prepared shards go (default <output_dir>/.data).")
    part_mb: float = Field(
        32.0, gt=0, le=4096,
        description="Size of the parts of text and JSONL files that processes tokenize in parallel (MiB); "
        "part of the cache key.",
    )


class LoraConfig(Section):
    r: int = Field(8, ge=1, description="Rank of the low-rank update.")
    alpha: int = Field(16, ge=1, description="Scale of the update (alpha / r multiplies it).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapter's input.")
    target_modules: list[str] | str = Field(
        default_factory=lambda: ["q_proj", "v_proj"],
        description="Linear layers that get adapters (names, or 'all-linear').",
    )
    modules_to_save: list[str] | None = Field(
        None, description="Modules trained in full and saved with the adapter (e.g. lm_head)."
    )


class ModelConfig(Section):
    kind: Literal["gpt", "hf"] = Field(
        "gpt", description="gpt: kubetrain's own decoder; hf: AutoModelForCausalLM."
    )
    n_layer: int = Field(4, ge=1, description="Transformer blocks (kind: gpt).")
    n_head: int = Field(4, ge=1, description="Attention heads; n_embd / n_head is the head size.")
    n_embd: int = Field(128, ge=8, description="Width of the residual stream.")
    block_size: int = Field(128, ge=2, description="Context length in tokens.")
    vocab_size: int | None = Field(None, description="Default: the tokenizer's vocabulary rounded up to 64.")
    mlp_hidden: int | None = Field(None, description="SwiGLU width (default ~8/3 n_embd, a multiple of 64).")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on attention and MLP outputs.")
    rope_theta: float = Field(10000.0, gt=0, description="Base of the rotary position embedding.")
    norm_eps: float = Field(1e-5, gt=0, description="Epsilon of RMSNorm.")
    tie_embeddings: bool = Field(True, description="Share the token embedding with the output head.")
    # Hugging Face models (kind: hf)
    name_or_path: str | None = Field(None, description="Local folder or hub id (kind: hf).")
    revision: str | None = Field(None, description="Branch, tag or commit of a hub model.")
    local_files_only: bool = Field(True, description="Never reach a model hub (offline).")
    trust_remote_code: bool = Field(False, description="Run the model's own Python code from its folder.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weight dtype of a Hugging Face model (auto: the training precision for a frozen "
        "LoRA base outside FSDP, loaded without an fp32 copy; float32 otherwise, autocast does the rest)."
    )
    gradient_checkpointing: bool = Field(False, description="Recompute activations in backward to save memory.")
    quantize: Literal["none", "nf4"] = Field(
        "none", description="nf4: QLoRA, the Hugging Face base loads in 4-bit NF4 through bitsandbytes and only "
        "the LoRA adapters train (needs model.lora; pip install 'kubetrain[qlora]')."
    )
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (null: off).")

    @model_validator(mode="after")
    def _shape(self) -> ModelConfig:
        if self.kind == "gpt" and self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.kind == "gpt" and (self.n_embd // self.n_head) % 2:
            raise ValueError("model.n_embd / model.n_head must be even for rotary embeddings")
        if self.kind == "hf" and not self.name_or_path:
            raise ValueError("model.kind 'hf' needs model.name_or_path")
        if self.quantize != "none" and (self.kind != "hf" or self.lora is None):
            raise ValueError("model.quantize nf4 (QLoRA) needs a Hugging Face model (kind: hf) and model.lora")
        return self


class TrainConfig(Section):
    max_steps: int = Field(200, ge=1, description="Optimizer steps.")
    max_tokens: int | None = Field(None, ge=1, description="Stop once this many tokens were trained on.")
    micro_batch_size: PositiveInt | Literal["auto"] = Field(
        16, description="Sequences per forward pass per process. auto: the largest that fits this device by the "
        "memory estimate (`kubetrain doctor CONFIG` shows it), confirmed by one training step at start-up that steps "
        "down on out-of-memory; it needs train.global_batch_size, which grad_accum_steps then keeps."
    )
    global_batch_size: int | None = Field(
        None, ge=1, description="Sequences per optimizer step over all processes (litgpt's global_batch_size, "
        "DeepSpeed's train_batch_size). Set, grad_accum_steps is derived: global_batch_size / (micro_batch_size x "
        "processes), which must divide it; the optimizer sees the same batch at any world size and micro-batch. "
        "null: micro_batch_size x grad_accum_steps x processes."
    )
    grad_accum_steps: int = Field(
        1, ge=1, description="Micro-batches per optimizer step; when global_batch_size is set, derived from it "
        "(a value given here gives way)."
    )
    memory_budget_gib: float | None = Field(
        None, gt=0, description="Memory of one device that micro_batch_size auto may plan to fill, in GiB (on the "
        "CPU: the RAM this node's processes share). null: 90% of what is free when the run starts."
    )
    lr: float = Field(3e-3, gt=0, description="Peak learning rate (AdamW).")
    min_lr: float | None = Field(None, ge=0, description="Cosine floor (default lr / 10).")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup steps before the cosine decay.")
    weight_decay: float = Field(0.1, ge=0, description="AdamW weight decay (matrices only).")
    beta1: float = Field(0.9, description="AdamW beta1.")
    beta2: float = Field(0.95, description="AdamW beta2.")
    grad_clip: float = Field(1.0, ge=0, description="Clip the global grad norm (0 = off).")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="auto: bf16 autocast on GPUs with native bf16 (sm80+, ROCm), fp16 with loss scaling "
        "on older GPUs, fp32 on CPU and MPS (`kubetrain doctor` shows the choice)."
    )
    compile: Literal["auto", True, False] = Field(
        "auto", description="torch.compile the model and its loss as one graph (under FSDP: each block, and the "
        "loss). auto: on for CUDA GPUs of compute capability 7.0+ with Triton, off on the CPU and MPS (the run's "
        "first lines say which and why); false: never."
    )
    log_every_steps: int = Field(10, ge=1, description="Steps between metric lines.")
    max_nonfinite_steps: int = Field(
        5, ge=1, description="A step whose loss or gradients are NaN or inf changes no weight and no optimizer state "
        "(skipped on the device, no sync per step, counted as skipped_steps; under fp16 also a step whose gradients "
        "overflowed); once this many steps in a row were skipped the run stops (exit 1), naming the newest "
        "checkpoint whose weights gave a finite loss, and nothing else fails a run. Read at the steps that log, "
        "evaluate or save; while steps are skipped periodic evaluations and saves wait, but the end of the run and "
        "a stop save the weights of the last step taken (exit 0, 75)."
    )
    deterministic: bool | None = Field(
        None, description="Deterministic kernels (null: on for CPU, where runs and resumes are bitwise "
        "repeatable; off on CUDA, where it costs speed: true sets the cuBLAS workspace and names the kernels "
        "that have no deterministic version)."
    )
    tf32: bool = Field(True, description="TF32 tensor cores for fp32 matmuls on CUDA (Ampere+); false: full fp32.")
    profile: ProfileConfig | None = Field(
        None, description="Trace some steps with the PyTorch profiler into <run>/profile/: a Chrome/Perfetto trace "
        "(open it in ui.perfetto.dev) and a table of the ops and kernels that took the most time "
        "(docs/performance.md). null: off."
    )

    @model_validator(mode="after")
    def _auto_needs_a_global_batch(self) -> TrainConfig:
        if self.micro_batch_size == "auto" and self.global_batch_size is None:
            raise ValueError(
                "micro_batch_size auto needs train.global_batch_size: the sequences per optimizer step over all "
                "processes, which grad_accum_steps keeps whatever micro-batch fits (e.g. global_batch_size: 16 for "
                "today's default of 16 x 1 on one process)")
        return self

    @property
    def micro_batch(self) -> int:
        """micro_batch_size as a number: `auto` is resolved at start-up (train/micro_batch.py) before it is read."""
        if not isinstance(self.micro_batch_size, int):
            raise RuntimeError("train.micro_batch_size auto was read before it was resolved")
        return self.micro_batch_size


class EvalConfig(Section):
    every_steps: int = Field(50, ge=1, description="Steps between evaluations (validation loss, sample).")
    windows: int = Field(
        128, ge=1, description="Validation windows (sequences of model.block_size tokens) per evaluation, over all "
        "ranks together: the first ones of the validation split, the same windows and the same token-weighted loss "
        "at any world size and micro-batch (train.micro_batch_size only sets how many go through one forward). "
        "Formerly eval.batches, which counted micro-batches: a config that still says eval.batches: N is read as "
        "N x train.micro_batch_size windows, the set it evaluated before, with one warning."
    )
    sample_prompt: str | None = Field(
        "And God said", min_length=1,
        description="Prompt for a sample at each eval and at the end of the run (null: no samples).",
    )
    sample_tokens: int = Field(64, ge=1, description="Tokens generated for the eval sample.")


class CheckpointConfig(Section):
    every_steps: int = Field(100, ge=1, description="Steps between checkpoints (one is also saved at the end).")
    save_best: bool = Field(
        False, description="Also save a checkpoint at every evaluation that improves the val loss (off: only "
        "every_steps, the end and a stop; `best` then names the saved checkpoint with the lowest val loss)."
    )
    keep_last: int = Field(3, ge=1, description="Periodic checkpoints kept (best is always kept).")
    grace_seconds: float = Field(60.0, gt=0, description="Time allowed to save after SIGTERM.")
    async_save: bool = Field(
        True, description="Copy the state to host memory in a background thread while the next step's forward and "
        "backward run (the optimizer step waits for the copy), then write, hash, fsync, rename and upload it there "
        "(one save in flight). Same atomic layout and resume guarantees. Under FSDP each rank copies its shards of the "
        "model and optimizer in a thread of its own (pinned, reused host buffers on CUDA) while the next step "
        "runs, and writes them with torch.distributed.checkpoint; nothing is gathered."
    )
    uri: str | None = Field(
        None, description="Object storage that keeps a copy of every checkpoint (s3://bucket/prefix, gs://, az://, "
        "or a path), under <uri>/<run.name>/checkpoints/; uploaded in the background, resumed from when the "
        "local folder is empty."
    )
    endpoint_url: str | None = Field(None, description="S3-compatible endpoint (MinIO, Ceph...) for s3:// URIs.")
    restore_attempts: int = Field(
        5, ge=1, description="Tries to read the store when the local folder has no checkpoint; then the run stops "
        "(exit 1) instead of starting again from step 0 (--resume never starts afresh on purpose)."
    )
    restore_backoff_seconds: float = Field(
        2.0, ge=0, description="Wait before the second try to read the store; it doubles after each try."
    )
    secret_name: str | None = Field(
        None, description="Kubernetes Secret with the store's credentials, for the pods; locally they come from the "
        "environment (AWS_ACCESS_KEY_ID...). Never put credentials in the config."
    )

    @field_validator("uri", "endpoint_url")
    @classmethod
    def _no_credentials(cls, value: str | None) -> str | None:
        if value and _CREDENTIALS.search(value):
            raise ValueError("holds credentials; name a Secret in checkpoint.secret_name, or set them in the "
                             "environment (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)")
        return value

    @field_validator("uri")
    @classmethod
    def _a_store(cls, value: str | None) -> str | None:
        problem = store_uri_problem(value) if value else None
        if problem:
            raise ValueError(problem)
        return value


# user:password@ in a URL, AWS access key ids, and signed or keyed query parameters
_CREDENTIALS = re.compile(
    r"://[^/@\s]*:[^/@\s]*@|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|"
    r"[?&][\w.-]*(?:key|secret|token|password|signature|credential|sig)[\w.-]*=",
    re.IGNORECASE,
)


class DistConfig(Section):
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="Process-group backend (auto: nccl on CUDA, gloo otherwise)."
    )
    strategy: Literal["ddp", "fsdp", "hsdp"] = Field(
        "ddp", description="ddp: a full copy per process; fsdp: FSDP2 shards weights and optimizer state over every "
        "process; hsdp: FSDP2 shards them within a group of shard_size processes (a node) and replicates the groups "
        "(all-gathers stay in the node, gradients are averaged across nodes). Their checkpoints are interchangeable."
    )
    shard_size: int | None = Field(
        None, ge=1, description="hsdp: processes that share one sharded copy of the model (default: the processes "
        "of one node, LOCAL_WORLD_SIZE); must divide the world size."
    )
    timeout_seconds: int | None = Field(
        None, ge=1, description="Collective timeout once the first step is done; a hung rank fails the job "
        "(null: derived, hang_timeout_seconds + max(half of it, 15 s); 900 without the watch). See "
        "docs/resilience.md for the order of the clocks."
    )
    init_timeout_seconds: int = Field(
        1800, ge=1,
        description="Collective timeout until the first step is done (start-up: loading, restoring, the first "
        "collectives of slow ranks); then timeout_seconds applies.",
    )
    hang_timeout_seconds: float | None = Field(
        600.0, gt=0, description="Under the launcher (--nproc, pods): when no rank finishes a step for this long, "
        "the job is hung: every rank's Python stacks go to <run>/incidents/, the workers are ended and restarted "
        "(--max-restarts) to resume. Must exceed the longest evaluation or checkpoint save; null: off. The collective "
        "timeout, /healthz and the hang alert follow it (config/clocks.py)."
    )
    preflight: PreflightConfig = Field(
        default_factory=PreflightConfig, description="Before step 1 of a job of several processes: every rank's "
        "device, links and clock, checked and named (false: off)."
    )

    @field_validator("preflight", mode="before")
    @classmethod
    def _preflight_switch(cls, value: Any) -> Any:
        return {"enabled": value} if isinstance(value, bool) else value  # `dist.preflight: false` turns it off

    @property
    def shards_weights(self) -> bool:
        """fsdp or hsdp: weights and optimizer state are sharded (when there are several processes)."""
        return self.strategy in ("fsdp", "hsdp")

    @model_validator(mode="after")
    def _shard_size_is_hsdp(self) -> DistConfig:
        if self.shard_size is not None and self.strategy != "hsdp":
            raise ValueError(f"dist.shard_size applies to dist.strategy hsdp (this config has {self.strategy})")
        return self


class PhaseConfig(Section):
    """One stage of a multi-phase run; its sections override the top-level ones."""

    name: str = Field(description="Phase name; its run is phases/<name>.")
    init_from: Literal["best", "final"] = Field(
        "best", description="Which checkpoint of the previous phase this one starts from."
    )
    reset_optimizer: bool = Field(True, description="Start with a fresh optimizer (false: carry its state).")
    data: dict[str, Any] | None = Field(None, description="Keys of `data:` that this phase overrides.")
    train: dict[str, Any] | None = Field(None, description="Keys of `train:` that this phase overrides.")
    eval: dict[str, Any] | None = Field(None, description="Keys of `eval:` that this phase overrides.")

    @field_validator("name")
    @classmethod
    def _one_folder_name(cls, value: str) -> str:
        return one_folder_name(value)  # `..` would make phases/.. the run directory itself


class Config(Section):
    run: RunConfig = Field(default_factory=RunConfig, description="Name, output folder, seed, device.")
    data: DataConfig = Field(default_factory=DataConfig, description="Sources, tokenizer, chat rendering, split.")
    model: ModelConfig = Field(default_factory=ModelConfig, description="Our GPT's shape, or a Hugging Face model.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Steps, batch, optimizer, precision.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Validation loss and samples.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="When to save, what to keep.")
    dist: DistConfig = Field(default_factory=DistConfig, description="Several processes: backend and strategy.")
    track: TrackConfig = Field(default_factory=TrackConfig, description="Metric sinks.")
    k8s: K8sConfig = Field(default_factory=K8sConfig, description="How the job is rendered for Kubernetes.")
    phases: list[PhaseConfig] = Field(
        default_factory=list, description="Stages run one after another, each from the previous one's weights."
    )

    @model_validator(mode="after")
    def _unique_phase_names(self) -> Config:
        names = [p.name for p in self.phases]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # each phase is the folder phases/<name>: two would train into one
            given = ", ".join(repr(n) for n in twice)
            raise ValueError(f"phases: more than one phase is named {given}; each trains in phases/<name>, so every "
                             "name must be unique")
        return self

    @model_validator(mode="after")
    def _quantized_not_sharded(self) -> Config:
        if self.model.quantize != "none" and self.dist.shards_weights:
            raise ValueError("model.quantize nf4 trains with dist.strategy ddp (FSDP does not shard 4-bit weights)")
        return self

    @model_validator(mode="after")
    def _hf_tokenizer(self) -> Config:
        # A Hugging Face model reads with its own tokenizer unless the config names another one.
        if self.model.kind == "hf" and "kind" not in self.data.tokenizer.model_fields_set:
            self.data.tokenizer = TokenizerConfig(
                kind="hf", path=self.model.name_or_path, local_files_only=self.model.local_files_only
            )
        return self
