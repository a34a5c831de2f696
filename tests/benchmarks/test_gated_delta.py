"""benchmarks/gated_delta.py --small: varpack's chunk path against the per-sequence loop on the same packed
inputs (equal outputs up to fp32 rounding), fla reported where it cannot run."""

from __future__ import annotations

import json

from benchmarks.gated_delta import main, mix_lengths


def test_mixes_fill_the_row():
    assert mix_lengths("4x256", 1024) == [256] * 4
    assert sum(mix_lengths("lognormal", 1024, mu=4.0)) == 1024


def test_small_run_chunk_equals_the_loop(tmp_path):
    out = tmp_path / "gd.json"
    assert (
        main(
            [
                "--small",
                "--mixes",
                "4x256",
                "lognormal",
                "--methods",
                "loop",
                "chunk",
                "fla",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    rows = {(r["mix"], r["method"]): r for r in json.loads(out.read_text())["rows"]}
    for mix in ("4x256", "lognormal"):
        chunk = rows[(mix, "chunk")]
        assert chunk["err"] < 1e-4 and chunk["fwd"] > 0 and chunk["fb"] > 0 and chunk["fb_x"] > 0
        assert rows[(mix, "loop")]["fwd_x"] == 1.0
        assert "fwd" not in rows[(mix, "fla")] and rows[(mix, "fla")]["note"]  # no CUDA here: the reason
