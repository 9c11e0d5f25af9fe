"""``tpe-launch``: one launch layer for a workstation and for Slurm.

    tpe-launch submit --preset P --nodes N --gpus-per-node G [options] [overrides]  # sbatch a template
    tpe-launch run --preset P [options] [overrides]   # per node: accelerate launch ... -m tpe_train.train
    tpe-launch supervise --status-dir DIR -- srun ...  # the batch step: preemption signal and requeue

Bad input (an unknown preset or layout, nodes < 1, an invalid override, ...) stops with one
paragraph on stderr and exit code 2, before anything is submitted or started.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import NoReturn

from launcher.plan import (
    LaunchError,
    LaunchFile,
    LaunchPlan,
    NodeEnv,
    Resources,
    batch_line,
    sweep_kind,
    sweep_kinds,
    sweep_overrides,
)
from launcher.sbatch import CONFIG_ENV, DEFAULT_CPUS_PER_GPU, load_site
from launcher.submit import SCRIPTS, SubmitArgs, build, dry_run_text, report, submit
from launcher.supervise import run_node, supervise_job
from tpe_train.run import logs

log = logging.getLogger(__name__)

USAGE = __doc__.split("\n\n")[1]


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (see ``main``), not a usage block."""

    def error(self, message: str) -> NoReturn:
        raise LaunchError(f"{message} (see {self.prog} --help)")


def _resource_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="demo", help="preset name in configs/presets or a YAML path")
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node, one process each (0: CPU nodes)"
    )
    parser.add_argument(
        "--procs-per-node",
        type=int,
        default=None,
        help="CPU nodes: processes per node (default: --cpus-per-node, else 1)",
    )
    parser.add_argument("--cpus-per-node", type=int, default=None, help="CPU cores per node to ask for")
    parser.add_argument(
        "--layout",
        default=None,
        help="launch file of configs/accelerate (name or path); default gpu_zero1 on GPUs, "
        "cpu_ddp (cpu_single for one process) on CPUs",
    )
    parser.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. train.max_steps=200")


def submit_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tpe-launch submit",
        description="Render a template of slurm/ for a preset and resources and submit it with sbatch; "
        "prints the job id, the log path and the run directory.",
    )
    p.add_argument("--nodes", type=int, default=1, help="nodes (one launcher task each)")
    _resource_args(p)
    p.add_argument("--script", default="train", choices=SCRIPTS, help="which template of slurm/")
    p.add_argument("--partition", default=None)
    p.add_argument("--account", default=None)
    p.add_argument("--time", default=None, help="time limit (minutes, HH:MM:SS, D-HH:MM:SS)")
    p.add_argument(
        "--kinds",
        default=None,
        help="sweep_positions: the encodings swept, array index -> kind, e.g. rope,alibi,mine (default: the "
        "built-ins, then installed packages' encodings sorted by name)",
    )
    p.add_argument("--array", default=None, help="sweep_positions: array indices (default: every kind)")
    p.add_argument("--dependency", default=None, help="sbatch --dependency, e.g. afterok:1234")
    p.add_argument("--job-name", default=None)
    p.add_argument(
        "--signal-before",
        type=int,
        default=300,
        help="seconds before the time limit at which the trainers checkpoint and the job requeues",
    )
    p.add_argument("--sweep-root", default=None, help="sweep_positions: parent of the per-kind run dirs")
    p.add_argument("--last", type=int, default=5, help="eval: average the last N checkpoints")
    p.add_argument("--out", default=None, help="eval: directory of the averaged export")
    _site_args(p)
    p.add_argument("--dry-run", action="store_true", help="print the script instead of submitting it")
    return p


def _site_args(p: argparse.ArgumentParser) -> None:
    """Options a cluster may ask of every job; each may also be set once in the site file."""
    g = p.add_argument_group(
        "site options",
        f"each also settable in the site file (${CONFIG_ENV}, else "
        "${XDG_CONFIG_HOME:-~/.config}/tpe-train/slurm.yaml; keys as these flags without --); a flag wins",
    )
    g.add_argument(
        "--cpus-per-gpu",
        type=int,
        default=None,
        help=f"GPU nodes: CPUs per GPU to ask for (default {DEFAULT_CPUS_PER_GPU}; 0: the site's default)",
    )
    g.add_argument("--qos", default=None, help="quality of service")
    g.add_argument("--mem", default=None, help="memory per node, e.g. 64G (0: all of it)")
    g.add_argument("--constraint", default=None, help="node features, e.g. a100|h100")
    g.add_argument(
        "--exclusive",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="whole nodes, shared with no job",
    )
    g.add_argument("--mail-type", default=None, help="e.g. END,FAIL")
    g.add_argument("--mail-user", default=None)
    g.add_argument(
        "--setup", default=None, help="file of shell lines run in the job before the launch (module load ...)"
    )
    g.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="OPTION=VALUE",
        help="any other sbatch option, one each (e.g. --sbatch reservation=mine --sbatch hold)",
    )


def submit_args(ns: argparse.Namespace, env: Mapping[str, str] | None = None) -> SubmitArgs:
    """``tpe-launch submit``'s options over the user's site file."""
    args = SubmitArgs(**{k: v for k, v in vars(ns).items() if k != "dry_run"})
    if args.cpus_per_gpu is not None and not args.gpus_per_node:
        raise LaunchError(
            "--cpus-per-gpu applies to GPU nodes; on CPU nodes ask for CPUs with --cpus-per-node"
        )
    return args.with_site(load_site(os.environ if env is None else env))


def run_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="tpe-launch run",
        description="Start this node's share of a run: accelerate launch with machine rank, machine count, "
        "main address and port from SLURM_* (one machine, 127.0.0.1, outside Slurm).",
    )
    p.add_argument("--nodes", type=int, default=None, help="nodes of the run (default: SLURM_NNODES)")
    _resource_args(p)
    p.add_argument("--sweep", choices=["positions"], default=None, help="pick the encoding by array index")
    p.add_argument("--sweep-root", default=None, help="parent of the sweep's per-kind run directories")
    p.add_argument("--kinds", default=None, help="the sweep's encodings, array index -> kind (a,b,c)")
    p.add_argument("--port", type=int, default=None, help="main process port (default: from the job id)")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    return p


def gpus_from_env(env: Mapping[str, str]) -> int:
    """GPUs on this node: SLURM_GPUS_ON_NODE, else the CUDA_VISIBLE_DEVICES list, else none."""
    if env.get("SLURM_GPUS_ON_NODE", "").isdigit():
        return int(env["SLURM_GPUS_ON_NODE"])
    visible = env.get("CUDA_VISIBLE_DEVICES", "").strip()
    return len([d for d in visible.split(",") if d.strip()]) if visible else 0


def plan_from_args(args: argparse.Namespace, env: Mapping[str, str]) -> LaunchPlan:
    """The launch of this node from ``tpe-launch run``'s options and the environment."""
    node = NodeEnv.from_env(env)
    if args.port is not None:
        node = NodeEnv(node.machine_rank, node.num_machines, node.main_ip, args.port, node.job_id,
                       node.array_index, node.restart)  # fmt: skip
    gpus = args.gpus_per_node if args.gpus_per_node is not None else gpus_from_env(env)
    nodes = args.nodes if args.nodes is not None else node.num_machines
    cpus = args.cpus_per_node
    if cpus is None and not gpus and env.get("SLURM_CPUS_ON_NODE", "").isdigit():
        cpus = int(env["SLURM_CPUS_ON_NODE"])
    res = Resources.build(nodes, gpus, args.procs_per_node, cpus)
    layout = LaunchFile.load(args.layout) if args.layout else LaunchFile.default(res)
    overrides = list(args.overrides)
    if args.sweep == "positions":
        if not args.sweep_root:
            raise LaunchError("--sweep positions needs --sweep-root (the parent of the per-kind run dirs)")
        overrides = sweep_overrides(
            overrides, sweep_kind(node.array_index, sweep_kinds(args.kinds)), args.sweep_root
        )
    return LaunchPlan(args.preset, overrides, res, layout, node)


def cmd_run(argv: list[str]) -> int:
    args = run_parser().parse_intermixed_args(argv)
    plan = plan_from_args(args, os.environ)
    env = plan.env(os.environ)
    if args.dry_run:
        print(f"# {plan.describe()}")
        print(batch_line(plan.preset, plan.overrides, plan.resources.processes, plan.layout))
        extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
        print(shlex.join([f"{k}={v}" for k, v in sorted(extra.items())] + plan.command()))
        return 0
    log.info("%s", plan.describe())
    log.info("%s", shlex.join(plan.command()))
    return run_node(plan.command(), env, ranks=plan.resources.procs_per_node)


def cmd_submit(argv: list[str]) -> int:
    ns = submit_parser().parse_intermixed_args(argv)
    sub = build(submit_args(ns))
    if ns.dry_run:
        print(dry_run_text(sub), end="")
        return 0
    print(report(sub, submit(sub)))
    return 0


def cmd_supervise(argv: list[str]) -> int:
    status = None
    if argv[:1] == ["--status-dir"] and len(argv) > 1:
        status, argv = Path(argv[1]), argv[2:]
    cmd = argv[1:] if argv[:1] == ["--"] else argv
    if not cmd:
        raise LaunchError(
            "tpe-launch supervise needs the command to run after --, e.g. "
            "tpe-launch supervise --status-dir RUN_DIR -- srun tpe-launch run ..."
        )
    return supervise_job(cmd, os.environ, status)


COMMANDS = {"submit": cmd_submit, "run": cmd_run, "supervise": cmd_supervise}


def configure_logging(command: str = "") -> None:
    """``tpe-launch``'s console: its messages on stderr (stdout carries the dry run's command), as one
    launcher per node, not a rank (``SLURM_PROCID`` is the node's)."""
    logs.configure(f"tpe-launch {command}".strip(), rank=0, info_stream="stderr")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``tpe-launch``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage:\n{USAGE}\n\nEach command takes --help.")
        return 0 if argv else 2
    command = COMMANDS.get(argv[0])
    if command is None:
        log.error("unknown command %r; use one of %s (tpe-launch --help)", argv[0], ", ".join(COMMANDS))
        return 2
    try:
        return command(argv[1:])
    except LaunchError as err:
        configure_logging(argv[0])  # the error names the command
        log.error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
