"""The probe-once ``(ok, reason)`` mechanism (varpack._probe) and the floors of the fla path."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from varpack._probe import ProbeOnce, probe_failed, probe_once, reset_probes

ROOT = Path(__file__).resolve().parents[1]


def test_probe_runs_once_per_key_and_resets():
    calls = []

    @probe_once(key=lambda device, dtype: device)
    def probe(device, dtype):
        calls.append((device, dtype))
        return device == "cuda", f"probed {device} {dtype}"

    assert probe("cpu", "f32") == (False, "probed cpu f32")
    assert probe("cpu", "bf16") == (False, "probed cpu f32")  # same key: the cached answer
    assert probe("cuda", "f32") == (True, "probed cuda f32")
    assert calls == [("cpu", "f32"), ("cuda", "f32")]
    assert set(probe.answers()) == {"cpu", "cuda"}
    probe.reset()
    probe("cpu", "f32")
    assert len(calls) == 3
    reset_probes()  # every probe of the process
    assert probe.answers() == {}


def test_probe_errors_become_reasons_or_propagate():
    def broken():
        raise ImportError("libbroken.so: cannot open shared object file")

    answered = ProbeOnce(broken, on_error=probe_failed)
    assert answered() == (False, "probe failed: ImportError: libbroken.so: cannot open shared object file")
    raising = ProbeOnce(broken)
    with pytest.raises(ImportError):
        raising()
    assert raising.answers() == {}  # nothing cached: the next call probes again


def _varpack_imports(path: Path) -> set[str]:
    """Every varpack module a file imports, at module level or inside functions (absolute names)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                found.add(f"{base}.{node.module}" if node.module else base)
            elif node.module and node.module.startswith("varpack"):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("varpack"))
    return found


def test_fla_adapter_is_the_bottom_floor():
    """ops/_fla.py imports no varpack op (the _fla <-> short_conv / gated_delta_rule circle is gone)."""
    imports = _varpack_imports(ROOT / "varpack" / "ops" / "_fla.py")
    assert not {m for m in imports if m.startswith("varpack.ops")}, imports
    assert "varpack.ops._fla" in _varpack_imports(ROOT / "varpack" / "ops" / "short_conv.py")
    assert "varpack.ops.fla_probe" not in _varpack_imports(ROOT / "varpack" / "ops" / "short_conv.py")


@pytest.mark.parametrize(
    "order", [("varpack.ops.short_conv", "varpack.ops._fla"), ("varpack.ops._fla", "varpack.ops.short_conv")]
)
def test_fla_and_short_conv_import_in_either_order(order):
    code = f"import importlib\nfor m in {order!r}: importlib.import_module(m)\n"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
