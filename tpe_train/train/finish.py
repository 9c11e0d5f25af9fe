"""The end of a run, on rank 0: the export consolidated from the last checkpoint's shards (one tensor at
a time), the final model ``eval.select`` names, and its evaluation on the test sets (``eval.at_end``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tpe_train.ckpt.export import export_mean, load_export
from tpe_train.evaluation.evaluate import EvalFiles, config_sets, evaluate, format_table
from tpe_train.train import selection
from tpe_train.train.scalars import write_scalars
from tpe_train.train.startup import Run


def export_and_evaluate(run: Run, last: Path) -> dict[str, Any]:
    """The run's final figures (empty on the other ranks): the export's path, the selection, and the
    evaluation's figures, also written to ``eval.json`` and TensorBoard."""
    if not run.ctx.is_main:
        return {}
    cfg = run.cfg
    metrics: dict[str, Any] = {}
    checkpoint = export_mean([last], run.run_dir.export)
    metrics["checkpoint"] = str(checkpoint)
    last_model = load_export(checkpoint)[0]
    final, metrics["selected"] = selection.final_model(cfg, run.run_dir, last_model, run.progress.best)
    if cfg.eval.at_end:
        final.to(run.ctx.device)  # decoding on the rank's GPU where it has one
        sets = config_sets(cfg.data, run.data.splits)
        result = evaluate(final, run.data.tokenizer, sets, cfg.eval, lang=cfg.data.tgt_lang)
        metrics.update(result.figures())
        for name in ("bleu", "chrf", "exact_match", "probe_accuracy"):
            if metrics[name] is not None:
                write_scalars(run.writer, {f"test/{name}": metrics[name]}, run.progress.step)
        EvalFiles(run.run_dir.path).write(result, metrics)  # eval.json and the hypotheses scored
        print(format_table(metrics))
    print(f"checkpoint: {checkpoint}")
    return metrics
