"""The checks that need a GPU (CI has none), apart from the benchmarks: each runs as
``python -m benchmarks.gpu.<name> OUT_DIR`` from the repository root, and as a CPU dry run with
``--dry-run`` (the CI smoke test). ``check``: the trainer, launcher and evaluation on a GPU;
``attention``: flex's gradients, decoding and the attention benchmark; ``scale``: memory, DeepSpeed
and MFU goals. They import the benchmarks' harness and run the benchmark scripts as subprocesses."""
