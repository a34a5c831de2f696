"""benchmarks/trl_user.py: the chats that fill exactly the asked packs, the figures read from a run's printed
logs (window seconds from the stamped lines, real tokens from TRL's cumulative ``num_tokens`` or varpack's
``tokens_per_step``), and the CPU smoke run of all three user runs (TRL's packing, the drop-in, varpack sft)
on the same data: every run trains the same tokens."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import pytest

from benchmarks.trl_user import (
    CONFIGS,
    generated_chats,
    main,
    parse_run,
    run_stamped,
    select_chats,
    token_check,
)
from varpack.data.chat import encode_chat
from varpack.models import load_tokenizer_for
from varpack.plan import plan_packs


def _args(**kw):
    return argparse.Namespace(**{"steps": 4, "logging_steps": 2, "warmup_steps": 2, "packing_length": 100, **kw})


def _bar(n, total=4):
    return f"  {100 * n // total}%|#   | {n}/{total} [00:01<00:01,  1.0s/it]"


def _segments(entries):
    """A run's stamped output: the progress bar at 0 s, then each ``(t, log entry)``."""
    out = [(1.0, "err", _bar(0)), (1.5, "err", _bar(1))]
    for t, e in entries:
        out.append((t, "out", str({k: str(v) for k, v in e.items()})))
    return out


def test_parse_run_trl_and_varpack_logs():
    args = _args()
    # TRL: cumulative num_tokens; windows end at 3.0 s (steps 1-2) and 5.0 s (steps 3-4)
    trl = parse_run(_segments([(3.0, {"loss": 2.0, "num_tokens": 180}), (5.0, {"loss": 1.5, "num_tokens": 370})]),
                    "trl", args)  # fmt: skip
    assert [w["tokens"] for w in trl["windows"]] == [180, 190]
    assert [w["seconds"] for w in trl["windows"]] == [2.0, 2.0]
    assert trl["tokens_per_s"] == pytest.approx(190 / 2.0) and trl["steady_steps"] == 2
    assert trl["time_to_train_s"] == 1.0 and trl["first_step_s"] == pytest.approx(0.5)
    assert trl["total_tokens"] == 370 and trl["fill"] == pytest.approx(370 / 400)
    # varpack: tokens_per_step (window mean) x steps; its own tokens_per_second is kept as a cross-check
    vp = parse_run(_segments([(2.0, {"loss": 2.0, "tokens_per_step": 90, "tokens_per_second": 500}),
                              (6.0, {"loss": 1.5, "tokens_per_step": 95, "tokens_per_second": 50})]),
                   "varpack_trl", args)  # fmt: skip
    assert [w["tokens"] for w in vp["windows"]] == [180, 190]
    assert vp["tokens_per_s"] == pytest.approx(190 / 4.0) and vp["logged_tokens_per_s"] == pytest.approx(50)
    assert vp["warmup_tokens_per_s"] == pytest.approx(180 / 1.0)


def test_parse_run_refuses_logs_it_cannot_count():
    args = _args()
    with pytest.raises(RuntimeError, match="neither num_tokens nor tokens_per_step"):
        parse_run(_segments([(3.0, {"loss": 2.0}), (5.0, {"loss": 1.5})]), "trl", args)
    with pytest.raises(RuntimeError, match="1 log entries with a loss, expected 2"):
        parse_run(_segments([(3.0, {"loss": 2.0, "num_tokens": 180})]), "trl", args)
    with pytest.raises(RuntimeError, match="no training progress bar"):
        parse_run([(3.0, "out", "{'loss': '2.0', 'num_tokens': '180'}")], "trl", args)


def test_token_check_flags_runs_that_trained_other_tokens():
    def rows(b):
        return [{"rounds": [{"config": "trl", "total_tokens": 1000.0, "steady_tokens": 500.0},
                            {"config": "cli", "total_tokens": b, "steady_tokens": 500.0}]}]  # fmt: skip

    assert token_check(rows(1000.0))["agree"]
    bad = token_check(rows(1010.0))  # negative control: 1% more tokens in one run
    assert not bad["agree"] and bad["total_spread"] == pytest.approx(0.01)


def test_select_chats_fills_exactly_the_asked_packs():
    tok = load_tokenizer_for("tiny-qwen3")
    chats = [(json.dumps(c), c) for c in generated_chats(200)]
    lines, info = select_chats(chats, tok, 128, 5, 0.9)
    lengths = np.asarray([encode_chat(json.loads(x)["messages"], tok)["length"] for x in lines])
    assert plan_packs(lengths, 128, strategy="bfd").num_packs == 5 == info["packs_planned"]
    assert info["tokens"] == lengths.sum() > 4 * 128 and info["overlong_skipped"] == 0
    order = [x for x, _ in chats]
    assert [order.index(x) for x in lines] == sorted(order.index(x) for x in lines)  # file order
    _, short = select_chats(chats, tok, 40, 2, 0.9)  # chats over 40 tokens are skipped, never cut
    assert short["overlong_skipped"] > 0 and short["sample_length_max"] <= 40
    with pytest.raises(ValueError, match="not enough for 50 packs"):
        select_chats(chats[:10], tok, 128, 50, 0.9)


def test_run_stamped_stamps_a_segment_when_it_starts():
    # tqdm writes "\r<bar>" and ends the segment only with its next write: the first bar must carry the time
    # it was written, not the time the next one came (the windows' seconds would shift by a step)
    code = ("import sys, time\nsys.stderr.write('\\rA'); sys.stderr.flush(); time.sleep(1.0)\n"
            "sys.stderr.write('\\rB\\n'); print('C')")  # fmt: skip
    rc, segments = run_stamped([sys.executable, "-c", code], {}, 60)
    stamps = {seg: t for t, _, seg in segments}
    assert rc == 0 and set(stamps) == {"A", "B", "C"}
    assert stamps["A"] < stamps["B"]


def test_small_run_three_user_runs_train_the_same_tokens(tmp_path):
    out = tmp_path / "trl_user.json"
    assert main(["--device", "cpu", "--small", "--rounds", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["rows"]}
    assert list(rows) == list(CONFIGS)
    data = res["data"]
    assert data["packs_planned"] == res["args"]["steps"] == 2
    for name, r in rows.items():
        assert "error" not in r, (name, r.get("error"))
        assert r["tokens_per_s"] > 0 and r["time_to_first_step_s"] > 0, name
        assert len(r["windows"]) == 2 and r["steady_steps"] == 1, name
        assert r["total_tokens"] == data["tokens"], name  # one epoch of the selected chats, nothing cut
        assert r["rows_per_epoch"] == 2, name
    assert res["tokens"]["agree"] and res["tokens"]["total_spread"] == 0.0
    trl, drop_in = rows["trl"]["settings"], rows["varpack_trl"]["settings"]
    assert trl["trainer"].endswith("SFTTrainer") and trl["packing"] and trl["padding_free"]
    assert drop_in["trainer"] == "varpack.train.trl.VarpackSFTTrainer"
    assert not drop_in["packing"] and not drop_in["padding_free"]
    assert rows["cli"]["command"].split()[-1] == "--no-save" and rows["cli"]["speed_line"].startswith("speed")
    assert rows["trl"]["vs_best_peer"] == 1.0 and rows["cli"]["vs_cli"] == 1.0
    assert "| trl |" in res["table"]


def test_run_stamped_kills_a_run_past_its_timeout():
    code = "import time\nprint('up', flush=True)\ntime.sleep(120)"
    rc, segments = run_stamped([sys.executable, "-c", code], {}, 3)
    assert rc == -9 and [seg for _, _, seg in segments] == ["up"]
