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


def test_round_order_varies_first_last_and_neighbours():
    from benchmarks.attention import round_order

    assert [round_order(2, r) for r in range(4)] == [[0, 1], [1, 0], [1, 0], [0, 1]]
    orders = [round_order(5, r) for r in range(4)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert len({o[0] for o in orders}) >= 3 and len({o[-1] for o in orders}) >= 3
    # the configuration right before 0 is not always the same one
    before = {o[o.index(0) - 1] if o.index(0) else None for o in orders}
    assert len(before) >= 2


def test_rounds_time_every_config_in_varied_order_and_report_the_median(monkeypatch, tmp_path):
    """--rounds 3 (CPU, a fake clock): one untimed pass over the compared configurations first (kept as
    ``*_first``), then three rounds in :func:`round_order`; a row's figure is the median of its rounds. The padded
    reference is timed once, after the rounds."""
    import benchmarks.attention as A

    calls: list[tuple[int, bool]] = []  # (timed function id, queued) of every fwd+bwd timing, in order
    ids: dict[int, int] = {}

    def fake_time_fn(fn, device, *, warmup=3, iters=10, queued=False):
        owner = ids.setdefault(id(fn), len(ids))
        if "fwd_bwd" in getattr(fn, "__qualname__", ""):
            calls.append((owner, queued))
        n = sum(1 for c in calls if c[0] == owner)  # each timing of a function takes longer: rounds differ
        return {"ms": 10.0 * (owner + 1) + n, "min_ms": 0.0, "iters": iters}

    monkeypatch.setattr(A, "time_fn", fake_time_fn)
    out = tmp_path / "r.json"
    rc = A.main(
        ["--device", "cpu", "--small", "--mixes", "short", "--backends", "reference,sdpa", "--no-dense",
         "--no-check", "--rounds", "3", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["reference", "sdpa", "padded_sdpa"]
    for r in rows[:2]:
        assert len(r["fwd_bwd_ms_rounds"]) == 3 and len(r["fwd_ms_synced_rounds"]) == 3
        assert r["fwd_bwd_ms"] == sorted(r["fwd_bwd_ms_rounds"])[1]  # the median of three
        assert r["fwd_bwd_ms_first"] not in r["fwd_bwd_ms_rounds"]  # the cold pass is reported apart
    assert "fwd_bwd_ms_rounds" not in rows[2] and rows[2]["fwd_bwd_ms"] > 0  # the reference: once, afterwards
    queued = [owner for owner, q in calls if q]
    first, rest, padded = queued[:2], queued[2:8], queued[8:]
    assert rest == [first[i] for r in range(3) for i in A.round_order(2, r)]
    assert len(padded) == 1 and padded[0] not in first


def test_rounds_below_one_are_refused(capsys):
    from benchmarks.attention import main

    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--small", "--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err
