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


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_probe_answer_does_not_depend_on_the_callers_grad_mode(mode):
    """A probe that checks a backward (fla's gated delta rule, short conv) gives the same answer when its
    first caller runs under ``torch.no_grad()`` / ``torch.inference_mode()`` (an evaluation forward): the
    answer is cached for every later caller. Found on the H200: a VL eval forward made fla's probe raise."""
    import torch

    def backward_check():
        x = torch.ones(3, requires_grad=True)
        (g,) = torch.autograd.grad((x * x).sum(), [x])
        return bool(torch.equal(g, 2 * torch.ones(3))), "backward ran"

    probe = ProbeOnce(backward_check)
    ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with ctx:
        assert probe() == (True, "backward ran")
        assert not torch.is_grad_enabled()  # the caller's mode is restored
    if mode == "inference_mode":
        assert not torch.is_inference_mode_enabled()


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


def test_fla_autotune_notice_once_per_device_and_dims_never_on_cpu(monkeypatch, tmp_path):
    import io

    import torch

    from varpack.ops import _fla

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # the shipped results go here, not the user's cache
    monkeypatch.setattr(_fla, "_SHIPPED_INSTALLED", {})
    _fla._NOTICED.clear()
    out = io.StringIO()
    cuda0 = torch.device("cuda", 0)  # a device object only: nothing runs on it
    assert _fla.autotune_notice(cuda0, (2, 4, 64, 64), file=out)
    assert not _fla.autotune_notice(cuda0, (2, 4, 64, 64), file=out)  # same key: silent
    assert _fla.autotune_notice(cuda0, (4, 8, 128, 128), file=out)  # new head shape: said again
    assert not _fla.autotune_notice(torch.device("cpu"), (2, 4, 64, 64), file=out)
    assert _fla.autotune_notice(
        cuda0, (2, 4, 64, 64), what="short conv", dims_name="(D, W)", file=out
    )  # other kernels
    lines = out.getvalue().splitlines()
    assert len(lines) == 3
    assert "(2, 4, 64, 64)" in lines[0] and "autotunes" in lines[0] and "cuda:0" in lines[0]
    assert "gated delta rule" in lines[0] and "short conv" in lines[2] and "(D, W)" in lines[2]
    _fla._NOTICED.clear()


def test_fla_autotune_notice_names_tritons_own_cache_dir(monkeypatch, tmp_path):
    import io

    import torch

    from varpack.ops import _fla

    pytest.importorskip("triton")
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path))
    monkeypatch.setattr(_fla, "_SHIPPED_INSTALLED", {})
    _fla._NOTICED.clear()
    out = io.StringIO()
    assert _fla.autotune_notice(torch.device("cuda", 0), (1, 1, 16, 16), file=out)
    assert str(tmp_path / ".triton" / "cache") in out.getvalue()  # TRITON_HOME honoured, as Triton does
    # the shipped autotune results went to that folder, once per process
    n = len(_shipped()["files"])
    assert f"{n} shipped results installed" in out.getvalue()
    assert len(list((tmp_path / ".triton" / "cache").glob("*/*.autotune.json"))) == n
    assert _fla.autotune_notice(torch.device("cuda", 0), (2, 1, 16, 16), file=out)
    assert out.getvalue().count("shipped results installed") == 1
    _fla._NOTICED.clear()


def _shipped():
    import json

    from varpack.ops import _fla

    return json.loads(_fla.SHIPPED_AUTOTUNE.read_text(encoding="utf-8"))


def test_shipped_autotune_results_are_tritons_files():
    """Each shipped entry is one Triton autotune file as Triton's check_disk_cache reads it: the folder of
    Triton's hash, the kernel's ``.autotune.json``, with ``key`` and ``configs_timings`` (config, timings)."""
    shipped = _shipped()
    assert "Triton" in shipped["stack"] and "fla-core" in shipped["stack"] and shipped["files"]
    for name, content in shipped["files"].items():
        folder, file = name.split("/")
        assert len(folder) >= 32 and folder.isalnum() and file.endswith("_kernel.autotune.json") or file.endswith(
            ".autotune.json"
        ), name
        assert isinstance(content["key"], list) and content["configs_timings"], name
        for config, timings in content["configs_timings"]:
            assert "num_warps" in config and "kwargs" in config and all(t > 0 for t in timings), name


def test_install_shipped_autotune_writes_only_absent_files(tmp_path, monkeypatch):
    import json

    from varpack.ops import _fla

    files = _shipped()["files"]
    assert _fla.install_shipped_autotune(tmp_path) == len(files)
    for name, content in files.items():
        assert json.loads((tmp_path / name).read_text()) == content
    assert _fla.install_shipped_autotune(tmp_path) == 0  # all there
    first = tmp_path / sorted(files)[0]
    first.write_text("{}")  # a result this machine tuned itself: never overwritten
    second = tmp_path / sorted(files)[1]
    second.unlink()
    assert _fla.install_shipped_autotune(tmp_path) == 1
    assert first.read_text() == "{}" and json.loads(second.read_text()) == files[sorted(files)[1]]
    assert not list(tmp_path.glob("*/*.tmp"))
    # opted out: nothing written
    monkeypatch.setenv("VARPACK_FLA_SHIPPED_AUTOTUNE", "0")
    assert _fla.install_shipped_autotune(tmp_path / "other") == 0 and not (tmp_path / "other").exists()


def test_install_shipped_autotune_refuses_a_path_outside_the_cache(tmp_path, monkeypatch):
    import json

    from varpack.ops import _fla

    bad = tmp_path / "shipped.json"
    bad.write_text(json.dumps({"stack": "x", "files": {"../escape/k.autotune.json": {"key": []}}}))
    monkeypatch.setattr(_fla, "SHIPPED_AUTOTUNE", bad)
    with pytest.raises(ValueError, match="is not <folder>/<kernel>.autotune.json"):
        _fla.install_shipped_autotune(tmp_path / "cache")
    assert not (tmp_path / "escape").exists()
