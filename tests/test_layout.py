"""The design's dependency rules, checked on the import graph, and the CI/README contract."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.docs import console_scripts

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "tpe_train"


def imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_model_and_positions_import_only_torch_and_each_other() -> None:
    for folder in ("model", "positions"):
        for path in (PKG / folder).glob("*.py"):
            for name in imports(path):
                top = name.split(".")[0]
                if top == "tpe_train":
                    allowed = ("tpe_train.model", "tpe_train.positions", "tpe_train.positions.registry")
                    assert name.startswith(allowed), f"{path.name} imports {name}"
                else:
                    # torch and small parts of the standard library (the packed-inference scope of
                    # model/kernels.py is a context manager with per-thread state; it reads $TPE_CPU_GEMM)
                    stdlib = {
                        "__future__",
                        "math",
                        "dataclasses",
                        "typing",
                        "collections",
                        "contextlib",
                        "threading",
                        "os",
                    }
                    assert top in {"torch", *stdlib}, f"{path.relative_to(ROOT)} imports {name}"


def test_parallel_never_imports_model_and_model_never_imports_parallel() -> None:
    for path in (PKG / "parallel").glob("*.py"):
        assert not any(n.startswith("tpe_train.model") for n in imports(path)), path
    for folder in ("model", "positions", "data"):
        for path in (PKG / folder).glob("*.py"):
            found = imports(path)
            assert not any(n.startswith(("tpe_train.parallel", "deepspeed", "accelerate")) for n in found), (
                path
            )
            assert "torch.distributed" not in found, path


#: The layers, bottom up: what each folder of the package may import from the others (docs/architecture.md).
BELOW = {
    "run": set(),  # torch-free: the launcher imports it
    "positions": set(),
    "model": {"positions"},
    "config": {"model", "positions"},
    "data": {"config", "model", "positions", "run"},  # run: tpe-data's logging set-up
    "parallel": {"config", "data", "positions"},  # never model: it names modules by pattern
    "ckpt": {"config", "data", "model", "parallel", "positions", "run"},
    "evaluation": {"ckpt", "config", "data", "model", "parallel", "positions", "run"},
    "train": {"ckpt", "config", "data", "evaluation", "model", "parallel", "positions", "run"},
    "study": {"ckpt", "config", "data", "evaluation", "model", "parallel", "positions", "run"},
}


def test_the_package_root_holds_folders_only_each_a_layer() -> None:
    assert [p.name for p in PKG.glob("*.py")] == ["__init__.py"]
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(BELOW)


def test_imports_run_down_the_layers_only() -> None:
    for folder, allowed in BELOW.items():
        for path in (PKG / folder).rglob("*.py"):
            for name in imports(path):
                parts = name.split(".")
                if parts[0] == "tpe_train" and len(parts) > 1 and parts[1] != folder:
                    assert parts[1] in allowed, (
                        f"{path.relative_to(ROOT)} imports {name}; {folder}/ may import {sorted(allowed)}"
                    )


def test_the_run_layer_needs_no_torch() -> None:
    for path in (PKG / "run").rglob("*.py"):
        assert not any(n.split(".")[0] in {"torch", "numpy", "deepspeed"} for n in imports(path)), path


def test_nothing_imports_the_training_loop() -> None:
    for path in [*PKG.rglob("*.py"), *(ROOT / "launcher").rglob("*.py")]:
        if path.parent != PKG / "train":
            assert not any(n.startswith("tpe_train.train") for n in imports(path)), path


def test_every_console_script_is_a_cli_module() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    scripts = text.split("[project.scripts]")[1].split("\n[")[0]
    targets = re.findall(r'= "([\w.]+):\w+"', scripts)
    assert len(targets) == 7
    assert all(target.endswith(".cli") for target in targets), targets


def test_files_stay_small() -> None:
    for path in PKG.rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 600, path
    assert len((PKG / "train" / "loop.py").read_text().splitlines()) <= 120


#: Functions longer than ``MAX_FUNCTION_LINES``, each with the reason it stays whole.
LONG_FUNCTIONS = {
    "tpe_train/study/report.py::markdown": "the report's template, one section after another",
    "tpe_train/study/report.py::extrapolation_markdown": "the extrapolation report's template",
    "launcher/submit.py::build": "the sbatch script, one directive after another",
    "benchmarks/bench_attention.py::run": "a benchmark script's body: its tables in the order printed",
    "benchmarks/bench_attention.py::parse_args": "one argument after another",
    "benchmarks/bench_export.py::run": "a benchmark script's body: its tables in the order printed",
    "benchmarks/bench_train.py::main": "a benchmark script's body: its tables in the order printed",
    "benchmarks/bench_translate.py::run": "a benchmark script's body: its tables in the order printed",
    "benchmarks/bench_wmt_scale.py::run": "a benchmark script's body: its tables in the order printed",
}
MAX_FUNCTION_LINES = 80


def function_lengths(path: Path) -> dict[str, int]:
    """Lines of every function and method in ``path`` (decorators not counted), by qualified name."""
    out: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                out[prefix + child.name] = child.end_lineno - child.lineno + 1
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_functions_fit_on_a_screen() -> None:
    lengths = {
        f"{path.relative_to(ROOT).as_posix()}::{name}": n
        for folder in ("tpe_train", "launcher", "benchmarks")
        for path in sorted((ROOT / folder).rglob("*.py"))
        for name, n in function_lengths(path).items()
    }
    long = {name: n for name, n in lengths.items() if n > MAX_FUNCTION_LINES}
    assert not long.keys() - LONG_FUNCTIONS.keys(), (
        f"functions over {MAX_FUNCTION_LINES} lines: {long}; split them (or add one to LONG_FUNCTIONS "
        "with the reason it stays whole)"
    )
    stale = LONG_FUNCTIONS.keys() - long.keys()
    assert not stale, f"in LONG_FUNCTIONS but no longer long (or gone): {sorted(stale)}"
    assert lengths["tpe_train/train/loop.py::train"] <= 60


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    test_cmd = next(line.strip() for line in readme[:12] if "pytest" in line)
    demo_cmd = next(line.strip() for line in readme[:12] if line.endswith("&& tpe-train"))
    assert demo_cmd.startswith("python -m pip install torch==2.13.0")
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci


def test_run_directory_names_are_spelled_only_in_rundir() -> None:
    """One owner of the run directory's layout (tpe_train/ckpt/rundir.py): no other module builds a
    path from one of its names."""
    names = (
        r'checkpoints|checkpoint|tb|eval\.json|averaged-last[^"]*|config\.yaml|tokenizer\.json|'
        r'preempted\.json|memory\.json|deepspeed\.json|samples|train\.log|slurm-[^"]*'
    )
    path_of_name = re.compile(rf'/\s*f?"({names})"')
    other_layouts = {  # directories that are not run directories, with names of their own
        PKG / "data" / "store.py": {"tokenizer.json"},  # the token store
        PKG / "study" / "report.py": {"tb"},  # a study's report directory
        ROOT / "launcher" / "submit.py": {"slurm-%A_%a.out"},  # a sweep's root, above its run directories
    }
    for path in [*PKG.rglob("*.py"), *(ROOT / "launcher").rglob("*.py")]:
        if path == PKG / "ckpt" / "rundir.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for name in path_of_name.findall(line):
                where = f"{path.relative_to(ROOT)}:{number}"
                assert name in other_layouts.get(path, set()), (
                    f"{where} builds a path from {name!r}; use RunDir"
                )


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


PROJECT = ("tpe_train", "launcher", "benchmarks")


def import_graph(root: Path = ROOT, tops: tuple[str, ...] = PROJECT) -> dict[str, set[str]]:
    """Module -> the project modules it imports, at the top or inside a function, for tpe_train,
    launcher and benchmarks. A benchmark script's bare ``from harness import`` names its sibling
    (``python benchmarks/x.py`` puts the script's folder first on the path)."""
    files = {_module_name(p, root): p for top in tops for p in (root / top).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        script = not (path.parent / "__init__.py").exists()
        wanted: list[str] = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                wanted += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, base] if base else anchor)
                wanted += [base, *(f"{base}.{a.name}" for a in node.names)]
        found = {full for w in wanted for full in ([w, f"{package}.{w}"] if script else [w])}
        graph[name] = {m for m in found if m in files and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = stack[stack.index(node) :]
                del stack[stack.index(node) :]
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "tpe_train.parallel.collectives" in graph["tpe_train.parallel.vocab"]  # the graph sees imports
    assert "benchmarks.harness" in graph["benchmarks.peers"]  # and a script's sibling
    assert cycles(graph) == [], "import cycles (move the shared part to a module both import)"


def test_the_cycle_check_finds_a_cycle_through_a_deferred_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import f\n")
    (tmp_path / "pkg" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    (tmp_path / "pkg" / "d.py").write_text("from pkg import a\n")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "x.py").write_text("from y import z\n")
    (tmp_path / "scripts" / "y.py").write_text("def z():\n    import x\n")
    graph = import_graph(tmp_path, ("pkg", "scripts"))
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"], ["scripts.x", "scripts.y"]]


def test_benchmarks_share_through_the_harness_only() -> None:
    """A benchmark imports the harness and the peers, never another benchmark; the harness imports no
    benchmark module at all (the peers import it). The GPU checks (benchmarks/gpu/) use the harness too."""
    graph = import_graph()
    shared = {"benchmarks.harness", "benchmarks.peers"}
    for name, found in graph.items():
        mine = {m for m in found if m.startswith("benchmarks.")}
        if name == "benchmarks.harness":
            assert not mine, f"the harness imports {sorted(mine)}"
        elif name.startswith("benchmarks.") and not name.startswith("benchmarks.gpu"):
            assert mine <= shared, f"{name} imports {sorted(mine - shared)}: share it through the harness"


#: What a console script may not import before its arguments parse (each costs 0.5-2 s of CPU time).
HEAVY = ("torch", "deepspeed", "datasets", "accelerate", "transformers", "tokenizers", "pydantic")

ANSWER_WITHOUT_HEAVY = """
import contextlib, importlib, io, json, sys
heavy, found = sys.argv[1].split(","), {}
for script, target in json.loads(sys.argv[2]).items():
    module, _, function = target.partition(":")
    main = getattr(importlib.import_module(module), "main" if function == "entry" else function)
    for argv in (["--help"], ["--no-such-option"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            try:
                code = main(argv)
            except SystemExit as stop:
                code = stop.code
        found[f"{script} {argv[0]}"] = [code, [name for name in heavy if name in sys.modules]]
print(json.dumps(found))
"""


@pytest.mark.integration
def test_console_scripts_answer_help_and_wrong_options_without_torch() -> None:
    """``--help`` and a wrong option answer before torch, DeepSpeed or datasets load: every console
    script parses its arguments first (2 s of imports otherwise, in every test that starts one)."""
    scripts = console_scripts()
    args = [sys.executable, "-c", ANSWER_WITHOUT_HEAVY, ",".join(HEAVY), json.dumps(scripts)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout)
    assert len(found) == 2 * len(scripts) == 14
    assert {key: code for key, (code, _) in found.items()} == {
        key: 0 if key.endswith("--help") else 2 for key in found
    }
    assert {key: loaded for key, (_, loaded) in found.items() if loaded} == {}
