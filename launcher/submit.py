"""``tpe-launch submit``: render a template of ``slurm/`` for a preset and resources, then ``sbatch`` it.

The templates hold resources and environment only; every decision is made here, before submission:
the preset and overrides are validated (the same ``load_config`` the trainer uses), the run
directory is resolved, the layout is checked against the resources, the time limit against the
preemption signal. ``--dry-run`` prints the script, and what ``tpe-launch run`` will exec on each
node, instead of submitting.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from launcher.plan import (
    ROOT,
    LaunchError,
    LaunchFile,
    LaunchPlan,
    NodeEnv,
    Resources,
    batch_line,
    override_keys,
    sweep_kinds,
    sweep_overrides,
)
from launcher.sbatch import SiteOptions, check_name, option_line, sbatch_value
from tpe_train.ckpt.rundir import RunDir

TEMPLATE_DIR = ROOT / "slurm"
SCRIPTS = ("train", "sweep_positions", "eval")
PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?")


def time_seconds(value: str) -> int:
    """Seconds of a Slurm time limit: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = TIME.fullmatch(value.strip())
    if not m:
        raise LaunchError(
            f"--time {value!r} is not a Slurm time limit; use minutes, MM:SS, HH:MM:SS or D-HH:MM:SS"
        )
    days, a, b, c = (int(g) if g is not None else None for g in m.groups())
    assert a is not None
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + (b or 0) * 60 + c
    if b is not None:
        return a * 60 + b
    return a * 60


def array_indices(spec: str) -> list[int]:
    """The indices of a Slurm ``--array`` spec (``0-6``, ``1,4-6``, ``0-6:2``, ``0-6%2``)."""
    body, throttle, limit = spec.partition("%")
    if throttle and not limit.isdigit():
        raise LaunchError(f"--array {spec!r}: the limit after % must be a number, as in 0-6%2")
    out: list[int] = []
    for part in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+)(?::(\d+))?)?", part)
        if not m:
            raise LaunchError(f"--array {spec!r} is not an array spec such as 0-6, 1,4-6 or 0-6%2")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        out += range(lo, hi + 1, int(m.group(3) or 1))
    return out


def render(template: str, values: dict[str, str]) -> str:
    """Fill ``{{name}}`` placeholders; a line whose placeholders all render empty is dropped. Values are
    quoted by the caller (``sbatch.sbatch_value`` in ``#SBATCH`` lines, ``shlex.quote`` in the shell's);
    a value with a control character in a comment or ``#SBATCH`` line is refused."""
    missing = set(PLACEHOLDER.findall(template)) - set(values)
    if missing:
        raise LaunchError(f"template placeholders without a value: {', '.join(sorted(missing))}")
    lines = []
    for line in template.splitlines():
        if line.startswith("#"):  # a comment or #SBATCH line: no value may end it
            for name in PLACEHOLDER.findall(line):
                sbatch_value(f"the value of {{{{{name}}}}}", values[name])
        out = PLACEHOLDER.sub(lambda m: values[m.group(1)], line)
        if PLACEHOLDER.search(line) and not out.strip():
            continue
        lines.append(out)
    return "\n".join(lines) + "\n"


@dataclass
class Submission:
    """One ``tpe-launch submit``: the script, and what to tell the user once sbatch accepted it."""

    script: str  # train | sweep_positions | eval
    text: str  # the rendered batch script
    log: str  # --output pattern (absolute)
    run_dirs: dict[str, Path] = field(default_factory=dict)  # label -> run directory
    node_commands: list[str] = field(default_factory=list)  # per node, for --dry-run
    batch: str = ""  # what one step trains (``plan.batch_line``), for --dry-run
    tensorboard: Path | None = None


@dataclass
class SubmitArgs:
    """The options of ``tpe-launch submit`` (see ``launcher/cli.py`` for their help)."""

    preset: str
    overrides: list[str]
    nodes: int = 1
    gpus_per_node: int | None = None
    procs_per_node: int | None = None
    cpus_per_node: int | None = None
    layout: str | None = None
    script: str = "train"
    partition: str | None = None
    account: str | None = None
    time: str | None = None
    array: str | None = None
    kinds: str | None = None  # sweep_positions: a,b,c (default: plan.position_sweep())
    dependency: str | None = None
    job_name: str | None = None
    signal_before: int = 300
    last: int = 5
    out: str | None = None
    sweep_root: str | None = None
    qos: str | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool | None = None
    mail_type: str | None = None
    mail_user: str | None = None
    cpus_per_gpu: int | None = None
    setup: str | None = None
    sbatch: list[str] = field(default_factory=list)
    workdir: Path = field(default_factory=Path.cwd)

    def site(self) -> SiteOptions:
        """The options of these arguments that a site file may also set."""
        names = [f.name for f in dataclasses.fields(SiteOptions)]
        return SiteOptions(**{n: getattr(self, n) for n in names})

    def with_site(self, site: SiteOptions) -> SubmitArgs:
        """These arguments over the site file's: each option given here wins."""
        merged = self.site().merged_over(site)
        return dataclasses.replace(self, **dataclasses.asdict(merged))


def _config_run_dir(preset: str, overrides: list[str]) -> tuple[Path, str, int]:
    """Validate preset + overrides as the trainer will; (run dir, preset name, seed)."""
    from tpe_train.config import ConfigError, load_config  # imports torch: only when submitting

    try:
        cfg = load_config(preset, overrides)
    except ConfigError as err:
        raise LaunchError(str(err)) from None
    return cfg.run_dir(), check_name("preset name", cfg.preset), cfg.train.seed


def _validate_sweep_kinds(preset: str, overrides: list[str], kinds: list[str], chosen: bool) -> None:
    from tpe_train.config import ConfigError, load_config

    for kind in kinds:
        try:
            load_config(preset, [*overrides, f"model.position.kind={kind}"])
        except ConfigError as err:
            hint = "" if chosen else " (or choose the encodings the sweep runs with --kinds a,b,c)"
            raise LaunchError(f"sweep element {kind}: {err}{hint}") from None


def _cpus_per_task(args: SubmitArgs, res: Resources) -> int | None:
    """CPUs of the one task per node when asked for by number: --cpus-per-node, or on CPU nodes one per
    process; None on GPU nodes otherwise (they ask for --cpus-per-gpu)."""
    if res.cpus_per_node is not None:
        if not res.on_cpu and args.cpus_per_gpu is not None:
            raise LaunchError(
                "--cpus-per-node and --cpus-per-gpu both ask for the CPUs of a GPU node; give one of them"
            )
        return res.cpus_per_node
    return res.procs_per_node if res.on_cpu and res.procs_per_node > 1 else None


def _resource_lines(args: SubmitArgs, res: Resources) -> list[str]:
    lines = [] if res.on_cpu else [option_line("gpus-per-node", str(res.gpus_per_node))]
    if args.cpus_per_gpu is not None and args.cpus_per_gpu < 0:
        raise LaunchError(f"--cpus-per-gpu must be 0 (ask for none) or more (got {args.cpus_per_gpu})")
    return lines + args.site().cpu_lines(res.gpus_per_node, _cpus_per_task(args, res))


def _environment(args: SubmitArgs, res: Resources) -> list[str]:
    lines = ["export DS_ACCELERATOR=cpu  # DeepSpeed on CPU nodes (gloo)"] if res.on_cpu else []
    cpus = _cpus_per_task(args, res)
    if cpus is not None:  # srun does not pass sbatch's --cpus-per-task on to the step (Slurm 22.05+)
        lines.append(f"export SRUN_CPUS_PER_TASK={cpus}")
    return lines


def build(args: SubmitArgs) -> Submission:
    """Check everything and render the script (nothing is submitted)."""
    if args.script not in SCRIPTS:
        raise LaunchError(f"--script {args.script!r} is not one of {', '.join(SCRIPTS)}")
    res = Resources.build(args.nodes, args.gpus_per_node, args.procs_per_node, args.cpus_per_node)
    if args.signal_before < 1:
        raise LaunchError(f"--signal-before must be at least 1 second (got {args.signal_before})")
    if args.time is not None:
        limit = time_seconds(args.time)
        if args.script != "eval" and args.signal_before >= limit:
            raise LaunchError(
                f"--signal-before {args.signal_before} s is not shorter than --time {args.time} "
                f"({limit} s): the preemption signal would come before any work; raise --time or "
                "lower --signal-before"
            )
    if args.array is not None and args.script != "sweep_positions":
        raise LaunchError(
            "--array applies to --script sweep_positions (its index picks the position encoding); "
            "a plain training job is one run"
        )
    if args.kinds is not None and args.script != "sweep_positions":
        raise LaunchError("--kinds applies to --script sweep_positions (the encodings it sweeps)")
    workdir = args.workdir.resolve()
    bin_dir = Path(sys.executable).parent
    values = {
        "nodes": str(res.nodes),
        "resources": "\n".join(_resource_lines(args, res)),
        "workdir": sbatch_value("the working directory", str(workdir)),
        "bin": shlex.quote(str(bin_dir)),
        "signal_before": str(args.signal_before),
        "setup": args.site().setup_text(workdir),
        "environment": "\n".join(_environment(args, res)),
    }
    options = [option_line("time", args.time.strip())] if args.time else []
    if args.dependency:
        options.append(option_line("dependency", args.dependency))
    values["options"] = "\n".join(options + args.site().lines())
    if args.script == "eval":
        return _build_eval(args, res, values, workdir)

    layout = LaunchFile.load(args.layout) if args.layout else LaunchFile.default(res)
    layout.check(res)
    run_flags = ["--preset", args.preset, "--nodes", str(res.nodes), "--layout", str(layout.path)]
    run_flags += ["--gpus-per-node", str(res.gpus_per_node), "--procs-per-node", str(res.procs_per_node)]
    sub = Submission(args.script, "", "")
    overrides = list(args.overrides)
    if args.script == "train":
        run_dir, preset_name, _ = _config_run_dir(args.preset, overrides)
        run_dir = workdir / run_dir
        sub.run_dirs["run dir"] = run_dir
        sub.log = str(RunDir(run_dir).slurm_log("%j"))
        sub.tensorboard = RunDir(run_dir).tensorboard
        values["status_dir"] = shlex.quote(str(run_dir))  # shared by the nodes: their status records
        name = args.job_name or f"tpe-{preset_name}"
        node_overrides = overrides
    else:
        sweep = sweep_kinds(args.kinds)
        indices = array_indices(args.array or f"0-{len(sweep) - 1}")
        bad = [i for i in indices if not 0 <= i < len(sweep)]
        if bad:
            raise LaunchError(
                f"--array {args.array} names index {bad[0]}, outside the position sweep "
                f"0-{len(sweep) - 1} ({' '.join(sweep)})"
            )
        clash = override_keys(overrides) & {"model.position.kind"}
        if clash:
            raise LaunchError(
                "the position sweep sets model.position.kind itself; drop it from the overrides"
            )
        kinds = [sweep[i] for i in indices]
        _validate_sweep_kinds(args.preset, overrides, list(sweep) if args.kinds else kinds, bool(args.kinds))
        _, preset_name, seed = _config_run_dir(args.preset, overrides)
        rd = [o.partition("=")[2] for o in overrides if o.partition("=")[0].strip() == "train.run_dir"]
        root = Path(args.sweep_root or (rd[-1] if rd else f"runs/{preset_name}-positions-s{seed}"))
        overrides = [o for o in overrides if o.partition("=")[0].strip() != "train.run_dir"]
        root = workdir / root
        for i, kind in zip(indices, kinds, strict=True):
            sub.run_dirs[f"run dir [{i}] {kind}"] = root / kind
        sub.log = str(root / "slurm-%A_%a.out")
        sub.tensorboard = root
        values["array"] = sbatch_value("--array", args.array or f"0-{len(sweep) - 1}")
        values["kinds"] = " ".join(f"{i} {kind}" for i, kind in enumerate(sweep))
        run_flags += ["--kinds", ",".join(sweep)]  # the job maps its index as submitted
        values["sweep_root"] = values["status_dir"] = shlex.quote(str(root))
        name = args.job_name or f"tpe-sweep-{preset_name}"
        node_overrides = sweep_overrides(overrides, "<kind>", root)
    run_flags += ["--", *overrides]
    values.update(job_name=check_name("job name", name), log=sbatch_value("the log", sub.log))
    values["run_args"] = shlex.join(run_flags)
    sub.text = render((TEMPLATE_DIR / f"{args.script}.sbatch").read_text(), values)
    for rank in range(res.nodes):
        node = NodeEnv(
            rank, res.nodes, "<first host of SLURM_JOB_NODELIST>", "<20000 + SLURM_JOB_ID % 10000>"
        )
        plan = LaunchPlan(args.preset, node_overrides, res, layout, node, bin_dir)
        sub.node_commands.append(shlex.join(plan.command()))
    sub.batch = batch_line(args.preset, overrides, res.processes, layout)
    return sub


def _build_eval(args: SubmitArgs, res: Resources, values: dict[str, str], workdir: Path) -> Submission:
    if res.nodes != 1:
        raise LaunchError(f"evaluation runs on one node; drop --nodes {res.nodes}")
    if args.last < 1:
        raise LaunchError(f"--last must be at least 1 (got {args.last})")
    run_dir, preset_name, _ = _config_run_dir(args.preset, list(args.overrides))
    run_dir = workdir / run_dir
    out = workdir / args.out if args.out else RunDir(run_dir).averaged(args.last)
    sub = Submission(
        "eval", "", str(RunDir(run_dir).slurm_log("eval-%j")), {"run dir": run_dir, "averaged": out}
    )
    values.update(
        job_name=check_name("job name", args.job_name or f"tpe-eval-{preset_name}"),
        log=sbatch_value("the log", sub.log),
        run_dir=shlex.quote(str(run_dir)),
        out=shlex.quote(str(out)),
        last=str(args.last),
    )
    sub.text = render((TEMPLATE_DIR / "eval.sbatch").read_text(), values)
    return sub


def dry_run_text(sub: Submission) -> str:
    """The script, then (as comments) what each node's ``tpe-launch run`` will exec."""
    lines = [sub.text.rstrip("\n"), "", "# --- tpe-launch submit --dry-run: not submitted."]
    lines.append(f"# log: {sub.log}")
    if sub.batch:
        lines.append(sub.batch)
    for label, path in sub.run_dirs.items():
        lines.append(f"# {label}: {path}")
    if sub.node_commands:
        lines.append("# On each node (SLURM_NODEID = machine rank), `tpe-launch run` execs:")
        shown = sub.node_commands if len(sub.node_commands) <= 8 else sub.node_commands[:4]
        for rank, cmd in enumerate(shown):
            lines.append(f"#   node {rank}: {cmd}")
        if len(shown) < len(sub.node_commands):
            lines.append(f"#   ... nodes 4-{len(sub.node_commands) - 1} alike, with their own --machine_rank")
    # a value with a newline (an override) stays inside the comment: nothing after the script can run
    notes = "\n".join(lines[1:]).replace("\r", "\n").splitlines()
    notes = [line if not line or line.startswith("#") else f"#   {line}" for line in notes]
    return "\n".join([lines[0], *notes]) + "\n"


def submit(sub: Submission, env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable`` the script (on stdin); the job id."""
    if shutil.which("sbatch") is None:
        raise LaunchError("sbatch not found: submit from a Slurm login node, or look with --dry-run")
    Path(sub.log).parent.mkdir(parents=True, exist_ok=True)  # Slurm does not create it: no log at all
    proc = subprocess.run(["sbatch", "--parsable"], input=sub.text, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise LaunchError(f"sbatch refused the job: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout.strip().split(";")[0]


def report(sub: Submission, job: str) -> str:
    """What to tell the user after submission: job id, log path, run directories."""
    lines = [f"job: {job}"]
    log = sub.log.replace("%j", job).replace("%A", job)
    lines.append(f"log: {log.replace('%a', '<index>')}")
    for label, path in sub.run_dirs.items():
        lines.append(f"{label}: {path}")
    if sub.tensorboard is not None:
        lines.append(f"tensorboard: tensorboard --logdir {sub.tensorboard}")
    return "\n".join(lines)
