"""benchmarks/attention.py: the triton_short verdict (same-run ratios, the target per mix, an
AUTO_TRITON_SHORT row proposed only where triton_short beats auto's pick and the best peer by the margin), the
--ts-variant rows, the rotated rounds, and a --small run on the CPU (triton_short interpreted)."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks._common import round_order
from benchmarks.attention import (
    PROPOSE_MARGIN,
    main,
    parse_ts_variants,
    triton_short_verdict,
    ts_config_env,
    verdict_lines,
)
from varpack.attn.triton_short import CONFIG_ENV, active_config


def _rows(mix, speeds, auto_note="-> torch_varlen", errs=None):
    rows = []
    for impl, tf in speeds.items():
        row = {
            "mix": mix,
            "H": 16,
            "Hkv": 4,
            "D": 128,
            "impl": impl,
            "note": auto_note if impl == "auto" else "",
        }
        if tf is None:
            row["error"] = "RuntimeError: boom"
        else:
            row["fwd_bwd_tflops"] = tf
            err = (errs or {}).get(impl, 2e-3)
            if err is not None:
                row["max_abs_diff"] = err
        rows.append(row)
    return rows


MIXES = {"short": {"mean": 74.2, "max": 128}, "lognormal": {"mean": 207.0, "max": 1633}}


def test_short_mix_target_met_and_row_proposed():
    rows = _rows(
        "short",
        {"flash_attn_4": 24.1, "torch_varlen": 27.8, "flex": 15.8, "triton_short": 60.0, "auto": 27.8},
    )
    (v,) = triton_short_verdict(rows, MIXES)
    assert v["best_peer"] == "torch_varlen" and abs(v["vs_best_peer"] - 60.0 / 27.8) < 1e-9
    assert abs(v["vs_flash_attn_4"] - 60.0 / 24.1) < 1e-9 and v["target_met"] is True
    assert (
        v["propose"] == "TritonShortRule(max_seqlen=128, max_mean_seqlen=74, training=True, head_dims=(128,))"
    )
    (line,) = verdict_lines([v])
    assert "MET" in line and "propose AUTO_TRITON_SHORT row" in line


def test_target_needs_both_the_ratio_and_the_floor():
    rows = _rows("short", {"torch_varlen": 20.0, "triton_short": 50.0, "auto": 20.0})  # 2.5x, but < 56
    (v,) = triton_short_verdict(rows, MIXES)
    assert v["vs_best_peer"] >= 2 and v["target_met"] is False
    assert "propose" in v  # a same-run win still proposes a row; the target is a separate question


def test_small_lead_or_a_loss_proposes_nothing():
    near = _rows(
        "lognormal", {"flash_attn_4": 135.0, "triton_short": 135.0 * (PROPOSE_MARGIN - 0.01), "auto": 135.0}
    )
    (v,) = triton_short_verdict(near, MIXES)
    assert "propose" not in v and v["target_met"] is False and v["vs_flash_attn_4"] < 1.05
    beats_peer_not_auto = _rows(
        "lognormal",
        {"torch_varlen": 100.0, "triton_short": 140.0, "auto": 139.0},
        auto_note="-> flash_attn_4",
    )
    (w,) = triton_short_verdict(beats_peer_not_auto, MIXES)
    assert "propose" not in w  # auto's pick (FA4 here) is as fast: no row
    assert "no AUTO_TRITON_SHORT row" in verdict_lines([w])[0]


def test_no_verdict_without_a_triton_short_measurement():
    assert triton_short_verdict(_rows("short", {"torch_varlen": 28.0, "auto": 28.0}), MIXES) == []
    assert triton_short_verdict(_rows("short", {"torch_varlen": 28.0, "triton_short": None}), MIXES) == []


def test_a_wrong_or_unchecked_output_meets_no_target_and_proposes_nothing():
    speeds = {"flash_attn_4": 24.1, "torch_varlen": 27.8, "triton_short": 60.0, "auto": 27.8}
    (ok,) = triton_short_verdict(_rows("short", speeds, errs={"flash_attn_4": 4e-3}), MIXES)
    assert ok["exact"] is True and ok["target_met"] is True and "propose" in ok  # 2e-3 <= 2 * 4e-3
    (bad,) = triton_short_verdict(_rows("short", speeds, errs={"triton_short": 0.5}), MIXES)
    assert bad["exact"] is False and bad["target_met"] is False and "propose" not in bad
    (line,) = verdict_lines([bad])
    assert "output WRONG" in line and "not met" in line and "no AUTO_TRITON_SHORT row" in line
    (unchecked,) = triton_short_verdict(_rows("short", speeds, errs={"triton_short": None}), MIXES)
    assert unchecked["exact"] is None and unchecked["target_met"] is False and "propose" not in unchecked
    assert "NOT checked" in verdict_lines([unchecked])[0]


def test_synced_verdict_reads_the_synced_speeds():
    """queued and synced timings of one run give separate verdicts: met on one, not on the other."""
    rows = _rows("short", {"torch_varlen": 28.0, "triton_short": 60.0, "auto": 28.0})
    synced = {"torch_varlen": 27.0, "triton_short": 50.0, "auto": 27.0}
    for row in rows:
        row["fwd_bwd_tflops_synced"] = synced[row["impl"]]
    (queued,) = triton_short_verdict(rows, MIXES)
    (slow,) = triton_short_verdict(rows, MIXES, timing="synced")
    assert queued["target_met"] and queued["timing"] == "queued"
    assert not slow["target_met"] and slow["triton_short"] == 50.0 and slow["timing"] == "synced"
    assert "(synced)" in verdict_lines([slow])[0]


def test_unknown_timing_refused():
    with pytest.raises(ValueError, match="timing"):
        triton_short_verdict([], MIXES, timing="wall")


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
    assert [round_order(2, r) for r in range(4)] == [[0, 1], [1, 0], [1, 0], [0, 1]]
    orders = [round_order(5, r) for r in range(4)]
    assert all(sorted(o) == list(range(5)) for o in orders)
    assert len({o[0] for o in orders}) >= 3 and len({o[-1] for o in orders}) >= 3
    # the configuration right before 0 is not always the same one
    before = {o[o.index(0) - 1] if o.index(0) else None for o in orders}
    assert len(before) >= 2


def test_rounds_time_every_config_in_varied_order_and_report_the_median(monkeypatch, tmp_path):
    """--rounds 3 (CPU, a fake clock): one untimed pass over the compared configurations first (kept as
    ``*_first``), then three rounds in :func:`round_order`; a row's figure is the median of its rounds. The
    padded reference is timed once, after the rounds."""
    import benchmarks.attention as A

    calls: list[tuple[int, bool]] = []  # (timed function's number, queued) of every fwd+bwd timing, in order
    seen: list = []  # every timed function, kept alive: a freed function's id() can be reused by the next one

    def fake_time_fn(fn, device, *, warmup=3, iters=10, queued=False):
        owner = next((i for i, f in enumerate(seen) if f is fn), None)
        if owner is None:
            owner = len(seen)
            seen.append(fn)
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
    assert rest == [first[i] for r in range(3) for i in round_order(2, r)]
    assert len(padded) == 1 and padded[0] not in first


def test_rounds_below_one_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--small", "--rounds", "0"])
    assert "--rounds must be >= 1, got 0" in capsys.readouterr().err


def test_small_run_on_the_cpu_with_the_references(tmp_path, capsys):
    """--small on the CPU (triton_short, interpreted, is run by the variant test above): the backends, auto,
    the padded and dense references, each output checked against the reference (a backend that mixed documents
    would show a large max|d|); a backend that cannot run the call is a row naming why, not a failed run."""
    out = tmp_path / "attention.json"
    argv = [
        "--device",
        "cpu",
        "--small",
        "--mixes",
        "short,uniform512",
        "--backends",
        "reference,sdpa,flex,auto",
    ]
    assert main([*argv, "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    rows = {(r["mix"], r["impl"]): r for r in data["rows"]}
    assert {impl for _, impl in rows} == {"reference", "sdpa", "flex", "auto", "padded_sdpa", "dense_cudnn"}
    for (mix, impl), r in rows.items():
        if impl == "flex" and "error" in r:  # torch refuses FlexAttention's backward on the CPU
            assert "no backward on the CPU" in r["error"]
            continue
        assert "error" not in r, (mix, impl, r.get("error"))
        assert r["fwd_bwd_ms"] > 0 and r["fwd_bwd_ms_synced"] > 0
        if impl != "dense_cudnn":
            assert r["max_abs_diff"] < 1e-4, (mix, impl)
    assert data["machine"]["commit"] and data["args"]["small"] is True
    assert "| short | 4/2 |" in capsys.readouterr().out
