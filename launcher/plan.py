"""The ``accelerate launch`` command of one node, from the resources, the layout and the SLURM_* environment.

Pure functions and small dataclasses, so that the command is unit-testable from a fake environment:

- ``Resources``: nodes, GPUs per node, processes per node (one per GPU; on CPU nodes the processes
  asked for, else one per CPU asked for, else one).
- ``LaunchFile``: a launch file of ``configs/accelerate/`` (DDP, ZeRO, tensor parallelism), whether it
  runs on CPUs and whether DeepSpeed drives it.
- ``NodeEnv``: where this node stands: machine rank (``SLURM_NODEID``), machine count
  (``SLURM_NNODES``), main address (first host of ``SLURM_JOB_NODELIST``), port (from the job id).
  Outside Slurm: one machine, rank 0, 127.0.0.1.
- ``LaunchPlan``: all of the above plus the preset and overrides; ``command()`` is the argv to exec.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
LAYOUT_DIR = ROOT / "configs" / "accelerate"
#: array index -> built-in kind (the newer encodings after the first seven, whose indices stay)
POSITION_SWEEP = (
    "none",
    "sinusoidal",
    "learned",
    "shaw",
    "t5",
    "alibi",
    "rope",
    "kerple_log",
    "kerple_power",
    "sandwich",
    "fire",
    "xpos",
    "cope",
)
PLUGIN_GROUP = "tpe_train.positions"  # entry points of the user's own encodings (tpe_train.config.plugins)
PORT_BASE, PORT_SPAN = 20000, 10000  # job ports: 20000 + job id % 10000, below the ephemeral range
LOCAL_PORT = 0  # outside Slurm: accelerate picks a free port


class LaunchError(ValueError):
    """Bad input to the launcher, with a message that says what to change."""


@dataclass(frozen=True)
class Resources:
    """What one job asks for: ``nodes`` x (``gpus_per_node`` GPUs or ``procs_per_node`` CPU processes)."""

    nodes: int = 1
    gpus_per_node: int = 0
    procs_per_node: int = 1
    cpus_per_node: int | None = None  # CPU cores per node to ask Slurm for (None: Slurm's default)

    @property
    def processes(self) -> int:
        return self.nodes * self.procs_per_node

    @property
    def on_cpu(self) -> bool:
        return self.gpus_per_node == 0

    @classmethod
    def build(
        cls,
        nodes: int = 1,
        gpus_per_node: int | None = None,
        procs_per_node: int | None = None,
        cpus_per_node: int | None = None,
    ) -> Resources:
        """Check the numbers and derive processes per node: one per GPU; on CPU nodes
        ``procs_per_node``, else one per CPU asked for, else one."""
        for name, value in (
            ("--nodes", nodes),
            ("--procs-per-node", procs_per_node),
            ("--cpus-per-node", cpus_per_node),
        ):
            if value is not None and value < 1:
                raise LaunchError(f"{name} must be at least 1 (got {value})")
        gpus = gpus_per_node or 0
        if gpus < 0:
            raise LaunchError(f"--gpus-per-node must be 0 (CPU nodes) or more (got {gpus})")
        if gpus:
            if procs_per_node not in (None, gpus):
                raise LaunchError(
                    f"--procs-per-node {procs_per_node} differs from --gpus-per-node {gpus}: on GPU nodes "
                    "the launcher starts one process per GPU; drop --procs-per-node"
                )
            procs = gpus
        else:
            procs = procs_per_node or cpus_per_node or 1
        if cpus_per_node is not None and not gpus and cpus_per_node < procs:
            raise LaunchError(
                f"--cpus-per-node {cpus_per_node} is fewer than the {procs} processes per node; "
                "ask for at least one CPU per process"
            )
        return cls(nodes, gpus, procs, cpus_per_node)


@dataclass(frozen=True)
class LaunchFile:
    """One launch file of ``configs/accelerate/``: the parallel layout that accelerate starts."""

    path: Path
    distributed_type: str
    use_cpu: bool
    deepspeed_file: Path | None  # absolute; None without DeepSpeed

    @property
    def name(self) -> str:
        return self.path.stem

    @property
    def deepspeed(self) -> bool:
        return self.distributed_type == "DEEPSPEED"

    @classmethod
    def load(cls, name: str) -> LaunchFile:
        """A launch file by name (``cpu_ddp``) or path; its DeepSpeed file made absolute."""
        path = Path(name)
        if not (path.suffix in (".yaml", ".yml") and path.is_file()):
            path = LAYOUT_DIR / f"{name}.yaml"
        if not path.is_file():
            names = ", ".join(sorted(p.stem for p in LAYOUT_DIR.glob("*.yaml")))
            raise LaunchError(
                f"layout {name!r} not found: it is neither a launch file nor one of {LAYOUT_DIR} "
                f"({names}); pass --layout with one of those names or a path"
            )
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise LaunchError(f"launch file {path} is not valid YAML ({err}); fix the file") from None
        ds = (data.get("deepspeed_config") or {}).get("deepspeed_config_file")
        ds_path = None
        if ds:
            ds_path = deepspeed_file(Path(ds), path)
        kind = data.get("distributed_type", "NO")
        kind = "NO" if kind is False else str(kind)  # YAML 1.1 reads a bare NO as false
        return cls(path.resolve(), kind, bool(data.get("use_cpu")), ds_path)

    @classmethod
    def default(cls, res: Resources) -> LaunchFile:
        """GPU nodes: ZeRO-1 (``gpu_zero1``), one plain process on a single GPU (``gpu_single``: ZeRO has
        nothing to partition there, and DeepSpeed's engine costs every step); CPU nodes: DDP over
        gloo, or one plain process."""
        if not res.on_cpu:
            return cls.load("gpu_zero1" if res.processes > 1 else "gpu_single")
        return cls.load("cpu_single" if res.processes == 1 else "cpu_ddp")

    def check(self, res: Resources) -> None:
        """Refuse a layout that cannot run on these resources."""
        if self.use_cpu and not res.on_cpu:
            raise LaunchError(
                f"layout {self.name} runs on CPUs (use_cpu: true) but {res.gpus_per_node} GPUs per node "
                "were given; pick a gpu_* layout, or --gpus-per-node 0 for CPU nodes"
            )
        if not self.use_cpu and res.on_cpu:
            raise LaunchError(
                f"layout {self.name} runs on GPUs but no GPUs were given; pass --gpus-per-node, or pick "
                "a cpu_* layout (cpu_ddp, cpu_zero2, ...) for CPU nodes"
            )
        if self.distributed_type == "NO" and res.processes > 1:
            raise LaunchError(
                f"layout {self.name} starts one process but {res.processes} were asked for "
                f"({res.nodes} nodes x {res.procs_per_node}); pick a distributed layout such as cpu_ddp"
            )
        if self.deepspeed_file is not None and not self.deepspeed_file.is_file():
            raise LaunchError(
                f"layout {self.name} names the DeepSpeed file {self.deepspeed_file}, which is missing"
            )


def deepspeed_file(name: Path, launch_file: Path) -> Path:
    """The absolute path of the DeepSpeed file a launch file names: as given when absolute, else relative
    to the launch file's folder, else (the repository's own launch files) to the repository root;
    never to the directory the launcher runs in. The command passes it on absolute."""
    if name.is_absolute():
        return name
    for base in (launch_file.resolve().parent, ROOT):
        if (base / name).is_file():
            return (base / name).resolve()
    return (launch_file.resolve().parent / name).resolve()  # missing: LaunchFile.check names this path


@dataclass(frozen=True)
class NodeEnv:
    """This node's place in the job: machine rank and count, main address and port, array index."""

    machine_rank: int = 0
    num_machines: int = 1
    main_ip: str = "127.0.0.1"
    port: int | str = LOCAL_PORT  # a string only in --dry-run renderings
    job_id: str | None = None
    array_index: int | None = None
    restart: int = 0

    @classmethod
    def from_env(cls, env: Mapping[str, str], hostnames: Callable[[str], list[str]] | None = None) -> NodeEnv:
        """From SLURM_* (inside an allocation) or a single local machine (outside)."""
        job = env.get("SLURM_JOB_ID")
        if not job:
            return cls()
        try:
            rank = int(env.get("SLURM_NODEID", "0"))
            count = int(env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES", "1")))
            restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
            array = env.get("SLURM_ARRAY_TASK_ID")
            array_index = int(array) if array not in (None, "") else None
        except ValueError as err:
            raise LaunchError(f"cannot read the Slurm environment ({err}); is this a Slurm job?") from None
        tasks = env.get("SLURM_STEP_NUM_TASKS")
        if tasks is not None and env.get("SLURM_STEP_ID") and int(tasks) != count:
            raise LaunchError(
                f"this job step runs {tasks} tasks on {count} nodes; tpe-launch run needs exactly one task "
                "per node (srun --ntasks-per-node=1), it starts the node's processes itself"
            )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise LaunchError("SLURM_JOB_ID is set but SLURM_JOB_NODELIST is not; run inside a Slurm job")
        main = first_host(nodelist, hostnames)
        return cls(rank, count, main, job_port(job), job, array_index, restart)


def job_port(job_id: str | int) -> int:
    """The main process's port, derived from the job id so that jobs sharing a node differ."""
    try:
        return PORT_BASE + int(str(job_id).split("_")[0]) % PORT_SPAN
    except ValueError:
        raise LaunchError(f"SLURM_JOB_ID {job_id!r} is not a number") from None


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``: the nodes of a Slurm host list, in order."""
    proc = subprocess.run(
        ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10
    )
    if proc.returncode != 0:
        raise LaunchError(f"scontrol show hostnames {nodelist} failed: {proc.stderr.strip()}")
    return proc.stdout.split()


def first_host(nodelist: str, hostnames: Callable[[str], list[str]] | None = None) -> str:
    """The first host of a Slurm host list (``gpu[07-10,12],cpu3`` -> ``gpu07``): by ``scontrol show
    hostnames`` where scontrol exists, else by reading the list's first entry here."""
    if hostnames is None and shutil.which("scontrol"):
        hostnames = scontrol_hostnames
    if hostnames is not None:
        try:
            hosts = hostnames(nodelist)
        except (LaunchError, subprocess.TimeoutExpired, OSError):
            hosts = []  # scontrol without a cluster configuration: read the list here
        if hosts:
            return hosts[0]
    m = re.match(r"([^,\[]*)(?:\[([0-9]+))?", nodelist.strip())
    if not m or not (m.group(1) or m.group(2)):
        raise LaunchError(f"cannot read the node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def position_sweep() -> tuple[str, ...]:
    """The default position sweep, array index -> kind: the built-ins in their fixed order, then the
    encodings of installed packages (``tpe_train.positions`` entry points) sorted by name. Read from the
    entry points' names, without importing them (their checks come with the config's)."""
    from importlib.metadata import entry_points

    plugins = {ep.name for ep in entry_points(group=PLUGIN_GROUP)} - set(POSITION_SWEEP)
    return POSITION_SWEEP + tuple(sorted(plugins))


def sweep_kinds(spec: str | None) -> tuple[str, ...]:
    """``--kinds a,b,c`` (the sweep's encodings, array index -> kind), or the default sweep."""
    if spec is None:
        return position_sweep()
    kinds = tuple(k.strip() for k in spec.split(","))
    if not all(kinds) or len(set(kinds)) != len(kinds):
        raise LaunchError(
            f"--kinds {spec!r}: give distinct encoding names separated by commas, e.g. rope,alibi"
        )
    return kinds


def sweep_kind(index: int | None, kinds: tuple[str, ...] | None = None) -> str:
    """The position encoding of array element ``index`` of the position sweep ``kinds`` (default: the
    default sweep)."""
    kinds = position_sweep() if kinds is None else kinds
    if index is None:
        raise LaunchError("--sweep positions needs SLURM_ARRAY_TASK_ID: submit it as a job array")
    if not 0 <= index < len(kinds):
        raise LaunchError(
            f"array index {index} is outside the position sweep 0-{len(kinds) - 1} ({' '.join(kinds)})"
        )
    return kinds[index]


def override_keys(overrides: list[str]) -> set[str]:
    return {item.partition("=")[0].strip() for item in overrides}


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one node needs to start its share of a run with ``accelerate launch``."""

    preset: str
    overrides: list[str]
    resources: Resources
    layout: LaunchFile
    node: NodeEnv = field(default_factory=NodeEnv)
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)

    def __post_init__(self) -> None:
        self.layout.check(self.resources)
        if self.node.num_machines != self.resources.nodes:
            raise LaunchError(
                f"the job has {self.node.num_machines} nodes (SLURM_NNODES) but the launch was planned for "
                f"{self.resources.nodes}; pass --nodes {self.node.num_machines} (or let sbatch --nodes match)"
            )
        if not 0 <= self.node.machine_rank < self.node.num_machines:
            raise LaunchError(
                f"machine rank {self.node.machine_rank} (SLURM_NODEID) is outside "
                f"0-{self.node.num_machines - 1}"
            )

    def accelerate(self) -> list[str]:
        """``accelerate launch`` of the interpreter that runs the launcher (or from PATH)."""
        exe = self.bin_dir / "accelerate"
        return [str(exe) if exe.exists() else "accelerate", "launch"]

    def command(self) -> list[str]:
        """The argv that this node execs."""
        res, node = self.resources, self.node
        cmd = [
            *self.accelerate(),
            "--config_file",
            str(self.layout.path),
            "--num_machines",
            str(node.num_machines),
            "--machine_rank",
            str(node.machine_rank),
            "--main_process_ip",
            node.main_ip,
            "--main_process_port",
            str(node.port),
            "--num_processes",
            str(res.processes),
        ]
        if res.on_cpu and res.cpus_per_node:
            # accelerate would otherwise guess (and say so); the trainer's train.threads still applies
            cmd += ["--num_cpu_threads_per_process", str(max(1, res.cpus_per_node // res.procs_per_node))]
        if self.layout.deepspeed_file is not None:
            # absolute, so that the job may run from any directory
            cmd += ["--deepspeed_config_file", str(self.layout.deepspeed_file)]
        if self.layout.deepspeed and node.num_machines > 1:
            # accelerate's default multi-node DeepSpeed launcher is pdsh over ssh; inside Slurm every
            # node runs its own launcher, as torchrun does
            cmd += ["--deepspeed_multinode_launcher", "standard"]
        return [*cmd, "-m", "tpe_train.train", "--preset", self.preset, *self.overrides]

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment additions for the launch: DeepSpeed on CPU needs ``DS_ACCELERATOR=cpu``."""
        extra: dict[str, str] = {"PYTHONUNBUFFERED": "1"}
        if self.resources.on_cpu:
            extra["DS_ACCELERATOR"] = "cpu"
        return {**(dict(base) if base is not None else {}), **extra}

    def describe(self) -> str:
        res, node = self.resources, self.node
        return (
            f"node {node.machine_rank} of {node.num_machines} | {res.procs_per_node} "
            f"{'CPU' if res.on_cpu else 'GPU'} processes here, {res.processes} in all | layout "
            f"{self.layout.name} | main {node.main_ip}:{node.port if node.port else '<a free port>'}"
            + (f" | restart {node.restart}" if node.restart else "")
        )


def sweep_overrides(overrides: list[str], kind: str, root: str | os.PathLike[str]) -> list[str]:
    """The overrides of one element of the position sweep: its encoding and its own run directory."""
    clash = override_keys(overrides) & {"model.position.kind", "train.run_dir"}
    if clash:
        raise LaunchError(
            f"the position sweep sets {', '.join(sorted(clash))} itself (one encoding and run directory per "
            "array element); drop it from the overrides and pick the sweep's root with --sweep-root"
        )
    return [*overrides, f"model.position.kind={kind}", f"train.run_dir={Path(root) / kind}"]


def batch_line(preset: str, overrides: list[str], processes: int, layout: LaunchFile) -> str:
    """What one optimizer step of this launch trains (``train.batch_tokens`` resolved for these
    processes), as the trainer prints it at start; a comment line for ``--dry-run``. The mean target
    tokens of a micro-batch are counted in the token store when it is prepared, else estimated."""
    from tpe_train.config import ConfigError, load_config  # imports torch: only for --dry-run
    from tpe_train.data.batching import length_arrays
    from tpe_train.data.specs import store_path
    from tpe_train.data.store_open import load_store
    from tpe_train.parallel.batch import estimated_micro_tokens, micro_tokens, resolve
    from tpe_train.parallel.deepspeed import autotp_size

    try:
        cfg = load_config(preset, overrides)
    except ConfigError as err:
        raise LaunchError(str(err)) from None
    template = json.loads(layout.deepspeed_file.read_text()) if layout.deepspeed_file else None
    tp = cfg.parallel.tp_size or autotp_size(template) or 1
    if processes % tp:
        raise LaunchError(f"{processes} processes do not split into tensor-parallel groups of {tp}")
    dp, max_tokens = processes // tp, cfg.data.max_tokens
    if max_tokens == 0:
        return (
            f"# batch: data.max_tokens=auto is probed on the GPUs at start; {dp} data-parallel ranks, "
            f"accumulation for train.batch_tokens={cfg.train.batch_tokens:,} derived then"
        )
    stored = None if cfg.data.streaming else load_store(store_path(cfg.data))
    if stored is not None:
        src_len, tgt_len = length_arrays(stored[1])
        micro, source = (
            micro_tokens(src_len, tgt_len, max_tokens, cfg.train.seed),
            "counted in the token store",
        )
    else:
        micro, source = estimated_micro_tokens(max_tokens), "estimated: token store not prepared yet"
    plan = resolve(cfg.train.batch_tokens, max_tokens, micro, dp, cfg.train.accumulate, source)
    return "\n".join(f"# {line}" for line in (plan.line(), plan.warning()) if line)
