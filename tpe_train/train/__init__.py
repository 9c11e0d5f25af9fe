"""A training run: ``loop`` (the loop, top to bottom), ``startup`` (what a run is set up with before
step 1), ``build`` (model, optimizer, schedule and engine from a config), ``periodic`` (logging,
diagnostics, validation, checkpoints, each at its own cadence), ``finish`` (export and evaluation),
``step`` (one optimizer step and one validation pass), ``selection`` (which weights a run ends with,
early stopping), ``cadence`` (when to log, validate and save), ``throughput`` (tokens/s, FLOPs, the
measured GEMM peak, MFU), ``scalars`` (log lines and TensorBoard), ``cli`` (``tpe-train``). Nothing
outside this folder imports the loop.
"""
