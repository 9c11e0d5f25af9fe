"""The position-encoding study: a grid of settings x seeds from one preset, run in sequence or as Slurm
arrays, then one report (markdown table, paired significance tests, PNG plots, TensorBoard images).
``tpe-study --help``.

- ``grid``: named settings (an encoding, or an encoding with no positions in the encoder or the
  decoder), the study directory and its manifest ``study.json``, the command of every run.
- ``runner``: trains the grid locally (``python -m tpe_train.train`` or ``accelerate launch``, one
  process per run) or submits it as Slurm job arrays through tpe-launch's library; averages checkpoints
  (``checkpoint.export_mean``) and evaluates them (``evaluate.evaluate``) on request.
- ``results``: the types both report and plots use: every run's figures, means and deviations over
  seeds, and the paired bootstrap tests against the baseline setting.
- ``report``: the markdown table and ``summary.json`` (of a study, and of an extrapolation).
- ``plots``: the figures, written as PNG files and as TensorBoard images.
- ``extrapolate`` and ``position_methods``: ``tpe-study extrapolate``, trained checkpoints x test-time
  position methods x test sets (and their concatenations), each cell decoded once and kept, scored per
  length bucket with bootstrap intervals and paired tests against the unmodified model.
"""
