"""The import direction: a module imports its own layer or a lower one, never a higher one, and no circle.

The layers, lowest first (``docs/architecture.md`` says what lives in each), by the first path
component under ``lightning_bamboo/``. Every import counts: top level, inside functions, under
``TYPE_CHECKING``, relative ones. A parent package that Python runs on the way to a module is not an
import of the module's own.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO

PACKAGE = REPO / "lightning_bamboo"
LAYERS: dict[str, int] = {
    **dict.fromkeys(("errors", "logs", "topology", "schedule", "planner", "models", "data"), 0),
    **dict.fromkeys(("membership", "checkpoint", "testing"), 1),
    "engine": 2,
    "runtime": 3,
    **dict.fromkeys(("strategy", "callbacks", "deepspeed_api", "launcher"), 4),
    **dict.fromkeys(("demo", "sim", "cli", "_registration", "__init__"), 5),
}


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer_of(module: str) -> tuple[str, int]:
    """``(first path component, layer)`` of a ``lightning_bamboo`` module; the package itself is ``__init__``."""
    parts = module.split(".")
    room = parts[1] if len(parts) > 1 else "__init__"
    if room not in LAYERS:
        raise AssertionError(
            f"{module} is in no layer (first path component {room!r}); add {room!r} to LAYERS in "
            f"tests/test_architecture.py and to docs/architecture.md"
        )
    return room, LAYERS[room]


def imports_of(module: str) -> Iterator[tuple[str, int]]:
    """``(imported lightning_bamboo module, line)`` for every import anywhere in ``module``'s file."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "lightning_bamboo":
                    yield _known(alias.name), node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "lightning_bamboo":
                continue
            for alias in node.names:
                # ``from lightning_bamboo import checkpoint``: the module checkpoint, not the package
                yield (f"{source}.{alias.name}" if f"{source}.{alias.name}" in MODULES else _known(source)), node.lineno


def _known(name: str) -> str:
    """The module ``name`` names, or its closest enclosing module that exists (a name in a package)."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


GRAPH: dict[str, dict[str, int]] = {}
for _module in MODULES:
    GRAPH[_module] = {}
    for _target, _line in imports_of(_module):
        if _target != _module:
            GRAPH[_module].setdefault(_target, _line)


def test_no_module_imports_a_higher_layer():
    wrong = []
    for module, targets in GRAPH.items():
        room, layer = layer_of(module)
        for target, line in targets.items():
            target_room, target_layer = layer_of(target)
            if target_layer > layer:
                wrong.append(
                    f"{module} (layer {layer}: {room}) imports {target} (layer {target_layer}: {target_room}) "
                    f"at line {line}"
                )
    assert not wrong, "imports of a higher layer; move the imported code down or the caller up:\n" + "\n".join(wrong)


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """One circle through ``component``'s first module: ``[a, b, ..., a]``."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for target in sorted(graph[node]):
            if target == start:
                return [*paths[node], start]
            if target in members and target not in paths:
                paths[target] = [*paths[node], target]
                queue.append(target)
    raise AssertionError(f"no circle through {start} in {component}")


def test_strongly_connected_finds_a_circle():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}
    assert strongly_connected(graph) == [["a", "b", "c"]]
    assert cycle_in(["a", "b", "c"], graph) == ["a", "b", "c", "a"]


def test_no_import_circle():
    graph = GRAPH
    circles = [" -> ".join(cycle_in(component, graph)) for component in strongly_connected(graph)]
    assert not circles, "import circles (function-level imports included); break each:\n" + "\n".join(circles)


def test_topology_imports_only_errors_and_itself():
    wrong = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items() if layer_of(module)[0] == "topology"
        for target in targets if layer_of(target)[0] not in ("topology", "errors")
    ]
    assert not wrong, "topology holds pure plans: it imports lightning_bamboo.errors and the stdlib only:\n" + "\n".join(wrong)


def test_topology_loads_no_torch():
    code = (
        "import sys, lightning_bamboo.topology; "
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'lightning', 'numpy') if m in sys.modules); "
        "print(heavy); sys.exit(bool(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing lightning_bamboo.topology loaded {proc.stdout.strip()}\n{proc.stderr}"


def test_membership_imports_no_torch():
    """The membership protocol (the session included) runs in one process against a store: no module of
    ``membership/`` names torch, and importing all of them loads none of the heavy packages."""
    named = sorted(
        f"{path.relative_to(REPO)}:{node.lineno}"
        for path in (PACKAGE / "membership").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if (isinstance(node, ast.Import) and any(a.name.split(".")[0] in ("torch", "deepspeed", "lightning")
                                                 for a in node.names))
        or (isinstance(node, ast.ImportFrom) and not node.level
            and (node.module or "").split(".")[0] in ("torch", "deepspeed", "lightning"))
    )
    assert not named, "membership/ imports torch, deepspeed or lightning; move that code to engine/ or runtime/:\n" + \
        "\n".join(named)
    modules = sorted(m for m in MODULES if layer_of(m)[0] == "membership")
    code = (
        f"import importlib, sys; [importlib.import_module(m) for m in {modules!r}]; "
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'lightning', 'numpy') if m in sys.modules); "
        "print(heavy); sys.exit(bool(heavy))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing lightning_bamboo.membership's modules loaded {proc.stdout.strip()}\n{proc.stderr}"


def test_the_launcher_starts_without_torch_on_a_machine_without_gpus(tmp_path):
    """The launcher supervises processes and talks to the store: it imports no heavy package (1.5 s of its start on
    2 cores was torch's import), also through a whole job of a worker that imports none (here, no GPU driver)."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys; sys.exit('torch' in sys.modules)\n")
    code = (
        "import sys; from lightning_bamboo.launcher import launch; "
        f"codes = launch([sys.executable, {str(worker)!r}], 2, timeout=60); "
        "heavy = sorted(m for m in ('torch', 'deepspeed', 'lightning', 'numpy') if m in sys.modules); "
        "print(codes, heavy); sys.exit(bool(heavy) or set(codes.values()) != {0})"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, f"the launcher loaded {proc.stdout.strip()}\n{proc.stderr[-2000:]}"


def test_the_layer_table_covers_every_module():
    for module in MODULES:
        layer_of(module)


#: what a front end (layer 4 and up) may import of ``runtime/``: the runner's door, its options, the membership
#: session it opens, the host protocol it implements, leaving, notices, rebalancing, refusals and the reductions of
#: values its collectives gather; never the modules
#: behind the door (the stage, the failover, the restart, the layout moves, the stage's checkpoints)
RUNTIME_DOOR = {f"lightning_bamboo.runtime{suffix}" for suffix in (
    "", ".runner", ".config", ".session", ".host", ".leave", ".notices", ".rebalance", ".refusal", ".collectives")}


def test_a_front_end_imports_no_runner_internals():
    found = sorted(f"{module} imports {target} (line {line})" for module, targets in GRAPH.items()
                   if layer_of(module)[1] >= LAYERS["strategy"]
                   for target, line in targets.items()
                   if target.startswith("lightning_bamboo.runtime") and target not in RUNTIME_DOOR)
    assert not found, ("a front end reaches behind the runner's door; add a verb or a view to PipelineRunner:\n"
                       + "\n".join(found))


#: the processes that may end with ``os._exit``: ones that run no line of a worker's (a zygote, a communication
#: process: nothing of the worker's to flush, no status anyone reads but 0), whose teardown would only write the
#: preloaded heap they share with their worker
#: the processes that end without the interpreter's teardown (``membership.teardown.leave_without_teardown``, the
#: package's one ``os._exit``): forked helpers that run none of a worker's code, by file with their count of calls
NEVER_RAN = {"lightning_bamboo/engine/comm_zygote.py": 1, "lightning_bamboo/engine/comm_child.py": 1}


#: the process state a module may keep at its top level, each with its owner's reason: one per process by nature
#: (a worker is one node of one job), each an object with its own methods, never a bare dict written from outside
PROCESS_STATE = {
    "lightning_bamboo.runtime.leave": {"LEAVE"},  # the request to leave: signals and pollers set it, steps read it
    # what init_distributed opened for initialize: a DeepSpeed script's two calls share nothing else
    "lightning_bamboo.deepspeed_api.resilient": {"OPENED"},
    "lightning_bamboo.engine.comm_process": {"_GENERATION"},  # the communication process of this worker
    "lightning_bamboo.engine.comm_zygote": {"_ZYGOTE"},  # its forked template, started once per worker
    "lightning_bamboo.engine.replica_location": {"_SIDE_STREAMS"},  # CUDA streams per device, made once
    "lightning_bamboo.membership.members": {"_REPORTED"},  # malformed records already warned about
    # the liveness port of this process: it must live as long as the process, and no longer (its end is the signal)
    "lightning_bamboo.membership.liveness": {"_LISTENER"},
    # Lightning subclasses made once per base; the strategies whose engines and group outlive fit() (a
    # save_checkpoint after it needs both), released at interpreter exit or before a restart in the process
    "lightning_bamboo.strategy.patches": {"_PATCHED", "_LAUNCHERS", "_TO_RELEASE"},
}
_MUTATORS = {"append", "extend", "add", "update", "pop", "popitem", "clear", "setdefault", "remove", "discard",
             "insert", "put", "take", "set", "attach", "detach", "request", "__setitem__"}


def module_state(path: Path) -> set[str]:
    """Top-level names of ``path`` that its functions change: rebound under ``global``, or written through
    (``NAME[k] = v``, ``del NAME[k]``, ``NAME.attr = v``, ``NAME.append(...)`` and the like)."""
    tree = ast.parse(path.read_text(), str(path))
    top = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
           for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    changed: set[str] = set()
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.Global):
                changed.update(node.names)
            targets = (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else
                       [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                if isinstance(target, (ast.Subscript, ast.Attribute)) and isinstance(target.value, ast.Name):
                    changed.add(target.value.id)
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS
                    and isinstance(node.func.value, ast.Name)):
                changed.add(node.func.value.id)
    return changed & top


def test_no_module_keeps_mutable_state_outside_the_listed_few():
    found = {module: state for module, path in MODULES.items() if (state := module_state(path))}
    extra = {module: sorted(state - PROCESS_STATE.get(module, set())) for module, state in found.items()}
    extra = {module: names for module, names in extra.items() if names}
    assert not extra, ("module-level state outside PROCESS_STATE: keep it in an object its owner passes on, or list "
                       f"it with its reason: {extra}")
    stale = {module: sorted(names - found.get(module, set())) for module, names in PROCESS_STATE.items()}
    assert not {m: n for m, n in stale.items() if n}, f"PROCESS_STATE lists names no module changes: {stale}"


def test_the_state_check_finds_a_module_global_written_from_a_function(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("A = {}\nB = []\nC = 1\nD = {'k': 1}\ndef f():\n    A['x'] = 1\n    B.append(2)\n    global C\n"
                      "    C = 2\n    return D['k']\n")
    assert module_state(source) == {"A", "B", "C"}


def test_the_engines_state_is_made_in_its_constructor():
    # no class-level defaults standing in for instance state, no entries slipped into __dict__ later
    source = (PACKAGE / "engine" / "pipe.py").read_text()
    engine = next(node for node in ast.parse(source).body
                  if isinstance(node, ast.ClassDef) and node.name == "BambooPipelineEngine")
    names = [target.id for node in engine.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(target, ast.Name)]
    assert "_INSTRUCTION_MAP" in names
    assert [name for name in names if not name.isupper()] == []
    assert "__dict__" not in source


def test_no_module_leaves_with_os_exit():
    """A process's exit status is its real one: nothing in the package skips the interpreter's exit
    (a step blocked on a lost peer is aborted, not left behind, so a normal exit is safe), but the
    helpers that run none of a worker's code (``NEVER_RAN``, each with its count of calls), through the one
    ``os._exit`` of ``membership.teardown.leave_without_teardown``."""
    exits = {str(path.relative_to(REPO)): path.read_text().count("os._exit(") for path in PACKAGE.rglob("*.py")}
    assert {path: count for path, count in exits.items() if count} == {"lightning_bamboo/membership/teardown.py": 1}
    found = {str(path.relative_to(REPO)): path.read_text().count("leave_without_teardown(") for path in PACKAGE.rglob("*.py")}
    found["lightning_bamboo/membership/teardown.py"] -= 1  # its definition
    assert {path: count for path, count in found.items() if count} == NEVER_RAN


#: private names defined in this package that are also private attributes of the packages it extends: read on
#: their objects, they are the price of subclassing DeepSpeed, torch and Lightning, not another module's privates
THEIRS = {
    "_layer_specs": "DeepSpeed's PipelineModule",
    "_allgather_base": "torch's ProcessGroup",
    "_world": "torch.distributed.distributed_c10d",
    "_trainer": "Lightning's LightningModule",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined_privates(tree: ast.AST) -> set[str]:
    """The private names a module defines: its functions and methods, the attributes it assigns, class fields."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if _private(n)}


def test_no_module_reads_another_modules_private_attribute():
    """A leading underscore keeps a name to its module: another module goes through a public operation. The
    owner's ``self._x``, a parent's ``super()._x`` and the privates of DeepSpeed, torch and Lightning objects
    (``THEIRS``, and any name this package does not define) are not counted."""
    trees = {module: ast.parse(path.read_text()) for module, path in MODULES.items()}
    owners: dict[str, set[str]] = {}
    for module, tree in trees.items():
        for name in _defined_privates(tree):
            owners.setdefault(name, set()).add(module)
    found = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and _private(node.attr)):
                continue
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                    isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super"):
                continue
            if node.attr in owners and module not in owners[node.attr] and node.attr not in THEIRS:
                found.append(f"{module}:{node.lineno}: {ast.unparse(node)} (defined in {', '.join(sorted(owners[node.attr]))})")
    assert not found, "reads of another module's private attribute; make it public or add an operation:\n" + "\n".join(found)


#: ``PipelineRunner``'s public surface: the verbs a host (the strategy, the DeepSpeed door, the demo worker, a
#: user's loop) and the callbacks drive, and a few read-only views. The runner composes its ``NodeStage``
#: (``stage``), its ``StageCheckpoints`` (``checkpoints``) and its session; what a stage is and does is the stage's
#: own surface. A change here is made on purpose: the door is meant to stay narrow, never to grow by accident.
RUNNER_OPERATIONS = (
    "admit_standby agree audit before_step can_restart close configure join eval_step finish gather layer_costs "
    "open_session place precision_meta probe publish reconfigure resilient resolve_precision restart "
    "restart_checkpoint restarted start start_admitted start_without_lost train_step wait_admission"
).split()
#: ... its read-only views (properties)
RUNNER_VIEWS = ("audits backend before_step_hooks between_steps config depth engine failovers gradient_clipping layout "
                "micro_batches node nodes precision restarting seed session standby").split()
#: ... and its public fields (assigned in ``__init__``)
RUNNER_FIELDS = "catching_up checkpoints host".split()


def test_the_runners_public_surface_is_the_listed_one():
    from lightning_bamboo.runtime import PipelineRunner
    from lightning_bamboo.runtime.stage import NodeStage

    assert not issubclass(PipelineRunner, NodeStage), "the runner composes its stage (runner._stage), it is not one"
    names = [n for n in dir(PipelineRunner) if not n.startswith("_")]
    views = sorted(n for n in names if isinstance(getattr(PipelineRunner, n), property))
    operations = sorted(n for n in names if n not in views)
    fields = set()
    for node in ast.walk(ast.parse(MODULES["lightning_bamboo.runtime.runner"].read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            fields.update(t.attr for n in ast.walk(node) if isinstance(n, (ast.Assign, ast.AnnAssign))
                          for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                          if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                          and t.value.id == "self" and not t.attr.startswith("_"))
    assert operations == sorted(RUNNER_OPERATIONS), (
        f"new: {sorted(set(operations) - set(RUNNER_OPERATIONS))}, gone: {sorted(set(RUNNER_OPERATIONS) - set(operations))}")
    assert views == sorted(RUNNER_VIEWS), (
        f"new: {sorted(set(views) - set(RUNNER_VIEWS))}, gone: {sorted(set(RUNNER_VIEWS) - set(views))}")
    assert sorted(fields) == sorted(RUNNER_FIELDS), (
        f"new: {sorted(fields - set(RUNNER_FIELDS))}, gone: {sorted(set(RUNNER_FIELDS) - fields)}")


def test_no_module_writes_the_runners_or_the_stages_fields():
    """A runner's or a stage's state changes through their operations (``stage.place``, ``stage.assign``,
    ``stage.configure``, ``runner.open_session``), never by a field written from another module."""
    owners = {"lightning_bamboo.runtime.runner", "lightning_bamboo.runtime.stage"}
    found = []
    for module, path in MODULES.items():
        if module in owners:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                if not isinstance(target, ast.Attribute):
                    continue
                owner = target.value
                name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
                if name in ("runner", "stage", "_stage"):
                    found.append(f"{module}:{node.lineno}: {ast.unparse(target)}")
    assert not found, "fields of a runner or a stage written from outside; add an operation:\n" + "\n".join(found)


def test_the_architecture_document_names_every_module():
    """docs/architecture.md's module map names every module of the package (a new one is added there)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    missing = sorted(str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
                     if f"`{path.relative_to(PACKAGE)}`" not in text)
    assert not missing, "docs/architecture.md does not name these modules (add them to its module map):\n" + \
        "\n".join(missing)


@pytest.mark.parametrize("module", ["lightning_bamboo.topology", "lightning_bamboo.schedule", "lightning_bamboo.errors",
                                    "lightning_bamboo.planner.costmodel", "lightning_bamboo.planner.solver",
                                    "lightning_bamboo.planner.plan"])
def test_the_layer_zero_modules_the_document_calls_torch_free_import_no_torch(module):
    """What docs/architecture.md says of layer 0: these import no torch (torch hidden: importing it would fail)."""
    code = f"import sys; sys.modules['torch'] = None; import {module}; print(sorted(m for m in ('deepspeed', " \
           "'lightning') if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]


def test_the_front_ends_see_the_stage_only_through_the_runners_views():
    """Outside ``runtime/`` nothing reaches a runner's stage (``runner._stage``, formerly the public ``runner.stage``):
    the front doors, callbacks, demo and launcher use the runner's views and verbs."""
    found = sorted(
        f"{path.relative_to(REPO)}:{number}"
        for path in PACKAGE.rglob("*.py") if path.relative_to(PACKAGE).parts[0] != "runtime"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "runner._stage" in line or "runner.stage." in line
    )
    assert not found, "the stage reached through the runner outside runtime/; add a view to PipelineRunner:\n" + \
        "\n".join(found)


def _top_level_imports(path: Path) -> set[str]:
    """The first component of every module ``path`` imports (absolute imports; anywhere in the file)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found


def test_tests_and_benchmarks_import_nothing_of_each_other():
    """What both need lives in the package (``lightning_bamboo.testing``, ``lightning_bamboo.sim.measured``): no test
    imports a benchmark script (by name, a ``sys.path`` entry or its file), and no benchmark imports from ``tests/``.
    A test runs a benchmark as a user does, as a process."""
    benchmarks = {path.stem for path in (REPO / "benchmarks").glob("*.py")}
    found = []
    for path in sorted(p for p in (REPO / "tests").rglob("*.py") if p != Path(__file__)):
        text = path.read_text()
        named = sorted(_top_level_imports(path) & benchmarks)
        loads = [line.strip() for line in text.splitlines()
                 if "benchmarks" in line and ("sys.path" in line or "spec_from_file_location" in line)]
        found += [f"{path.relative_to(REPO)} imports {m}" for m in named] + \
                 [f"{path.relative_to(REPO)}: {line}" for line in loads]
    for path in sorted((REPO / "benchmarks").rglob("*.py")):
        if "tests" in _top_level_imports(path):
            found.append(f"{path.relative_to(REPO)} imports from tests/")
    assert not found, "tests and benchmarks reach into each other; move what both need into the package:\n" + \
        "\n".join(found)


def test_tests_import_no_private_name_of_the_package():
    """A test reaches the package through the names it offers: no ``from lightning_bamboo... import _name`` (a private
    name a test needs is made public, with a docstring saying what it is for)."""
    found = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "lightning_bamboo":
                found += [f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")]
    assert not found, "tests import private names of the package:\n" + "\n".join(found)
