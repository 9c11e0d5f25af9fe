"""``RunDir``: the layout of a run directory, the one place where its names are spelled.

    <run_dir>/
      config.yaml               the resolved config, written before step 1
      tokenizer.json            the run's vocabulary (a resumed run must keep it)
      deepspeed.json            the generated DeepSpeed config (DeepSpeed runs)
      memory.json               every rank's start-up memory report
      batch.json                the resolved batch; data.max_tokens=auto's probed micro-batch
      tb/                       TensorBoard events
      samples/rank-<r>.jsonl    the pair ids of every batch of data-parallel rank r (train.log_samples)
      checkpoints/              training checkpoints: step-<8 digits>/ and latest (ckpt.store)
      checkpoint/               the final export, what tpe-eval reads (ckpt.export)
      best/                     the checkpoint of the best validation, exported (eval.select=best)
      averaged-last<N>/         the mean of the last N checkpoints, exported (eval.average_last,
                                tpe-ckpt average, tpe-launch --script eval), with its eval.json
      eval.json                 the final figures (evaluate.EvalFiles)
      hypotheses/               the test hypotheses and references scored (evaluate.EvalFiles)
      preempted.json            written when a preemption signal stopped the run (exit status 75)
      slurm-<job>.out           Slurm's log of a job (tpe-launch submit)

Only the standard library here: the launch layer reads it without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

#: Names shared by the run directory, its checkpoints and exports.
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"
EVAL = "eval.json"


@dataclass(frozen=True)
class RunDir:
    """The paths of one run directory."""

    path: Path

    @property
    def config(self) -> Path:
        return self.path / CONFIG

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER

    @property
    def deepspeed_config(self) -> Path:
        return self.path / "deepspeed.json"

    @property
    def memory(self) -> Path:
        return self.path / "memory.json"

    @property
    def batch(self) -> Path:
        """The resolved batch (micro-batch, accumulation, data.max_tokens=auto's probe)."""
        return self.path / "batch.json"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    def samples(self, dp_rank: int) -> Path:
        return self.path / "samples" / f"rank-{dp_rank:05d}.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def export(self) -> Path:
        return self.path / "checkpoint"

    @property
    def best(self) -> Path:
        return self.path / "best"

    def averaged(self, n: int) -> Path:
        return self.path / f"averaged-last{n}"

    @property
    def eval(self) -> Path:
        return self.path / EVAL

    @property
    def preempted(self) -> Path:
        return self.path / "preempted.json"

    def slurm_log(self, job: str) -> Path:
        """Slurm's log (``job``: a filename pattern such as ``%j`` or ``eval-%j``)."""
        return self.path / f"slurm-{job}.out"

    @staticmethod
    def what(path: Path) -> tuple[str, bool] | None:
        """What ``path`` is, for a command that must not write over it (``run.outputs``): a phrase,
        and whether nothing may be written inside it either; None for anything else."""
        path = Path(path)
        if path.name == "checkpoints" and (path.parent / CONFIG).is_file():
            return f"the checkpoints of the run {path.parent}", True
        if (path / "manifest.json").is_file() and path.parent.name == "checkpoints":
            return "a training checkpoint", True
        if any((path / name).exists() for name in (CONFIG, "checkpoints", "run.lock")):
            return "a run directory of tpe-train (it holds its config, checkpoints or lock)", False
        return None

    @classmethod
    def readers_root(cls, path: Path) -> Path | None:
        """The checkpoints folder whose readers' lock (``run.readers``) covers ``path``: a checkpoint's
        own ``checkpoints/``, a run directory's, or that of the run directory an export lies in."""
        path = Path(path)
        if cls.of_checkpoints(path.parent) is not None:  # a checkpoint
            return path.parent
        for run in (cls(path), cls(path.parent)):  # a run directory, an export in one
            if run.checkpoints.is_dir():
                return run.checkpoints
        return None

    @classmethod
    def of_checkpoints(cls, path: Path) -> RunDir | None:
        """The run directory whose checkpoints directory ``path`` is, if it is one."""
        run = cls(path.parent)
        return run if run.checkpoints == path else None
