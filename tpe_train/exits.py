"""Exit statuses of tpe-train's commands, shared with the launch layer (no heavy imports here)."""

#: Done.
EXIT_OK = 0
#: Bad config, data, layout or checkpoint: a one-paragraph message, nothing written or lost.
EXIT_BAD_INPUT = 2
#: Preempted (SIGTERM or SIGUSR1): the checkpoint is complete; requeue the job (EX_TEMPFAIL).
EXIT_PREEMPTED = 75
