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


#: the floors of docs/ARCHITECTURE.md, top (high rank) to bottom; a module may import its own floor or lower
FLOOR_RANK = {
    "cli": 9,
    "train": 8,
    "check": 8,
    "integrations": 7,
    "models": 6,
    "attn": 5,
    "ops": 5,
    "loss": 5,
    "collate": 4,
    "data": 3,
    "plan": 3,
    "rope": 2,
    "varlen": 1,
    "schema": 0,
    "_probe": 0,
    "_argtypes": 0,
}
#: the upward imports the floors allow, each inside a function (run time, never at import), with the reason
UPWARD_ALLOWED = {
    # load_model(attn_backend=...) is the one-call convenience that loads and enables a model
    ("varpack.models.load", "varpack.integrations.transformers"),
    # a VL family's prepare() isolates the vision tower (the family knows it is VL; the integration does it)
    ("varpack.models.registry", "varpack.integrations.vision"),
}


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
    bad = []
    for path in SOURCES:
        me = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        floor = me.split(".")[1] if "." in me else None
        if floor not in FLOOR_RANK:
            continue  # the package's __init__ (lazy exports) sits above all
        for name, at_import in _imports(path):
            other = name.split(".")[1]
            if other in FLOOR_RANK and FLOOR_RANK[other] > FLOOR_RANK[floor]:
                if (me, name) in UPWARD_ALLOWED and not at_import:
                    continue
                bad.append(f"{me} -> {name}")
    assert bad == []
