"""The position-encoding study: a grid of settings x seeds from one preset, run in sequence or as Slurm
arrays, then one report (markdown table, PNG plots, TensorBoard images). ``tpe-study --help``.

- ``grid``: named settings (an encoding, or an encoding with no positions in the encoder or the
  decoder), the study directory and its manifest ``study.json``, the command of every run.
- ``runner``: runs the grid locally (``python -m tpe_train.train`` or ``accelerate launch``) or submits
  it through ``tpe-launch submit --script sweep_positions --array``; averages checkpoints on request.
- ``report``: gathers every run's ``eval.json`` into means and standard deviations over seeds.
- ``plots``: the figures, written as PNG files and as TensorBoard images.
"""
