"""``ParallelContext``: who this process is in the data- and tensor-parallel layout, in one object.

Built once, from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, which
``accelerate launch`` and torchrun set) and the tensor-parallel size, then passed explicitly to
whatever needs it; nothing reads ranks from module globals. Ranks are laid out as a (dp, tp) grid,
``rank = dp_rank * tp_size + tp_rank``: the ranks of one tensor-parallel group are neighbours (one
node, fast links) and see the same batches. This is DeepSpeed's own layout, and when DeepSpeed runs
the groups are taken from it so that both sides use the very same process groups.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CPU = torch.device("cpu")


@dataclass(frozen=True)
class ParallelContext:
    """World, data-parallel and tensor-parallel sizes, ranks and process groups of one process."""

    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None  # torch ProcessGroup of this rank's tensor-parallel group (None: tp_size 1)
    dp_group: Any = None  # torch ProcessGroup of this rank's data-parallel group (None: whole world)
    device: torch.device = CPU  # where this rank's model, batches and collectives live
    host_group: Any = None  # a gloo group of the whole world, for host values (None: the default group)

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.world_size % self.tp_size:
            raise ValueError(
                f"the world size ({self.world_size} processes) is not a multiple of the tensor-parallel "
                f"size ({self.tp_size}); launch a multiple of parallel.tp_size processes"
            )

    @property
    def dp_size(self) -> int:
        return self.world_size // self.tp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def is_main(self) -> bool:
        """The one process that prints, logs and writes shared files."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def heads(self, n_heads: int) -> list[int]:
        """Global indices of the attention heads this rank owns (a contiguous block)."""
        per_rank = n_heads // self.tp_size
        return list(range(self.tp_rank * per_rank, (self.tp_rank + 1) * per_rank))

    def dp_sum(self, values: list[float]) -> list[float]:
        """Sum over the data-parallel ranks (tensor-parallel ranks hold the same numbers)."""
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # nccl reduces GPU tensors only
        return [float(v) for v in self.dp_reduce(t).tolist()]

    def dp_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (on this rank's device) summed over the data-parallel ranks, as a new tensor on the
        device: nothing is read back, and on a GPU the host does not wait for it."""
        if not self.distributed:
            return t
        t = t.clone()
        dist.all_reduce(t, group=self.dp_group)
        return t

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is true on any rank. A host flag, reduced over the host group
        (gloo): on GPUs, asking it every step does not make the host wait for the GPU's queue."""
        if not self.distributed:
            return flag
        t = torch.tensor([int(flag)])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.host_group)
        return bool(t.item())

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank (pickled through the host group: over
        nccl each object would go through the GPU)."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.host_group)
        return out

    def describe(self) -> str:
        return (
            f"world {self.world_size} = data-parallel {self.dp_size} x tensor-parallel {self.tp_size}; "
            f"rank {self.rank} (dp {self.dp_rank}, tp {self.tp_rank}) on {self.device}"
        )

    @classmethod
    def fake(cls, *, world_size: int = 1, rank: int = 0, tp_size: int = 1) -> ParallelContext:
        """A context without process groups, for sharding logic tested in one process."""
        return cls(world_size=world_size, rank=rank, local_rank=rank, tp_size=tp_size)

    @classmethod
    def from_env(cls, tp_size: int = 1, *, deepspeed: bool = False) -> ParallelContext:
        """The context of a launched process. Initialises ``torch.distributed`` (gloo on CPU, nccl on
        GPUs) when the launcher started more than one process, and the tensor/data-parallel groups."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", "0"))
        device = local_device(local)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # before any collective: nccl binds a rank to its current GPU
        probe = cls(world, rank, local, tp_size, device=device)  # validates sizes
        if world == 1 and not deepspeed:
            return probe
        if deepspeed:
            import deepspeed as ds  # heavy import, only when DeepSpeed runs

            from tpe_train.parallel.deepspeed_jit_lock import load_shm_comm_op

            load_shm_comm_op()  # before DeepSpeed builds it unguarded (see deepspeed_jit_lock.py)
            ds.init_distributed(dist_backend=_backend(), verbose=False)
        elif not dist.is_initialized():
            dist.init_process_group(backend=_backend())
        atexit.register(_destroy_process_group)
        # Host values (a preemption flag, a run lock, gathered objects) go through gloo on the CPU:
        # through nccl each would be a copy to the GPU and back, waiting for every kernel queued before it.
        host = dist.new_group(backend="gloo") if world > 1 else None
        if tp_size == 1:
            return dataclasses.replace(probe, host_group=host)
        if not deepspeed:
            raise ValueError(
                "tensor parallelism runs through DeepSpeed's AutoTP: launch with a DeepSpeed file"
            )
        from deepspeed.utils import groups

        groups._init_tp_mesh_device(tensor_model_parallel_size=tp_size)  # idempotent; the engine reuses it
        tp_group = groups.get_tensor_model_parallel_group()
        dp_group = groups._DATA_PARALLEL_GROUP  # the mesh's; _get_data_parallel_group() may be the world
        ctx = cls(world, rank, local, tp_size, tp_group, dp_group, device, host)
        sizes = (dist.get_world_size(tp_group), dist.get_world_size(dp_group))
        assert sizes == (tp_size, ctx.dp_size), f"DeepSpeed's tp/dp groups have sizes {sizes}"
        return ctx


def local_device(local_rank: int = 0) -> torch.device:
    """The GPU of local rank ``local_rank`` where the launch uses GPUs, else the CPU. A launch asks for
    the CPU explicitly with accelerate's ``use_cpu`` (``ACCELERATE_USE_CPU``) or ``DS_ACCELERATOR=cpu``,
    as the CPU launch files do; the CPU is also taken when torch sees no GPU."""
    wants_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or (
        os.environ.get("DS_ACCELERATOR") == "cpu"
    )
    if wants_cpu or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", local_rank % torch.cuda.device_count())


def _destroy_process_group() -> None:
    """At exit, while the interpreter is whole: a process that ends with its gloo group alive can
    abort in interpreter finalization ("terminate called without an active exception", SIGABRT),
    when gloo's worker threads release tensors and need the GIL (pytorch/pytorch#190489). It was
    seen once in 470 tests, on a rank of the 4-process TP 2 x DP 2 test. Registered by every from_env
    that joins a group; a second call finds no group and does nothing. Not enough alone: group objects
    DeepSpeed still holds are freed in finalization, which tpe-train's ranks therefore skip
    (``run.exits.end_process``)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _backend() -> str:
    return "nccl" if local_device().type == "cuda" else "gloo"
