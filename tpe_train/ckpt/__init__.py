"""Everything a run keeps on disk, in one package.

- ``rundir``: ``RunDir``, the run directory's layout (the only place its names are spelled);
- ``store``: checkpoint directories: manifest with hashes, atomic publish, ``latest``, pruning;
- ``shards``: the sharded tensor format: each rank's pieces of the global tensors, the index of which
  region each piece is, and the reads that serve any other layout;
- ``holdings``: what a rank holds of the training state under ZeRO 0-3 and tensor parallelism;
- ``state``: ``Checkpointer`` (save, also in the background, and restore) and the trainer's own state
  (step, data position, RNG, schedule, loss scale);
- ``export``: exports for ``tpe-eval`` (one checkpoint, or the mean of several) built offline from the
  shards one tensor at a time;
- ``cli``: ``tpe-ckpt`` (list, average, export, reshard).

Importing the package imports nothing heavy: the launch layer reads ``rundir`` without torch.
"""
