"""A training run: ``loop`` (the loop, top to bottom), ``startup`` (what a run is set up with before
step 1), ``build`` (model, optimizer, schedule and engine from a config), ``periodic`` (logging,
position logging, validation, checkpoints, each at its own cadence), ``finish`` (export and
evaluation), ``step`` (one optimizer step and one validation pass), ``schedule`` (the learning rate),
``precision`` (autocast and compute dtypes), ``seeding``, ``cpu_setup`` (CPU kernels and allocator),
``position_logging`` (position diagnostics to TensorBoard), ``selection`` (which weights a run ends
with, early stopping), ``cadence`` (when to log, validate and save), ``throughput`` (tokens/s, FLOPs,
the measured GEMM peak, MFU), ``scalars`` (log lines and TensorBoard), ``cli`` (``tpe-train``).
Nothing outside this folder imports the loop.
"""
