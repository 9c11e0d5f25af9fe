"""The ``#SBATCH`` block of a job script: values that cannot leave their line, and a site's own options.

sbatch reads ``#SBATCH`` lines up to the first line that is neither blank nor a comment, and splits each
into words its own way: whitespace separates words, ``'...'`` and ``"..."`` group, a backslash takes the
next character as it is (inside quotes too), an unquoted ``#`` ends the line. So a value that holds a
newline or another control character cannot be written into that block at all (refused, naming it), and
any other value is written bare when it holds only ``[A-Za-z0-9@%+=:,./_-]``, else in double quotes with
``\\`` and ``"`` escaped. Names (job, preset) are letters, digits and ``._-`` only.

``SiteOptions`` are the options a cluster asks of every job (partition, account, QOS, memory, CPUs per
GPU, a set-up file, any other sbatch option): from the user's site file (``$TPE_SLURM_CONFIG``, else
``${XDG_CONFIG_HOME:-~/.config}/tpe-train/slurm.yaml``), each overridden by its command-line flag.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launcher.plan import LaunchError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
BARE = re.compile(r"[A-Za-z0-9@%+=:,./_-]+")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
OPTION = re.compile(r"[a-z][a-z-]*")
MEM = re.compile(r"\d+[KMGT]?")
MAIL_TYPES = {"NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT", "TIME_LIMIT",
              "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS"}  # fmt: skip
DEFAULT_CPUS_PER_GPU = 8  # a rank's training loop, its batching and its communication threads; see docs
CONFIG_ENV = "TPE_SLURM_CONFIG"

#: sbatch options that the launcher writes itself, or that have their own flag: ``--sbatch`` refuses them
#: (and any prefix of them, which sbatch would take as the same option), naming what to use instead.
OWNED = {
    "nodes": "--nodes",
    "ntasks": "the launcher (one task per node)",
    "ntasks-per-node": "the launcher (one task per node)",
    "gpus": "--gpus-per-node",
    "gpus-per-node": "--gpus-per-node",
    "gpus-per-task": "--gpus-per-node",
    "cpus-per-task": "--cpus-per-node (CPU nodes) or --cpus-per-gpu",
    "cpus-per-gpu": "--cpus-per-gpu",
    "output": "the launcher (the log goes to the run directory)",
    "open-mode": "the launcher (a requeued run appends to its log)",
    "chdir": "the launcher (the directory tpe-launch submit runs in)",
    "signal": "--signal-before",
    "requeue": "the launcher (preemption requeues)",
    "no-requeue": "the launcher (preemption requeues)",
    "array": "--array",
    "job-name": "--job-name",
    "time": "--time",
    "partition": "--partition",
    "account": "--account",
    "dependency": "--dependency",
    "qos": "--qos",
    "mem": "--mem",
    "constraint": "--constraint",
    "exclusive": "--exclusive",
    "mail-type": "--mail-type",
    "mail-user": "--mail-user",
    "wrap": "nothing (the launcher writes the script)",
    "parsable": "nothing (the launcher reads the job id)",
    "test-only": "nothing (use --dry-run)",
    "wait": "nothing (tpe-launch submit returns once sbatch accepts the job)",
}


def check_name(what: str, value: str) -> str:
    """A job or preset name: letters, digits and ``._-``, starting with a letter or digit."""
    if not NAME.fullmatch(value):
        raise LaunchError(
            f"{what} {value!r} may hold only letters, digits and '._-' (starting with a letter or digit): "
            "it names the job and its run directory, and goes into the job script; choose such a name"
        )
    return value


def sbatch_value(what: str, value: str) -> str:
    """``value`` as one word of an ``#SBATCH`` line (bare, or double-quoted); refused with a control
    character, which no ``#SBATCH`` line can hold."""
    bad = CONTROL.search(value)
    if bad:
        raise LaunchError(
            f"{what} {value!r} holds the control character {bad.group()!r} (a newline, tab, ...), which "
            "an #SBATCH line cannot hold: sbatch would stop reading its options there; remove it"
        )
    if BARE.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def line_value(what: str, value: str) -> str:
    """``value`` for a comment line of the script: any text but a control character."""
    sbatch_value(what, value)
    return value


def sbatch_words(line: str) -> list[str]:
    """The words of one ``#SBATCH`` line (without ``#SBATCH``) as sbatch splits them."""
    words: list[str] = []
    word: list[str] | None = None
    quote, i = "", 0
    while i < len(line):
        c = line[i]
        if c == "\\" and i + 1 < len(line):
            word = (word or []) + [line[i + 1]]
            i += 2
            continue
        if quote:
            if c == quote:
                quote = ""
            else:
                word = (word or []) + [c]
        elif c in "'\"":
            quote, word = c, word or []
        elif c == "#":
            break
        elif c.isspace():
            if word is not None:
                words.append("".join(word))
            word = None
        else:
            word = (word or []) + [c]
        i += 1
    if word is not None:
        words.append("".join(word))
    return words


def sbatch_block(script: str) -> list[str]:
    """The options sbatch reads from a script: the words of its ``#SBATCH`` lines before the first line
    that is neither blank nor a comment."""
    out: list[str] = []
    for line in script.splitlines()[1:]:  # the first line is the interpreter's
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            break
        if line.startswith("#SBATCH"):
            out += sbatch_words(line[len("#SBATCH") :])
    return out


def extra_option(spec: str) -> tuple[str, str | None]:
    """One ``--sbatch OPTION=VALUE`` (or ``OPTION`` for a switch): the option's name and its value."""
    name, eq, value = spec.partition("=")
    name = name.strip().removeprefix("--")
    if not OPTION.fullmatch(name):
        raise LaunchError(
            f"--sbatch {spec!r}: the option name {name!r} is not an sbatch long option (lower-case letters "
            "and '-', e.g. --sbatch mem-per-cpu=4G or --sbatch hold); one option per --sbatch"
        )
    owned = sorted(o for o in OWNED if o.startswith(name))
    if owned:
        raise LaunchError(
            f"--sbatch {spec!r}: --{owned[0]} is set by {OWNED[owned[0]]}"
            + ("" if owned[0] == name else f" (sbatch reads --{name} as --{owned[0]})")
            + "; use that instead"
        )
    return name, (value if eq else None)


def option_line(name: str, value: str | None) -> str:
    return f"#SBATCH --{name}" if value is None else f"#SBATCH --{name}={sbatch_value('--' + name, value)}"


@dataclass
class SiteOptions:
    """What a cluster asks of every job; a field left ``None`` is not asked for (Slurm's default)."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    qos: str | None = None
    mem: str | None = None
    constraint: str | None = None
    exclusive: bool | None = None
    mail_type: str | None = None
    mail_user: str | None = None
    cpus_per_gpu: int | None = None  # None: DEFAULT_CPUS_PER_GPU; 0: ask for none
    setup: str | None = None  # a file of shell lines run in the job before the launch
    sbatch: list[str] = field(default_factory=list)  # more OPTION=VALUE, one option each

    def merged_over(self, base: SiteOptions) -> SiteOptions:
        """These options, each taken from ``base`` where unset; ``sbatch`` entries by option name."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name, value in out.items():
            if value is None:
                out[name] = getattr(base, name)
        mine = {extra_option(spec)[0] for spec in self.sbatch}
        out["sbatch"] = [s for s in base.sbatch if extra_option(s)[0] not in mine] + list(self.sbatch)
        return SiteOptions(**out)

    def cpu_lines(self, gpus_per_node: int, cpus_per_task: int | None) -> list[str]:
        """The CPUs of a job of ``gpus_per_node`` GPUs whose one task per node asks for ``cpus_per_task``
        CPUs: that many, else on GPU nodes ``cpus_per_gpu`` per GPU (``DEFAULT_CPUS_PER_GPU``; 0: none)."""
        if cpus_per_task is not None:
            return [option_line("cpus-per-task", str(cpus_per_task))]
        per_gpu = DEFAULT_CPUS_PER_GPU if self.cpus_per_gpu is None else self.cpus_per_gpu
        return [option_line("cpus-per-gpu", str(per_gpu))] if gpus_per_node and per_gpu else []

    def lines(self) -> list[str]:
        """The ``#SBATCH`` lines of the other options, after the launcher's own."""
        out = []
        if self.mem is not None and not MEM.fullmatch(self.mem):
            raise LaunchError(
                f"--mem {self.mem!r} is not a memory size; use a number with an optional K, M, G or T "
                "(e.g. 64G; 0 asks for all of a node's memory)"
            )
        if self.mail_type is not None:
            unknown = [t for t in self.mail_type.split(",") if t.strip().upper() not in MAIL_TYPES]
            if unknown:
                raise LaunchError(
                    f"--mail-type {self.mail_type!r}: {', '.join(unknown)} is not a Slurm mail type; use a "
                    f"comma-separated list of {', '.join(sorted(MAIL_TYPES))}"
                )
        for name in ("partition", "account", "qos", "mem", "constraint", "mail_type", "mail_user"):
            value = getattr(self, name)
            if value is not None:
                out.append(option_line(name.replace("_", "-"), value))
        if self.exclusive:
            out.append("#SBATCH --exclusive")
        out += [option_line(*extra_option(spec)) for spec in self.sbatch]
        return out

    def setup_text(self, workdir: Path) -> str:
        """The set-up file's lines as they go into the script, after a line that ends the ``#SBATCH``
        block (so that no line of the file is read as an option); empty without a set-up file."""
        if not self.setup:
            return ""
        path = (workdir / Path(self.setup).expanduser()).resolve()
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            raise LaunchError(
                f"--setup {self.setup}: cannot read the set-up file ({err}); fix the path"
            ) from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.lstrip().startswith("#SBATCH"):
                raise LaunchError(
                    f"--setup {path}, line {number}: {line.strip()!r} is an #SBATCH line, which sbatch does "
                    "not read after the launcher's options; pass it as --sbatch OPTION=VALUE (or in the site "
                    "file's sbatch list) and remove it from the set-up file"
                )
        check = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
        if check.returncode != 0:
            why = " ".join(check.stderr.replace("bash: ", "").split())
            raise LaunchError(
                f"--setup {path} is not valid bash ({why}); an unclosed quote or block "
                "would swallow the launch that follows it in the job script; fix the file"
            )
        header = f": site set-up from {shlex.quote(str(path))}  # ends the #SBATCH block"
        return header + "\n" + text.rstrip("\n")


SITE_KEYS = {f.name.replace("_", "-"): f.name for f in dataclasses.fields(SiteOptions)}


def site_config_path(env: Mapping[str, str]) -> Path | None:
    """The user's site file: ``$TPE_SLURM_CONFIG`` (set but empty: none), else
    ``${XDG_CONFIG_HOME:-~/.config}/tpe-train/slurm.yaml`` where it exists."""
    if CONFIG_ENV in env:
        return Path(env[CONFIG_ENV]).expanduser() if env[CONFIG_ENV] else None
    base = Path(env.get("XDG_CONFIG_HOME") or Path(env.get("HOME", "~")) / ".config").expanduser()
    path = base / "tpe-train" / "slurm.yaml"
    return path if path.is_file() else None


def load_site(env: Mapping[str, str] = os.environ) -> SiteOptions:
    """The site file's options (none without a file), every key and type checked."""
    path = site_config_path(env)
    if path is None:
        return SiteOptions()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        why = " ".join(str(err).split())
        raise LaunchError(
            f"site file {path} ({CONFIG_ENV}): cannot read it as YAML ({why}); fix it"
        ) from None
    if data is None:
        return SiteOptions()
    if not isinstance(data, dict):
        raise LaunchError(
            f"site file {path} must be a YAML mapping of option: value, not {type(data).__name__}"
        )
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = SITE_KEYS.get(str(key))
        if name is None:
            raise LaunchError(
                f"site file {path}: unknown key {key!r}; valid keys are {', '.join(sorted(SITE_KEYS))} "
                "(the names of tpe-launch submit's flags)"
            )
        values[name] = _site_value(path, str(key), name, value)
    return SiteOptions(**values)


def _site_value(path: Path, key: str, name: str, value: Any) -> Any:
    if name == "exclusive":
        ok = isinstance(value, bool)
    elif name == "cpus_per_gpu":
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    elif name == "sbatch":
        value = [value] if isinstance(value, str) else value
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
        try:
            for spec in value if ok else []:
                extra_option(spec)
        except LaunchError as err:
            raise LaunchError(f"site file {path}: {err}") from None
    elif name == "time" and not isinstance(value, str):
        # YAML 1.1 reads 12:00:00 as a number of seconds (43200): only a quoted time is unambiguous
        raise LaunchError(f"site file {path}: time must be quoted, e.g. time: '12:00:00' (got {value!r})")
    else:
        value = str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value
        ok = isinstance(value, str)
        if ok and name == "setup":
            value = str((path.parent / Path(value).expanduser()).resolve())  # relative to the site file
    if not ok:
        kinds = {"exclusive": "true or false", "cpus_per_gpu": "a whole number >= 0",
                 "sbatch": "a list of OPTION=VALUE strings"}  # fmt: skip
        raise LaunchError(f"site file {path}: {key} must be {kinds.get(name, 'a string')}, not {value!r}")
    return value
