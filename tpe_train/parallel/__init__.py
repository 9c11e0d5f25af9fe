"""Parallelism applied from outside the model: ``ParallelContext``, the tensor-parallel plan, the
DeepSpeed config, the training engine and the memory report."""
