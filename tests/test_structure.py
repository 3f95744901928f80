"""The house stays small and layered, and its documents name files that exist.

No product module over ~400 lines, no function over ~60: a longer unit is allowed only when it is
listed in EXCEPTIONS with the reason; the test prints the longest units either way, so a reader
sees where the weight is. orchestrator/ imports downward only, through the LAYERS below, and no
two of its modules import each other, however indirectly.
"""

import ast
import re
from pathlib import Path

from tests.documents import documents

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("orchestrator", "trainer")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# "path" or "path:qualname" -> why it may be longer
EXCEPTIONS: dict[str, str] = {}


def product_files() -> list[Path]:
    return sorted(p for d in PRODUCT for p in (ROOT / d).rglob("*.py") if "__pycache__" not in p.parts)


def functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function and method, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            yield name, node.end_lineno - node.lineno + 1
            yield from functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            yield from functions(node, f"{prefix}{node.name}.")


def measure():
    modules, funcs = [], []
    for path in product_files():
        rel = path.relative_to(ROOT).as_posix()
        text = path.read_text()
        modules.append((len(text.splitlines()), rel))
        funcs.extend((n, f"{rel}:{name}") for name, n in functions(ast.parse(text)))
    return sorted(modules, reverse=True), sorted(funcs, reverse=True)


def _table(rows, limit) -> str:
    return "\n".join(f"  {n:5d}  {where}" + ("  (allowed: " + EXCEPTIONS[where] + ")" if where in EXCEPTIONS else "")
                     for n, where in rows[:limit])


def test_no_module_over_the_limit():
    modules, _ = measure()
    assert len(modules) > 20, "the product files were not found"
    over = [(n, p) for n, p in modules if n > MAX_MODULE_LINES and p not in EXCEPTIONS]
    print("longest modules:\n" + _table(modules, 10))
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them, or list them in EXCEPTIONS " \
                     f"with the reason):\n{_table(over, len(over))}"


def test_no_function_over_the_limit():
    _, funcs = measure()
    over = [(n, f) for n, f in funcs if n > MAX_FUNCTION_LINES and f not in EXCEPTIONS]
    print("longest functions:\n" + _table(funcs, 10))
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines (split them, or list them in " \
                     f"EXCEPTIONS with the reason):\n{_table(over, len(over))}"


def test_exceptions_are_still_needed():
    """An exception that no longer applies is removed, so the list stays honest."""
    modules, funcs = measure()
    sizes = {p: n for n, p in modules} | {f: n for n, f in funcs}
    stale = [k for k in EXCEPTIONS
             if sizes.get(k, 0) <= (MAX_MODULE_LINES if ":" not in k else MAX_FUNCTION_LINES)]
    assert not stale, f"EXCEPTIONS entries that are now within the limits or gone: {stale}"


def test_product_code_says_what_it_does_not_where_it_came_from():
    """Comments, docstrings and --help explain the code; the design documents and issue numbers
    belong in the README."""
    pattern = re.compile(r"\bseeds? ?0\d\d\b|\bissue #?\d+\b", re.I)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in product_files() + sorted((ROOT / "orchestrator" / "remote").glob("*.sh"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "history references in product code:\n" + "\n".join(hits)


# ------------------------------------------------------------------ the layers of orchestrator/

PACKAGE = "orchestrator"

# Top to bottom. A module may import only from its own layer or a lower one. Keyed by the name
# under orchestrator/ (a module or a package; "__init__" is orchestrator/__init__.py).
LAYERS: list[dict[str, str]] = [
    {"cli": "the commands: flags, printing, exit codes; nothing in the package imports them"},
    {"runs": "the run controller: preflight, launch, watch, restart, checkpoints, using all below",
     "observe": "a run seen from outside: metrics, events, trackers and the report, read from the run "
                "records; beside runs, since the supervisor hands its events and tracker environment to it"},
    {"platforms": "launch --from-env and the SLURM/k8s renders: local checks + the torchrun contract",
     "sync": "sync's control side: which files, and the relay chain that carries them",
     "pyenv": "setup: resolve a Python environment here, ship and install it with transfer",
     "netbench": "netbench's control side: a probe per node pair over the transport",
     "top": "top's control side: the GPU probe read per node",
     "plan": "the bandwidth planner behind `plan`: pure arithmetic, no I/O"},
    {"checks": "preflight: probe snippets, pure parsers, one probe per node; used by runs and platforms"},
    {"transfer": "the data plane: tar streams and node relays over the transport",
     "gpus": "the one GPU probe and its pure parsers, read by checks, top and launch --from-env"},
    {"node": "the one door to the nodes: the command form of every shipped program, its replies read "
             "into frozen types, one client per program of remote/; below everything that asks a node"},
    {"transport": "connections and the one fan-out engine: knows nodes, not what runs on them",
     "torchrun": "the launch contract (flags, per-node env, ranks): reads only the inventory"},
    {"inventory": "the frozen, validated models that every layer above is handed"},
    {"errors": "the one exception hierarchy and exit codes",
     "shell": "the one quoting rule",
     "probe": "the node side's output format (@@ sections), the shipped programs' bytes (common.py in front) "
              "and those programs loaded as modules",
     "home": "where clusterctl keeps its state on the control machine",
     "__init__": "the package's version"},
]
# The node code, shipped to the nodes as one package and run there alone (stdlib, or torch where one
# runs): its modules import each other (relatively), nothing else of the package, which is not
# installed on a node.
SHIPPED = "orchestrator.remote"

# Every import counts, at module level, inside a function, or under `if TYPE_CHECKING:`. A
# TYPE_CHECKING import is exempt from neither rule: it names the other module's types as surely
# as a run-time import, and the circle rule is about two modules that know each other, not about
# load order. Moving one side of a circle under TYPE_CHECKING only hides the import error that
# would have shown it: a helper that annotates the class importing it is still written to drive
# that class's internals.

# Violations allowed while their files are rewritten, keyed as `violations()` keys them
# ("orchestrator/runs/x.py -> orchestrator.cli", "circle: orchestrator/runs/x.py -> orchestrator.runs.y"),
# each with the reason. An entry goes when its file is done; test_pending_is_still_needed says when.
PENDING: dict[str, str] = {}


def module_name(rel: str) -> str:
    parts = rel.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]):
    """The modules one import statement loads: `from pkg import sub` names pkg.sub, `from pkg import
    name` names pkg; relative imports are resolved against `module`."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
        base = ".".join(parts + ([node.module] if node.module else []))
    subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
    return subs + ([base] if len(subs) < len(node.names) else [])


def imports(rel: str, text: str, known: set[str]):
    """(imported module, line, under TYPE_CHECKING) for every import of the package in one file:
    module level, inside functions and classes, and under `if TYPE_CHECKING:` alike."""
    module, out = module_name(rel), []

    def walk(node: ast.AST, typing_only: bool):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for t in _targets(child, module, rel.endswith("__init__.py"), known):
                    if t == PACKAGE or t.startswith(PACKAGE + "."):
                        out.append((t, child.lineno, typing_only))
            walk(child, typing_only or (isinstance(child, ast.If) and _is_type_checking(child)))

    walk(ast.parse(text), False)
    return out


def _layer(module: str) -> int | None:
    key = module.split(".")[1] if "." in module else "__init__"
    return next((i for i, layer in enumerate(LAYERS) if key in layer), None)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(sources: dict[str, str]) -> dict[str, list[str]]:
    """{key: ["file:line: what", ...]} for every import against the layers, every import of the
    package from a shipped script, every module on no layer, and every import circle."""
    known = {module_name(rel) for rel in sources}
    found: dict[str, list[str]] = {}
    edges: dict[str, dict[str, list[str]]] = {}
    for rel, text in sorted(sources.items()):
        me = module_name(rel)
        shipped = me == SHIPPED or me.startswith(SHIPPED + ".")
        if not shipped and _layer(me) is None:
            found.setdefault(f"{rel} on no layer", []).append(f"{rel}: add it to LAYERS, with why")
        for target, line, typing_only in imports(rel, text, known):
            note = " (under TYPE_CHECKING)" if typing_only else ""
            where = f"{rel}:{line}: imports {target}{note}"
            if target != me:
                edges.setdefault(me, {}).setdefault(target, []).append(where)
            if shipped and not target.startswith(SHIPPED + "."):
                found.setdefault(f"{rel} -> {target}", []).append(where + ": the node code runs alone (it may "
                                                                  "import only its own modules)")
            elif (mine := _layer(me)) is not None and (theirs := _layer(target)) is not None and theirs < mine:
                found.setdefault(f"{rel} -> {target}", []).append(where + ": a higher layer")
    for comp in _circles({m: set(t) for m, t in edges.items()}):
        for m in comp:
            for t, where in sorted(edges[m].items()):
                if t in comp:
                    found[f"circle: {where[0].split(':')[0]} -> {t}"] = \
                        [f"{w}: in a circle of {', '.join(comp)}" for w in where]
    return found


def package_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text()
            for p in sorted((ROOT / PACKAGE).rglob("*.py")) if "__pycache__" not in p.parts}


def _listing(found: dict[str, list[str]]) -> str:
    return "\n".join(f"  {key}" + (f"  (pending: {PENDING[key]})" if key in PENDING else "") +
                     "".join(f"\n      {w}" for w in where) for key, where in sorted(found.items()))


def test_imports_follow_the_layers_and_make_no_circle():
    found = violations(package_sources())
    print("layers, top to bottom:\n" + "\n".join(f"  {i}. {', '.join(layer)}" for i, layer in enumerate(LAYERS)))
    print("import violations:\n" + (_listing(found) or "  none"))
    new = {k: v for k, v in found.items() if k not in PENDING}
    assert not new, "imports against the layers (top to bottom in LAYERS: import from your own layer or " \
                    "a lower one; move what a lower layer needs down to it), or in a circle:\n" + _listing(new)


def test_pending_is_still_needed():
    """A PENDING entry whose import is gone is removed, so the list stays honest."""
    found = violations(package_sources())
    stale = [k for k in PENDING if k not in found]
    assert not stale, f"PENDING entries that no longer happen: {stale}"


def test_layer_check_is_not_vacuous():
    """The checks above find each kind of violation in a small made-up package, with file:line."""
    sources = {
        "orchestrator/__init__.py": "",
        "orchestrator/errors.py": "",
        "orchestrator/transport/__init__.py": "from orchestrator.errors import X\n",
        "orchestrator/transport/base.py": "def f():\n    from orchestrator.runs import spec\n",
        "orchestrator/runs/__init__.py": "",
        "orchestrator/runs/spec.py": "from orchestrator.transport import base\n",
        "orchestrator/runs/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                  "    from orchestrator.runs.b import B\n",
        "orchestrator/runs/b.py": "from . import a\n",
        "orchestrator/remote/agent.py": "import orchestrator.shell\n",
        "orchestrator/newthing.py": "import os\n",
    }
    found = violations(sources)
    assert found.pop("orchestrator/transport/base.py -> orchestrator.runs.spec") == \
        ["orchestrator/transport/base.py:2: imports orchestrator.runs.spec: a higher layer"]
    assert found.pop("circle: orchestrator/runs/spec.py -> orchestrator.transport.base")
    assert found.pop("circle: orchestrator/transport/base.py -> orchestrator.runs.spec")
    assert found.pop("circle: orchestrator/runs/a.py -> orchestrator.runs.b") == \
        ["orchestrator/runs/a.py:3: imports orchestrator.runs.b (under TYPE_CHECKING): in a circle of "
         "orchestrator.runs.a, orchestrator.runs.b"]
    assert found.pop("circle: orchestrator/runs/b.py -> orchestrator.runs.a")
    assert found.pop("orchestrator/remote/agent.py -> orchestrator.shell")
    assert found.pop("orchestrator/newthing.py on no layer")
    assert not found, found


# ------------------------------------------------------------------ the one door to the nodes

DOOR = ("orchestrator/node/", "orchestrator/remote/", "orchestrator/probe.py")
# file -> why it may still build a node line or read a node answer itself, with the change that removes it
DOOR_PENDING: dict[str, str] = {}
# file -> why its json.loads of a `stdout` is not a node's answer
NOT_A_NODE: dict[str, str] = {
    "orchestrator/cli/drill.py": "reads the `clusterctl train --detach --json` it ran here as a subprocess",
}


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            yield node


def _called(call: ast.Call) -> str:
    f = call.func
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def door_breaches(sources: dict[str, str]) -> dict[str, list[str]]:
    """{file: ["file:line: what"]} of node command lines and node answers handled outside the door:
    the node code's boot line or zip taken to build a command line (`BOOT`, `node_code(...)`,
    `node_code_path(...)`: probe.py), and a `json.loads(...)` of something's `.stdout` (a node's
    answer parsed by hand)."""
    found: dict[str, list[str]] = {}
    for rel, text in sorted(sources.items()):
        if rel.startswith(DOOR):
            continue
        tree = ast.parse(text)
        for ref in ast.walk(tree):
            if (isinstance(ref, ast.Name) and ref.id == "BOOT") or (isinstance(ref, ast.Attribute) and ref.attr == "BOOT"):
                found.setdefault(rel, []).append(f"{rel}:{ref.lineno}: BOOT: a node program's line built outside "
                                                 "orchestrator/node/")
        for call in _calls(tree):
            name = _called(call)
            if name in ("node_code", "node_code_path"):
                found.setdefault(rel, []).append(f"{rel}:{call.lineno}: {name}(): the node code taken outside "
                                                 "orchestrator/node/")
            elif name == "loads" and any(isinstance(a, ast.Attribute) and a.attr == "stdout"
                                         for arg in call.args for a in ast.walk(arg)):
                found.setdefault(rel, []).append(f"{rel}:{call.lineno}: json.loads of a stdout: a node's answer "
                                                 "read outside orchestrator/node/")
    return {rel: sorted(where, key=lambda w: int(w.split(":")[1])) for rel, where in found.items()}


def test_only_the_door_builds_node_command_lines_or_reads_node_answers():
    found = door_breaches(package_sources())
    allowed = DOOR_PENDING | NOT_A_NODE
    print("outside the door, allowed:\n" + "\n".join(f"  {k}: {v}" for k, v in allowed.items()))
    new = {k: v for k, v in found.items() if k not in allowed}
    assert not new, "node command lines or node answers outside orchestrator/node/ (add a client function " \
                    "there, one per verb of the program, and call it):\n" + \
        "\n".join(w for where in new.values() for w in where)
    stale = [k for k in allowed if k not in found]
    assert not stale, f"allowed breaches of the door that no longer happen (remove them): {stale}"


def test_door_check_is_not_vacuous():
    """Each kind of breach is found, with file:line; the door's own files are not."""
    sources = {
        "orchestrator/sync.py": "from orchestrator.probe import BOOT\nX = f'python -c {BOOT} nodeinfo'\n",
        "orchestrator/runs/x.py": "import json\ndef f(r):\n    return json.loads(r.stdout.strip().splitlines()[-1])\n",
        "orchestrator/checks/y.py": "from orchestrator import probe\nY = probe.node_code()[1]\n",
        "orchestrator/node/agent.py": "import json\nZ = json.loads(r.stdout)\nP = probe.BOOT\n",
        "orchestrator/probe.py": "BOOT = ''\ndef node_code():\n    return BOOT\nnode_code()\n",
    }
    assert door_breaches(sources) == {
        "orchestrator/checks/y.py": ["orchestrator/checks/y.py:2: node_code(): the node code taken outside "
                                     "orchestrator/node/"],
        "orchestrator/runs/x.py": ["orchestrator/runs/x.py:3: json.loads of a stdout: a node's answer read "
                                   "outside orchestrator/node/"],
        "orchestrator/sync.py": ["orchestrator/sync.py:2: BOOT: a node program's line built outside orchestrator/node/"]}


# ------------------------------------------------------------------ the documents

_PY_PATH = re.compile(r"(?<![\w/.-])((?:[\w-]+/)+[\w-]+\.py)\b")


def named_paths(text: str) -> list[tuple[int, str]]:
    """(line, path from the repository root) of every .py file a document names: whole paths
    (`orchestrator/runs/store.py`, `trainer/train.py`) and the package's short form
    (`runs/store.py`, `remote/node_agent.py`)."""
    folders = {p.name for p in ROOT.iterdir() if p.is_dir()}
    package = {p.name for p in (ROOT / PACKAGE).iterdir() if p.is_dir()}
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        for m in _PY_PATH.finditer(line):
            first = m.group(1).split("/")[0]
            if first in package and first not in folders:
                out.append((i, f"{PACKAGE}/{m.group(1)}"))
            elif first in folders:
                out.append((i, m.group(1)))
    return out


def test_documents_name_files_that_exist():
    docs = documents()
    assert any(d.parent != ROOT / "docs" and d.parent != ROOT for d in docs), "docs/ subfolders were not read"
    named = [(doc.relative_to(ROOT).as_posix(), i, path) for doc in docs for i, path in named_paths(doc.read_text())]
    assert len(named) > 100, "the documents' paths were not found"
    missing = [f"{doc}:{i}: {path}" for doc, i, path in named if not (ROOT / path).is_file()]
    assert not missing, "the documents name files that do not exist (moved? say where they went):\n" + \
        "\n".join(missing)


def test_document_check_is_not_vacuous():
    text = "see `runs/store.py` and orchestrator/torchrun.py,\nnot runs/RUN/nodes/NODE.log; trainer/train.py"
    assert named_paths(text) == [(1, "orchestrator/runs/store.py"), (1, "orchestrator/torchrun.py"),
                                 (2, "trainer/train.py")]


# A node run's processes are found by the key in their environment, across the whole user, so two
# test files that start runs under the same literal key can stop each other's processes when xdist
# runs them side by side (CI at 1bb413a: test_node_agent's `stop s2@n1` ended test_node_stream's
# job before it wrote a line). Each literal key belongs to one test file.
_RUN_KEY = re.compile(r"""["']([\w.-]+@n\d+)["']""")


def test_literal_run_keys_belong_to_one_test_file():
    files = {}
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        for key in set(_RUN_KEY.findall(path.read_text())):
            files.setdefault(key, []).append(path.name)
    assert len(files) > 20  # the pattern still finds the tests' keys
    shared = {key: names for key, names in files.items() if len(names) > 1}
    assert not shared, f"run keys used by more than one test file: {shared}"
