"""tpe-train's launch layer: the same ``accelerate launch`` on a workstation and in Slurm allocations.

``plan`` builds a node's command from the resources, the layout and SLURM_*; ``submit`` renders the
templates of ``slurm/`` and calls sbatch; ``supervise`` runs the processes and handles preemption;
``cli`` is ``tpe-launch``. See docs/slurm.md.
"""
