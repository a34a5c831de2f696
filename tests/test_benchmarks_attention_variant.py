"""benchmarks/attention.py --ts-variant: triton_short under another launch config in the same run (CPU parts)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks.attention import parse_ts_variants, ts_config_env
from varpack.attn.triton_short import CONFIG_ENV, active_config


def test_variants_parse_to_named_rows_and_bad_ones_are_refused():
    got = parse_ts_variants(['rows={"lpt": false}', ' big = {"fwd": [128, 64, 8, 2]}'])
    assert got == [
        ("triton_short[rows]", '{"lpt": false}'),
        ("triton_short[big]", ' {"fwd": [128, 64, 8, 2]}'),
    ]
    for bad, match in [
        ('{"lpt": false}', "need NAME=JSON"),
        ('={"lpt": false}', "need NAME=JSON"),
        ('x={"lpt": 1}', "'x'.*lpt must be true or false"),
        ('x={"fwd": [17, 16, 4, 1]}', "'x'.*power of two"),
        ("x=not json", "'x'.*not JSON"),
    ]:
        with pytest.raises(ValueError, match=match):
            parse_ts_variants([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_ts_variants(["a={}", "a={}"])


def test_config_env_is_set_inside_and_restored(monkeypatch):
    monkeypatch.setenv(CONFIG_ENV, '{"mask_free": false}')
    with ts_config_env('{"lpt": false}'):
        assert active_config().lpt is False and active_config().mask_free is True
    assert os.environ[CONFIG_ENV] == '{"mask_free": false}'
    monkeypatch.delenv(CONFIG_ENV)
    with pytest.raises(RuntimeError), ts_config_env('{"lpt": false}'):
        raise RuntimeError("a failing call")
    assert CONFIG_ENV not in os.environ  # restored to unset even when the call raised


def test_variant_row_runs_beside_the_backends_on_the_cpu(tmp_path):
    """--small on the CPU (triton_short interpreted): the variant gets its own row, its config in the note, an
    output checked against the reference; the verdict reads the plain triton_short row only."""
    from varpack.attn import triton_short as ts

    if not ts._triton_interpreted():
        pytest.skip("triton_short runs on the CPU only under TRITON_INTERPRET=1")
    from benchmarks.attention import main

    out = tmp_path / "a.json"
    rc = main(
        ["--device", "cpu", "--small", "--mixes", "short", "--backends", "triton_short", "--no-dense",
         "--ts-variant", 'rows={"lpt": false}', "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    var = rows["triton_short[rows]"]
    assert '"lpt": false' in var["note"] and var["fwd_bwd_ms"] > 0
    assert var["max_abs_diff"] == rows["triton_short"]["max_abs_diff"]  # bitwise-equal outputs, both orders
    assert CONFIG_ENV not in os.environ
