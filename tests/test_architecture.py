"""Checkable facts of the package layout: one validator and one builder of the boundaries, no
per-batch state in module-level caches, no private torch API, imports pointing down the floors.

These read the source (ast), so they fail when a change re-introduces what the boundary object replaced.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "varpack"
SOURCES = sorted(PKG.rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines outside docstrings and comments."""
    text = path.read_text()
    tree = ast.parse(text)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            doc_lines.update(range(node.lineno, node.end_lineno + 1))
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if i in doc_lines:
            continue
        code = line.split("#", 1)[0]
        if code.strip():
            out.append((i, code))
    return out


def _grep(pattern: str) -> list[str]:
    rx = re.compile(pattern)
    return [f"{_rel(p)}:{i}: {line.strip()}" for p in SOURCES for i, line in _code_lines(p) if rx.search(line)]


def test_no_private_torch_c_api():
    assert _grep(r"torch\._C\b") == []


def test_one_validator_of_cu_seqlens_values():
    """The rule messages ('must be 0', 'never decrease', 'but the stream has') live in one function."""
    hits = _grep(r"must be 0\"|never decrease|but the stream has|must not decrease")
    assert hits and all(h.startswith("varpack/varlen/") for h in hits), hits


def test_seq_idx_built_in_one_place():
    """Expanding segment lengths into a per-token segment index happens in varpack.varlen only."""
    hits = _grep(r"np\.repeat\(np\.arange\(|repeat_interleave\(.*lengths|searchsorted\(.*cu")
    allowed = ("varpack/varlen/", "varpack/attn/flex.py")  # flex: document ids of its padded block mask
    assert all(h.startswith(allowed) for h in hits), hits


def test_no_module_level_per_batch_caches():
    """No identity-keyed caches at module level (the batch's VarlenMeta keeps per-batch objects)."""
    assert _grep(r"TensorCache|_BOUNDARY_CACHE|_BLOCK_MASK_CACHE|_current_graph_task_id") == []
    assert not (PKG / "attn" / "_cache.py").exists()


FLOORS_BELOW_MODELS = ("data", "plan")
UPPER = ("models", "integrations", "train")


@pytest.mark.parametrize("floor", FLOORS_BELOW_MODELS)
def test_data_and_plan_never_import_models_integrations_or_train(floor):
    bad = []
    for path in sorted((PKG / floor).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "varpack" and len(parts) > 1 and parts[1] in UPPER:
                    bad.append(f"{_rel(path)}: {name}")
    assert bad == []


def test_varlen_is_the_bottom_floor_of_the_boundaries():
    """varpack.varlen imports only the schema from varpack (everything else reads it)."""
    bad = []
    for path in sorted((PKG / "varlen").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("varpack"):
                if not node.module.startswith(("varpack.varlen", "varpack.schema")):
                    bad.append(f"{_rel(path)}: {node.module}")
    assert bad == []


#: the floors of docs/ARCHITECTURE.md, top (high rank) to bottom; a module may import its own floor or lower,
#: never a floor above it, not even inside a function. Every top-level module or package of varpack has a floor.
FLOOR_RANK = {
    "cli": 5,
    "train": 4,
    "check": 4,
    "zoo": 4,
    "integrations": 3,
    "models": 3,
    "attn": 2,
    "ops": 2,
    "loss": 2,
    "collate": 2,
    "data": 1,
    "plan": 1,
    "rope": 1,
    "varlen": 0,
    "schema": 0,
    "_probe": 0,
    "_argtypes": 0,
    "_triton": 0,
}
MAX_FLOORS = 6


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, bool]]:
    """``(module, at_import_time)`` for every absolute ``varpack.*`` import of a file."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        out += [(n, id(node) in top) for n in names if n.startswith("varpack.")]
    return out


def test_every_import_points_down_the_floors():
    assert len(set(FLOOR_RANK.values())) <= MAX_FLOORS
    unplaced = sorted({_module_name(p).split(".")[1] for p in SOURCES if p != PKG / "__init__.py"} - set(FLOOR_RANK))
    assert unplaced == [], f"top-level modules without a floor in FLOOR_RANK: {unplaced}"
    bad = []
    for path in SOURCES:
        me = _module_name(path)
        if me == "varpack":
            continue  # the package's __init__ (lazy exports) sits above all
        floor = me.split(".")[1]
        for name, _ in _imports(path):
            other = name.split(".")[1]
            if FLOOR_RANK.get(other, -1) > FLOOR_RANK[floor]:
                bad.append(f"{me} -> {name}")
    assert bad == []


def _import_graph() -> dict[str, set[str]]:
    """module -> the varpack modules it imports (at import time or inside a function); ``from pkg import name``
    counts as importing ``pkg.name`` when that is a module, else ``pkg``."""
    modules = {_module_name(p) for p in SOURCES}

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in modules}
    for path in SOURCES:
        me = _module_name(path)
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                target = resolve(name) if name.startswith("varpack.") else None
                # a package's own __init__ imported by its submodule is not an edge back (Python loads it first)
                if target and target != me and not me.startswith(target + "."):
                    graph[me].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    """No module imports, directly or through others, a module that imports it back -- function-level imports
    counted too (a circle deferred into a function is still a circle)."""
    assert _cycles(_import_graph()) == []


def test_the_circle_check_can_fail():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]



#: work-history words that do not belong in the product's files (git log keeps the history); spelled in pieces so
#: this file does not match itself
_HISTORY = re.compile("sess" + "ion|iss" + r"ue ?#?[0-9]+", re.IGNORECASE)
_PRODUCT_DIRS = ("varpack", "tests", "benchmarks", "scripts", "docs")


def _history_mentions(root: Path) -> list[str]:
    hits = []
    for folder in _PRODUCT_DIRS:
        for path in sorted((root / folder).rglob("*")):
            if not path.is_file() or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text()
            except (UnicodeDecodeError, OSError):
                continue  # binary files (archives, images)
            for i, line in enumerate(text.splitlines(), 1):
                if _HISTORY.search(line):
                    hits.append(f"{path.relative_to(root)}:{i}: {line.strip()[:120]}")
    return hits


def test_code_speaks_of_the_product_not_its_history():
    """No work-history words (the pattern above) in code, tests, benchmarks, scripts or docs: a decision cites what was
    measured and the command to repeat it (benchmarks/RESULTS.md)."""
    assert _history_mentions(PKG.parent) == []


def test_the_history_check_can_fail(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("tuned in the ninth " + "sess" + "ion\nfine\nsee iss" + "ue 17\n")
    assert [h.split(":")[1] for h in _history_mentions(tmp_path)] == ["1", "3"]
