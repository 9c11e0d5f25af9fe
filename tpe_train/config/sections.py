"""The config sections: one typed, documented, validated class per component, composed into ``Config``."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, field_serializer, field_validator, model_validator

from tpe_train.config.model_sections import ModelConfig, PositionConfig
from tpe_train.config.section import ConfigError, Section
from tpe_train.config.types import Beta, Bool, Buckets, Float, Int, Seed, Text
from tpe_train.positions.rotary import XposPosition

__all__ = ["ConfigError", "ModelConfig", "PositionConfig", "Section"]


class SyntheticConfig(Section):
    seed: Seed = 1234
    """Seed of the generator (the corpus is a pure function of this section)."""
    train_size: Int = Field(30000, ge=1)
    """Training pairs."""
    valid_size: Int = Field(500, ge=1)
    """Validation pairs (same length range as training)."""
    test_size: Int = Field(1000, ge=1)
    """Test pairs (same length range as training)."""
    long_size: Int = Field(300, ge=0)
    """Test pairs longer than any training pair (length extrapolation)."""
    probe_size: Int = Field(200, ge=1)
    """Word-order minimal pairs (subject and object swapped)."""
    min_words: Int = Field(4, ge=4)
    """Shortest source sentence, in words (with the final period)."""
    max_words: Int = Field(30, ge=4)
    """Longest training/valid/test source sentence, in words."""
    long_max_words: Int = Field(50, ge=5)
    """Longest source sentence of the extrapolation set (they start at max_words + 1)."""
    probe_max_words: Int = Field(12, ge=5)
    """Longest probe sentence, in words."""

    @model_validator(mode="after")
    def _lengths(self) -> SyntheticConfig:
        if not self.min_words <= self.max_words < self.long_max_words:
            raise ValueError(
                "need data.synthetic.min_words <= max_words < long_max_words, got "
                f"{self.min_words}, {self.max_words}, {self.long_max_words}"
            )
        return self


class CleanConfig(Section):
    normalize: Literal["NFC", "NFKC", "none"] = "NFKC"
    """Unicode normalisation of both sides (whitespace is always stripped and collapsed)."""
    min_words: Int = Field(1, ge=1)
    """Drop training pairs with fewer words than this on either side."""
    max_words: Int = Field(250, ge=1)
    """Drop training pairs with more words than this on either side."""
    max_ratio: Float = Field(9.0, ge=0.0)
    """Drop training pairs whose word-count ratio exceeds this (Moses clean-corpus-n; 0: off)."""
    dedup: Bool = False
    """Drop exact duplicate training pairs (after normalisation; the first is kept, found by an 8-byte hash
    of each pair)."""


class DataConfig(Section):
    corpus: Literal["synthetic", "hub", "parquet", "disk", "text"] = "synthetic"
    """Corpus source: the embedded synthetic pair, a hub dataset, hub-layout parquet, save_to_disk, text."""
    synthetic: SyntheticConfig = Field(default_factory=SyntheticConfig)
    """Parameters of the synthetic corpus."""
    path: Text = ""
    """Directory of a parquet / disk / text corpus (text: <split>.<lang>[.gz] line-aligned files)."""
    hub_id: Text = "wmt/wmt14"
    """Hub dataset id (corpus=hub)."""
    hub_config: Text = ""
    """Hub dataset config, e.g. de-en (default: the two languages, sorted, joined by '-')."""
    cache_dir: Text = ""
    """`datasets` cache directory (default: HF_DATASETS_CACHE); HF_DATASETS_OFFLINE=1 is honoured."""
    src_lang: Text = "en"
    """Source language code."""
    tgt_lang: Text = "de"
    """Target language code."""
    train_split: Text = "train"
    """Name of the training split."""
    valid_split: Text = "validation"
    """Name of the validation split."""
    test_split: Text = "test"
    """Name of the test split."""
    bad_utf8: Literal["error", "replace"] = "error"
    """Text corpora: stop on bytes that are not UTF-8 (error) or substitute U+FFFD (replace)."""
    clean: CleanConfig = Field(default_factory=CleanConfig)
    """Cleaning of the training split (real corpora)."""
    num_proc: Int = Field(1, ge=1)
    """Processes for cleaning and tokenising with datasets.map."""
    streaming: Bool = False
    """Read the training split as a stream (no token store): for corpora too large to prepare."""
    shuffle_buffer: Int = Field(10000, ge=1)
    """Streaming: pairs in the shuffle buffer."""
    tokenizer_sample: Int = Field(1_000_000, ge=1)
    """The joint tokenizer is trained on this many training pairs: spread evenly over a prepared corpus
    (all of it when smaller), the first ones of a stream."""
    store_dir: Text = ""
    """Root of the binarised token stores (default: $TPE_DATA_CACHE or ~/.cache/tpe-train/data)."""
    tokenizer: Literal["bpe", "unigram"] = "bpe"
    """Joint subword model trained with `tokenizers` on both sides."""
    vocab_size: Int = Field(8000, ge=16)
    """Joint vocabulary size (special tokens included)."""
    max_tokens: Int = Field(4096, ge=0, json_schema_extra={"takes": "auto, or a whole number >= 16"})
    """The micro-batch: at most this many padded source + target tokens per batch of one rank; auto (a
    GPU only; written 0 inside): the largest multiple of 64 whose forward, backward and optimizer step on
    the longest batches fits in train.memory_fraction of the device, probed before step 1 and recorded
    in <run_dir>/batch.json for a resume."""
    max_len: Int = Field(256, ge=4)
    """Training pairs with more tokens than this on either side are dropped."""

    @field_validator("max_tokens", mode="before")
    @classmethod
    def _auto(cls, value: Any) -> Any:
        return 0 if isinstance(value, str) and value.strip().lower() == "auto" else value

    @field_serializer("max_tokens")
    def _auto_out(self, value: int) -> int | str:
        return "auto" if value == 0 else value

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if 0 < self.max_tokens < 16:
            raise ValueError(
                f"data.max_tokens={self.max_tokens} cannot hold a pair; use at least 16 padded tokens, "
                "or auto on a GPU"
            )
        if self.max_tokens == 0 and self.streaming:
            raise ValueError(
                "data.max_tokens=auto probes the longest pairs of a prepared corpus, but data.streaming "
                "reads the corpus as it trains; set data.max_tokens to a number of padded tokens"
            )
        if self.corpus in ("parquet", "disk", "text") and not self.path:
            raise ValueError(
                f"data.corpus={self.corpus} reads a local directory, but data.path is empty; set "
                "data.path=/path/to/corpus"
            )
        if self.streaming and self.clean.dedup:
            raise ValueError(
                "data.clean.dedup needs the whole corpus and cannot stream; set data.clean.dedup=false "
                "or data.streaming=false"
            )
        if self.src_lang == self.tgt_lang:
            raise ValueError(f"data.src_lang and data.tgt_lang are both {self.src_lang!r}; set two languages")
        return self


class TrainConfig(Section):
    run_dir: Text = ""
    """Output directory (config, TensorBoard events, checkpoint); empty: runs/<preset>-<kind>-s<seed>."""
    seed: Seed = 1
    """Seed of parameter initialisation, dropout and batch order."""
    max_steps: Int = Field(1000, ge=1)
    """Optimizer steps to train."""
    accumulate: Int = Field(1, ge=1)
    """Micro-batches per rank per optimizer step (gradient accumulation); derived, and left at 1 here,
    when train.batch_tokens is set."""
    batch_tokens: Int = Field(0, ge=0)
    """The global batch: target tokens per optimizer step over all ranks (the papers: 25,000). The
    accumulation is then the smallest that reaches it: ceil(batch_tokens / (dp ranks x the mean target
    tokens of a micro-batch)), see docs/distributed.md; 0: train.accumulate micro-batches per rank."""
    memory_fraction: Float = Field(0.9, gt=0.0, le=1.0)
    """data.max_tokens=auto: the share of the GPU's memory the probed training step may use at its peak."""
    activation_checkpointing: Literal["none", "layers", "every_n"] = "none"
    """Recompute activations in the backward instead of keeping them (torch.utils.checkpoint,
    non-reentrant, the same dropout masks): none; layers: every encoder and decoder layer; every_n: every
    train.checkpoint_every-th layer of each stack (the first, then every n-th)."""
    checkpoint_every: Int = Field(2, ge=1)
    """train.activation_checkpointing=every_n: checkpoint layers 0, n, 2n, ... of each stack."""
    loss_chunk_tokens: Int = Field(0, ge=0)
    """Target tokens per chunk of the output layer and the loss: each chunk's (tokens x vocabulary)
    logits are made, scored and dropped, and made again in the backward, so one chunk's are alive at a
    time; the memory no layer checkpoint removes (docs/distributed.md). Costs the output layer's product
    once more. 0: the whole micro-batch at once."""
    lr: Float = Field(7e-4, gt=0.0)
    """Peak learning rate, reached at the end of warmup."""
    warmup_steps: Int = Field(4000, ge=0)
    """Linear warmup steps, then lr * sqrt(warmup / step) (inverse square root)."""
    adam_betas: tuple[Beta, Beta] = (0.9, 0.98)
    """Adam beta1 and beta2."""
    adam_eps: Float = Field(1e-9, gt=0.0)
    """Adam epsilon."""
    weight_decay: Float = Field(0.0, ge=0.0)
    """Decoupled weight decay (AdamW); 0 for the paper's Adam."""
    clip_norm: Float = Field(1.0, ge=0.0)
    """Clip the global gradient norm to this value (0: no clipping)."""
    label_smoothing: Float = Field(0.1, ge=0.0, lt=1.0)
    """Label smoothing epsilon."""
    bf16: Bool = False
    """bf16: autocast on one process; under DeepSpeed, bf16 weights with fp32 master weights."""
    fp16: Bool = False
    """fp16 autocast with dynamic loss scaling, for GPUs without bf16 (V100, T4): torch's loss scaler on
    one process and under DDP, DeepSpeed's under DeepSpeed (GPUs only). An overflow skips the update
    on the device; the step still counts, as the host does not wait to know. Runs on a CPU too
    (slowly)."""
    loss_scale_power: Int = Field(16, ge=0, le=32)
    """fp16: the dynamic loss scale starts at 2**loss_scale_power."""
    loss_scale_window: Int = Field(1000, ge=1)
    """fp16: steps without an overflow before the loss scale doubles (an overflow halves it)."""
    threads: Int = Field(0, ge=0)
    """torch intra-op threads (0: leave torch's default)."""
    cpu_gemm: Literal["auto", "onednn", "default"] = "auto"
    """Kernels of the linear layers' training GEMMs on a CPU (tpe_train/model/kernels.py): auto = oneDNN
    for fp32 where it beats MKL (AVX-512 processors not made by Intel) and bf16 widened to fp32 where
    the CPU has no bf16 kernels; onednn = fp32 always through oneDNN; default = PyTorch's kernels. Where
    $TPE_CPU_GEMM is onednn or default, auto means that mode (docs/testing.md)."""
    peak_gflops: Float = Field(0.0, ge=0.0)
    """GEMM peak of one device in the training precision, GFLOP/s, that train/mfu is measured against;
    0: measured at start-up (about a second; the best of PyTorch's, oneDNN's and widened kernels)."""
    log_every: Int = Field(10, ge=1)
    """Steps between TensorBoard scalars (and log lines when no progress bar is shown)."""
    valid_every: Int = Field(500, ge=1)
    """Steps between validations (loss and greedy BLEU); also done at the end."""
    valid_bleu_size: Int = Field(200, ge=0)
    """Validation sentences translated (greedy) for BLEU during training; 0: skip."""
    diagnostics_every: Int = Field(100, ge=0)
    """Steps between position diagnostics in TensorBoard, also done at the last step (0: none): per layer
    and head of encoder and decoder self-attention the mean attention distance on the first 64
    validation pairs; a learned table's row similarity as an image at the diagnostics steps that are
    also validation steps (valid_every) and the last (docs/positions.md)."""
    progress: Bool = True
    """Show a progress bar when stderr is a terminal; otherwise, or when false, rank 0 prints a line of
    figures (loss, lr, tokens/s, MFU) every log_every steps on stdout. Validation lines are always printed."""
    save_every: Int = Field(1000, ge=0)
    """Steps between checkpoints in <run_dir>/checkpoints (0: only at the end); also on preemption."""
    keep_last: Int = Field(5, ge=1)
    """Complete checkpoints kept (the newest ones; keep at least as many as you will average)."""
    keep_every: Int = Field(0, ge=0)
    """Also keep every checkpoint whose step is a multiple of this (0: none)."""
    resume: Text = "auto"
    """auto: continue from the newest checkpoint of <run_dir>/checkpoints that verifies against its manifest
    (a newer one that fails is moved aside as step-N.corrupt, with a warning); latest: the newest complete
    one, and stop if a file fails its hash (strict); never: start from step 0; or a checkpoint path."""
    async_save: Bool = False
    """Save in the background: the state is copied to host memory, then written while training goes on;
    the next save, the end and a preemption signal wait for it, and it is published only when complete."""
    deepspeed_shards: Bool = False
    """Also write DeepSpeed's own shard files (checkpoint's deepspeed/, for zero_to_fp32 and universal
    conversion); tpe-train never reads them, and they double the bytes written."""
    patience: Int = Field(0, ge=0)
    """Early stopping: stop after this many validations in a row without improving eval.select_by
    (0: train max_steps); trainer state, restored on resume."""
    log_samples: Bool = False
    """Write the pair ids of every training batch to <run_dir>/samples/rank-<r>.jsonl (audits resume)."""
    compile: Bool = False
    """Compile every encoder and decoder layer's training forward and backward with torch.compile
    (regional compilation); one process, DDP and DeepSpeed ZeRO-0/1/2, not ZeRO-3 or tensor
    parallelism. Validation and decoding run the eager layers. The first steps pay the compilation."""

    @model_validator(mode="after")
    def _resume(self) -> TrainConfig:
        if self.batch_tokens and self.accumulate > 1:
            raise ValueError(
                f"train.accumulate={self.accumulate} and train.batch_tokens={self.batch_tokens} are both "
                "set: with batch_tokens the accumulation is derived from the number of ranks; drop "
                "train.accumulate (or set train.batch_tokens=0 to choose it by hand)"
            )
        if self.compile and self.activation_checkpointing != "none":
            raise ValueError(
                "train.compile and train.activation_checkpointing are both set; the compiled layers are "
                "not checkpointed: choose one (train.activation_checkpointing=none or train.compile=false)"
            )
        value = self.resume.strip()
        keyword = value.lower()
        if not value or (keyword in RESUME_MODES and value != keyword) or keyword in ("strict", "fallback"):
            raise ValueError(
                f"train.resume={self.resume!r} is neither a mode nor a path; use auto (the newest checkpoint "
                "that verifies), latest (the newest checkpoint, strict), never, or the path of a checkpoint"
            )
        return self


RESUME_MODES = ("auto", "latest", "never")


class ParallelConfig(Section):
    tp_size: Int | None = Field(None, ge=1)
    """Tensor-parallel size (DeepSpeed AutoTP); empty: the launch file's autotp_size, else 1."""
    find_unused: Literal["first_step", "always"] = "first_step"
    """Plain data parallelism (torch DDP, no DeepSpeed), which must know the parameters that get no
    gradient: first_step = search the autograd graph for them in the first step only, and in every step
    when the first step found one (the usual model uses the same parameters at every step); always =
    search in every step (fairseq's --find-unused-parameters), for a model whose used parameters change
    from step to step (a module only long batches use). Ignored on one process and under DeepSpeed."""


class EvalConfig(Section):
    beam: Int = Field(4, ge=1)
    """Beam size (1: greedy)."""
    alpha: Float = Field(0.6, ge=0.0)
    """Length penalty exponent ((5 + len) / 6) ** alpha."""
    max_len_a: Float = Field(1.0, ge=0.0)
    """Maximum output length = a * source length + b."""
    max_len_b: Int = Field(50, ge=1)
    """Maximum output length = a * source length + b."""
    batch_size: Int = Field(128, ge=1)
    """Sentences per decoding batch at most."""
    max_tokens: Int = Field(6000, ge=1)
    """Padded source tokens (EOS included) per decoding batch at most; batches are cut after sorting
    the sentences by length."""
    length_buckets: Buckets = Field(default_factory=lambda: [10, 20, 30, 40])
    """Upper edges (source words, ascending) of the length buckets BLEU is reported for; a last open
    bucket follows."""
    at_end: Bool = True
    """Evaluate the final model on the test sets when training ends."""
    select: Literal["last", "best", "average_last"] = "last"
    """The final model, exported and evaluated: last (the last step's weights), best (the checkpoint of the
    best validation by eval.select_by, kept through pruning, exported to <run_dir>/best) or average_last."""
    select_by: Literal["loss", "bleu"] = "loss"
    """Validation figure of eval.select=best and train.patience: loss (nll per token, lower is better) or
    bleu (greedy BLEU on train.valid_bleu_size sentences, higher is better)."""
    average_last: Int = Field(1, ge=1)
    """eval.select=average_last: the final model is the mean of the last N >= 2 complete checkpoints,
    exported to <run_dir>/averaged-lastN (the papers: 5 base, 20 big). N > 1 with no eval.select given
    means select=average_last (configs older than eval.select)."""

    @model_validator(mode="before")
    @classmethod
    def _older_configs(cls, data: Any) -> Any:
        n = data.get("average_last") if isinstance(data, dict) else None
        if isinstance(n, int) and n > 1 and "select" not in data:
            return {**data, "select": "average_last"}
        return data


def check_augment_lengths(cfg: Config) -> None:
    """Refuse a position augmentation whose positions the encoding cannot hold, or that compiled
    layers would draw once per layer."""
    p, longest = cfg.model.position, cfg.data.max_len + 1
    if p.augment == "shape" and p.kind == "learned" and p.max_positions < longest + p.augment_max_shift:
        raise ValueError(
            f"model.position.augment=shape shifts positions by up to augment_max_shift="
            f"{p.augment_max_shift}, past the learned table of max_positions={p.max_positions} rows for "
            f"sequences of {longest} tokens (data.max_len + EOS/BOS); raise max_positions to at least "
            f"{longest + p.augment_max_shift} or lower augment_max_shift"
        )
    if p.augment == "randomized" and p.randomized_range <= longest:
        raise ValueError(
            f"model.position.augment=randomized draws positions from 0..randomized_range-1, but "
            f"randomized_range={p.randomized_range} is not above the longest training sequence ({longest} "
            "tokens, data.max_len + EOS/BOS); raise randomized_range (e.g. 4 x data.max_len)"
        )
    if p.augment == "randomized" and p.kind == "learned" and p.max_positions < p.randomized_range:
        raise ValueError(
            f"model.position.augment=randomized draws positions up to randomized_range-1="
            f"{p.randomized_range - 1}, past the learned table of max_positions={p.max_positions} rows; "
            "raise max_positions to randomized_range or lower randomized_range"
        )
    if p.augment != "none" and p.kind == "rope" and cfg.train.compile:
        raise ValueError(
            f"model.position.augment={p.augment} with rope draws the positions inside the attention "
            "layers, which train.compile would redraw in every compiled layer; set train.compile=false "
            "or model.position.augment=none"
        )


def check_xpos_fp16(cfg: Config) -> None:
    """Refuse xPos in the decoder under fp16 when its positions may pass the key scale's fp16 range:
    training sequences (data.max_len + BOS) and the translations of training-length sources
    (eval.max_len_a * data.max_len + eval.max_len_b)."""
    p = cfg.model.position
    if not (cfg.train.fp16 and p.kind == "xpos" and p.decoder):
        return
    limit = XposPosition.fp16_positions(p.xpos_scale_base)
    longest = max(cfg.data.max_len + 1, int(cfg.eval.max_len_a * cfg.data.max_len) + cfg.eval.max_len_b + 1)
    if longest > limit:
        raise ValueError(
            f"model.position.kind=xpos under train.fp16: the decoder's key scale zeta^(-j/gamma) passes "
            f"fp16's range beyond position {limit} (xpos_scale_base={p.xpos_scale_base:g}), but sequences "
            f"reach {longest} positions (data.max_len, or eval.max_len_a * data.max_len + max_len_b); "
            f"use train.bf16, or raise model.position.xpos_scale_base to at least "
            f"{math.ceil(p.xpos_scale_base * longest / limit)}, or lower data.max_len and eval.max_len_b"
        )


class Config(Section):
    preset: Text = Field(
        "demo", json_schema_extra={"takes": "letters, digits and ._-, starting with a letter or digit"}
    )
    """Name of the preset this config came from: letters, digits and ._- (it names the run directory and
    Slurm jobs); default the preset file's name."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """Architecture."""
    data: DataConfig = Field(default_factory=DataConfig)
    """Corpus, tokenizer and batching."""
    train: TrainConfig = Field(default_factory=TrainConfig)
    """Optimisation and logging."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Decoding and scoring."""
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    """Tensor parallelism (ZeRO stage and offload come from the launch file)."""

    @field_validator("preset")
    @classmethod
    def _preset_name(cls, value: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", value):
            raise ValueError(
                f"preset name {value!r} may hold only letters, digits and '._-', starting with a letter or "
                "digit (it names the run directory and Slurm jobs); set 'preset: NAME' in the preset file "
                "or rename the file"
            )
        return value

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        if self.train.bf16 and self.train.fp16:
            raise ValueError("train.bf16 and train.fp16 are both set; choose one precision")
        p = self.model.position
        if "learned" in (p.kind, p.cross) and p.max_positions < self.data.max_len + 1:
            raise ValueError(
                f"model.position.max_positions ({p.max_positions}) is shorter than the longest "
                f"training sequence (data.max_len={self.data.max_len} tokens + EOS/BOS); raise "
                "max_positions or lower data.max_len"
            )
        check_augment_lengths(self)
        check_xpos_fp16(self)
        n, select = self.eval.average_last, self.eval.select
        if select == "average_last" and n < 2:
            raise ValueError(
                f"eval.select=average_last averages the last eval.average_last checkpoints, but that is {n}; "
                "set eval.average_last=N with N >= 2 (the papers: 5 or 20)"
            )
        if select != "average_last" and n > 1:
            raise ValueError(
                f"eval.average_last={n} averages checkpoints, which only eval.select=average_last does, but "
                f"eval.select={select}; set eval.average_last=1, or eval.select=average_last"
            )
        uses_figure = select == "best" or self.train.patience > 0
        if uses_figure and self.eval.select_by == "bleu" and self.train.valid_bleu_size == 0:
            raise ValueError(
                "eval.select_by=bleu ranks validations by greedy BLEU (for eval.select=best or "
                "train.patience), but train.valid_bleu_size=0 translates no validation sentence; set "
                "train.valid_bleu_size (e.g. 500) or eval.select_by=loss"
            )
        if select == "average_last" and self.train.save_every == 0:
            raise ValueError(
                f"eval.average_last={n} averages the last {n} checkpoints, but train.save_every=0 saves "
                "only at the end; set train.save_every (steps between checkpoints), or eval.select=last or "
                "best with eval.average_last=1"
            )
        if select == "average_last" and n > self.train.keep_last:
            raise ValueError(
                f"eval.average_last={n} needs the last {n} checkpoints, but train.keep_last="
                f"{self.train.keep_last} deletes older ones; raise train.keep_last to at least {n}"
            )
        return self

    def run_dir(self) -> Path:
        """The run directory (``train.run_dir`` or a name derived from preset, encoding, seed)."""
        if self.train.run_dir:
            return Path(self.train.run_dir)
        return Path("runs") / f"{self.preset}-{self.model.position.kind}-s{self.train.seed}"

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
