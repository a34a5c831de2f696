"""benchmarks/triton_short_registers.py on the CPU: the kernels compile for sm_90a and ptxas's report is read
-- a register cap given in the config reaches ptxas (registers at most the cap, spills appear) and an uncapped
kernel takes more (the control); the occupancy arithmetic against the sm_90 limits by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_programs_per_sm_by_the_sm90_limits():
    from benchmarks.triton_short_registers import programs_per_sm

    # 255 registers -> 256 per thread x 128 threads = 32,768: 2 programs of 4 warps; 128 -> 4
    assert programs_per_sm(255, 24 * 1024, 4) == {"by_registers": 2, "by_shared": 9}
    assert programs_per_sm(128, 24 * 1024, 4)["by_registers"] == 4
    assert programs_per_sm(121, 0, 4)["by_registers"] == 4  # rounded up to 128
    assert programs_per_sm(32, 0, 1) == {"by_registers": 32, "by_shared": 32}  # the 32-program limit
    assert programs_per_sm(64, 100 * 1024, 16)["by_registers"] == 2  # 2 x 16 warps = 32; registers allow 2


def test_bad_heads_are_refused_by_name():
    from benchmarks.triton_short_registers import main

    for bad in ("16", "16/5", "a/b", "0/4"):
        with pytest.raises(SystemExit):  # argparse's error (exit 2), before anything compiles
            main(["--heads", bad])


def test_report_compiles_for_sm90_and_reads_ptxas(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    rows = {}
    for name, cfg in (("capped", {"maxnreg": {"fwd": 64}}), ("uncapped", {})):  # --small: D = 64, small tiles
        out = tmp_path / f"{name}.json"
        done = subprocess.run(
            [
                sys.executable,
                "benchmarks/triton_short_registers.py",
                "--small",
                "--heads",
                "16/4",
                "--mean",
                "50",
                "--config",
                json.dumps(cfg),
                "--json",
                str(out),
            ],
            env=env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if "no NVIDIA backend" in done.stderr:
            pytest.skip("this Triton has no NVIDIA backend")
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("\n| ") == 4  # header + 3 kernels
        rows[name] = {r["kernel"]: r for r in json.loads(out.read_text())["rows"]}
    capped, uncapped = rows["capped"]["fwd"], rows["uncapped"]["fwd"]
    assert capped["maxnreg"] == 64 and capped["registers"] <= 64 and capped["spill_stores"] > 0
    assert (
        uncapped["maxnreg"] is None and uncapped["registers"] > 64
    )  # the control: the cap made the difference
    assert capped["config"] == [32, 32, 4, 1] and capped["pack_gqa"] is True  # G = 4 packs
    for r in rows["capped"].values():
        assert r["shared"] > 0 and r["by_registers"] >= 1 and r["by_shared"] >= 1


def test_launch_attrs_mark_what_a_launch_would_specialize():
    """Pointers and 16-divisible integers get ``tt.divisibility = 16`` (Triton's launch specialization); the
    GQA group count (4) and integers with no known value stay unmarked; strides follow the tensors'
    layouts."""
    from benchmarks.triton_short_registers import int_values, launch_attrs, signature
    from varpack.attn import _triton_short_kernels as kern

    fn = kern.attn_bwd_dkdv
    pointers = {"Q", "K", "V", "DO", "LSE", "DELTA", "DK", "DV", "DOC_Q", "DOC_K", "LIM", "ORDER"}
    pointers |= {"TILE_LO", "TILE_HI", "FULL_LO", "FULL_HI"}
    sig = signature(
        fn, {n: 0 for n in fn.arg_names if n.isupper() and n not in pointers}
    )  # the rest: constexprs
    values = int_values(fn, heads=16, kv_heads=4, head_dim=128, tokens=65536, pack=True)
    assert values["stride_qt"] == 16 * 128 and values["stride_kt"] == 4 * 128 and values["stride_dkh"] == 128
    assert values["stride_lh"] == 65536 and values["n_heads"] == 4
    attrs = launch_attrs(fn, sig, values)
    marked = {fn.arg_names[i[0]] for i in attrs}
    assert {"Q", "K", "DK", "LSE", "DOC_Q", "stride_qt", "stride_lh", "total_q", "left"} <= marked
    assert not {"n_heads", "qk_scale", "sm_scale"} & marked
    assert all(v == [["tt.divisibility", 16]] for v in attrs.values())
    odd = launch_attrs(fn, sig, dict(values, total_q=65535))
    assert "total_q" not in {fn.arg_names[i[0]] for i in odd}  # not a multiple of 16: left unmarked
