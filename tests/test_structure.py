"""The house stays small: no product module over ~400 lines, no function over ~60.

A longer unit is allowed only when it is listed in EXCEPTIONS with the reason; the test prints the
longest units either way, so a reader sees where the weight is.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("orchestrator", "trainer")
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60

# "path" or "path:qualname" -> why it may be longer
EXCEPTIONS: dict[str, str] = {
    "orchestrator/remote/nodeinfo.py": "shipped to each node as one script (python -S -c, stdlib only): it "
                                       "cannot import a sibling module there",
    "orchestrator/remote/node_agent.py": "shipped to each node as one self-contained script on stdin "
                                         "(`python - CMD`); it cannot import a sibling module there",
}


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
    import re

    pattern = re.compile(r"\bseeds? ?0\d\d\b|\bissue #?\d+\b", re.I)
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
            for p in product_files() + sorted((ROOT / "orchestrator" / "remote").glob("*.sh"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "history references in product code:\n" + "\n".join(hits)
