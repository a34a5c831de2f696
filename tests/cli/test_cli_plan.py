from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest

from varpack.cli.main import main
from varpack.plan import PackPlan


def _chats(n: int, long_id: int | None = None) -> list[dict]:
    rows = []
    for i in range(n):
        words = " ".join(f"word{j}" for j in range(3 + 4 * i))
        answer = "ok " * (400 if i == long_id else 2 + i)
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": f"Question {i}: {words}"},
                    {"role": "assistant", "content": answer.strip()},
                ]
            }
        )
    return rows


def _write(tmp_path, rows, name="chats.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer():
    from varpack.cli.plan import _tokenizer

    return _tokenizer("qwen3")  # the embedded tokenizer, loaded once and shared with the CLI calls


def _template_lengths(tokenizer, rows) -> list[int]:
    # independent of varpack.data.chat: the chat template's own token count
    out = []
    for r in rows:
        ids = tokenizer.apply_chat_template(r["messages"], tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        out.append(len(ids))
    return out


def test_plan_json_and_report(tmp_path, capsys, tokenizer):
    rows = _chats(12)
    data = _write(tmp_path, rows)
    png = tmp_path / "out" / "report.png"
    rc = main(["plan", str(data), "--packing-length", "256", "--json", "--report", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    summary = json.loads(out)  # stdout holds exactly one JSON object
    assert out.strip().count("\n") == 0
    lengths = _template_lengths(tokenizer, rows)
    assert summary["num_samples"] == 12
    assert summary["total_tokens"] == sum(lengths) == summary["input_tokens"]
    assert summary["lower_bound_packs"] == math.ceil(sum(lengths) / 256)
    assert summary["lower_bound_packs"] <= summary["num_packs"] <= 12
    assert summary["fill_ratio"] == pytest.approx(sum(lengths) / (summary["num_packs"] * 256))
    assert summary["overflow"]["policy"] == "error" and summary["overflow"]["overlong_ids"] == []
    assert summary["strategy"] == "bfd"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from PIL import Image

    with Image.open(png) as im:
        assert im.size[0] > 600 and im.size[1] > 300


def test_plan_table(tmp_path, capsys):
    data = _write(tmp_path, _chats(5))
    rc = main(["plan", str(data), "--packing-length", "512", "--packing-strategy", "sequential"])
    assert rc == 0
    out = capsys.readouterr().out
    for word in ("samples", "packs", "lower bound", "fill", "overflow", "sequential"):
        assert word in out


def test_plan_overlong_error_then_split(tmp_path, capsys, tokenizer):
    rows = _chats(6, long_id=4)
    data = _write(tmp_path, rows)
    lengths = _template_lengths(tokenizer, rows)
    assert lengths[4] > 256 and max(lengths[:4] + lengths[5:]) <= 256
    rc = main(["plan", str(data), "--packing-length", "256", "--json"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == ""
    assert f"4: {lengths[4]}" in captured.err and "--packing-length 256" in captured.err

    saved = tmp_path / "plan.npz"
    rc = main(
        ["plan", str(data), "--packing-length", "256", "--json", "--overflow", "split", "--save", str(saved)]
    )
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["overflow"]["split_ids"] == [4]
    assert summary["overflow"]["num_pieces"] == math.ceil(lengths[4] / 256)
    assert summary["total_tokens"] == sum(lengths)
    plan = PackPlan.load(saved, lengths=np.array(lengths))
    assert plan.num_packs == summary["num_packs"]


@pytest.mark.parametrize("policy", ["truncate", "split", "drop"])
def test_plan_json_counts_each_overlong_sample_once(policy, tmp_path, capsys, tokenizer):
    """A fresh user's question: does ``--overflow truncate --json`` count a truncated sample as extra pieces?
    No: a truncated sample is one packed item (its kept prefix, which the plan stores as one piece, so
    ``num_pieces == num_truncated``); only ``split`` makes several. Every sample is counted once: packed whole,
    or dropped / truncated / split under the policy named, and every input token is packed or dropped."""
    rows = _chats(6, long_id=4)
    lengths = _template_lengths(tokenizer, rows)
    assert lengths[4] > 256 and max(lengths[:4] + lengths[5:]) <= 256
    data = _write(tmp_path, rows)
    rc = main(["plan", str(data), "--packing-length", "256", "--overflow", policy, "--json"])
    s = json.loads(capsys.readouterr().out)
    assert rc == 0 and s["overflow_policy"] == s["overflow"]["policy"] == policy
    whole = s["num_items"] - s["num_pieces"]
    assert whole == 5 and s["num_overlong"] == 1
    outcomes = s["num_dropped"] + s["num_truncated"] + s["num_split"] + s["num_empty"]
    assert whole + outcomes == s["num_samples"] == 6
    assert s["total_tokens"] + s["tokens_dropped"] == s["input_tokens"] == sum(lengths)
    expected = {  # policy -> (items, pieces, dropped, truncated, split, tokens dropped)
        "truncate": (6, 1, 0, 1, 0, lengths[4] - 256),
        "split": (5 + math.ceil(lengths[4] / 256), math.ceil(lengths[4] / 256), 0, 0, 1, 0),
        "drop": (5, 0, 1, 0, 0, lengths[4]),
    }[policy]
    counts = ("num_items", "num_pieces", "num_dropped", "num_truncated", "num_split", "tokens_dropped")
    assert tuple(s[k] for k in counts) == expected, s


def test_plan_missing_file(tmp_path, capsys):
    rc = main(["plan", str(tmp_path / "nope.jsonl"), "--json"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == "" and "nope.jsonl" in captured.err


def test_plan_builtin_data(capsys):
    pytest.importorskip("varpack.data.builtin")
    from varpack.data.builtin import builtin_chats

    rc = main(["plan", "--json", "--packing-length", "8192", "--overflow", "split"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == len(builtin_chats())
    assert summary["data"] == "builtin"


def test_plan_routes_image_chats(tmp_path, capsys):
    pytest.importorskip("PIL")
    pytest.importorskip("skimage")
    vl = pytest.importorskip("varpack.data.vl_builtin")
    path = vl.write_vl_jsonl(tmp_path / "vl.jsonl", limit=3)
    rc = main(["plan", str(path), "--packing-length", "4096", "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["num_samples"] == len(vl.builtin_vl_chats(limit=3))
    # a budget far below the image spans: split pieces would cut images -> refused, not silently planned
    rc = main(["plan", str(path), "--packing-length", "40", "--overflow", "split", "--json"])
    captured = capsys.readouterr()
    assert rc == 1 and captured.out == "" and "cut through an image" in captured.err


def test_plan_preference_pairs_with_objective_dpo(tmp_path, capsys, monkeypatch):
    """`varpack plan --objective dpo` plans preference data as `varpack sft --objective dpo` does (pair k =
    samples 2k, 2k + 1, both in one pack) and reports the pairs; without it the data is refused, pointing there;
    an overlong pair is named as a pair."""
    rows = [
        {"prompt": f"Question {i}?", "chosen": "yes " * (1 + 5 * i), "rejected": "no " * (1 + i)} for i in range(5)
    ]
    monkeypatch.chdir(tmp_path)  # a short path: the table's rows are not wrapped
    path = _write(tmp_path, rows, "pairs.jsonl").name
    assert main(["plan", path]) == 1
    assert "'varpack plan --objective dpo'" in capsys.readouterr().err
    saved = tmp_path / "pairs.npz"
    argv = ["plan", path, "--objective", "dpo", "--packing-length", "96"]
    assert main([*argv, "--json", "--save", str(saved)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["objective"] == "dpo" and summary["preference_pairs"] == 5 and summary["num_samples"] == 10
    plan = PackPlan.load(saved)
    for pack in plan.packs:
        ids = sorted(pack.tolist())
        assert ids[0::2] == [i for i in ids[0::2] if i % 2 == 0] and ids[1::2] == [i + 1 for i in ids[0::2]]
    assert sorted(i for p in plan.packs for i in p.tolist()) == list(range(10))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "5 preference pairs, each in one pack" in out and "pairs.jsonl" in out
    assert main([*argv[:-1], "40"]) == 1  # pair 4 (its chosen answer: 21 words) does not fit 40 tokens
    assert "pair(s) are longer than --packing-length 40 together (pair id: tokens): " in capsys.readouterr().err


def test_overlong_samples_are_named_with_file_and_line(tmp_path, capsys, tokenizer):
    """An overlong sample was named by its id only (``2: 412``), an index the user cannot look up in a file with
    blank lines or several files: the error of --overflow error, the report (table, --json, varpack sft's
    packing report) and the streaming error now also name its FILE:LINE."""
    first = tmp_path / "first.jsonl"
    first.write_text(json.dumps(_chats(1)[0]) + "\n\n")  # a blank line: sample ids and lines differ
    rows = _chats(6, long_id=4)
    data = _write(tmp_path, rows)
    where = f"{data}:5"  # sample 5 overall = rows[4], line 5 of the second file
    lengths = _template_lengths(tokenizer, rows)
    n = lengths[4]
    rc = main(["plan", str(first), str(data), "--packing-length", "256"])
    err = capsys.readouterr().err.splitlines()[-1]
    assert rc == 1 and f"(sample_id: length): 5: {n} ({where}); raise" in err, err
    rc = main(["plan", str(first), str(data), "--packing-length", "256", "--overflow", "drop", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert rc == 0 and summary["overflow"]["overlong_ids"] == [5] and summary["locations"] == {"5": where}
    from varpack.plan.report import summary_text

    assert f"  overlong  sample 5: {n} tokens ({where})" in summary_text({**summary, "data": "x"}).splitlines()
    import io

    from rich.console import Console

    from varpack.plan.report import summary_table

    out = io.StringIO()
    Console(file=out, width=400).print(summary_table(summary))  # the table of `varpack plan`, rows unwrapped
    row = rf"│ overlong +│ +sample 5: {n} tokens \({re.escape(where)}\) │"
    assert re.search(row, out.getvalue()), out.getvalue()
    # negative control: the locations follow the files (the same rows alone: sample 4, line 5)
    rc = main(["plan", str(data), "--packing-length", "256", "--overflow", "drop", "--json"])
    assert json.loads(capsys.readouterr().out)["locations"] == {"4": where}
    # varpack sft: the same error; streaming: the sample's FILE:LINE
    argv = ["sft", "--model", "tiny-qwen3", "--data", str(first), str(data), "--packing-length", "256",
            "--max-steps", "1", "--no-save", "--output-dir", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 1
    assert f"5: {n} ({where}); raise" in capsys.readouterr().err.splitlines()[-1]
    from varpack.data.stream import StreamingPackedDataset

    with pytest.raises(ValueError, match=rf"^{re.escape(where)}: sample 5 is longer than packing_length=256 "):
        list(StreamingPackedDataset([str(first), str(data)], tokenizer, packing_length=256, buffer_size=4))


def test_plan_takes_data_paths_on_both_sides_of_a_flag(tmp_path, capsys):
    """``varpack plan a.jsonl --json b.jsonl`` plans both files (argparse alone left b.jsonl unrecognized), the
    same as with both paths first; an unknown flag among them is still an error (the control)."""
    first = _write(tmp_path, _chats(3), "a.jsonl")
    second = _write(tmp_path, _chats(4), "b.jsonl")
    assert main(["plan", str(first), "--json", str(second), "--packing-length", "4096"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert main(["plan", str(first), str(second), "--json", "--packing-length", "4096"]) == 0
    together = json.loads(capsys.readouterr().out)
    assert split["num_samples"] == together["num_samples"] == 7
    assert main(["plan", str(first), "--bogus", str(second)]) == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_plan_takes_data_as_sft_does(tmp_path, capsys):
    """``varpack plan --data a.jsonl b.jsonl`` (the form ``varpack sft`` and ``varpack check`` take) plans the
    same samples as ``varpack plan a.jsonl b.jsonl``; a missing file named by --data is still refused."""
    first = _write(tmp_path, _chats(3), "a.jsonl")
    second = _write(tmp_path, _chats(4), "b.jsonl")
    assert main(["plan", "--data", str(first), str(second), "--json"]) == 0
    flag = json.loads(capsys.readouterr().out)
    assert main(["plan", str(first), str(second), "--json"]) == 0
    positional = json.loads(capsys.readouterr().out)
    assert flag["num_samples"] == positional["num_samples"] == 7 and flag["data"] == positional["data"]
    assert main(["plan", "--data", str(tmp_path / "missing.jsonl")]) != 0
    assert "missing.jsonl" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["plan", "check", "sft"])
def test_a_repeated_data_flag_adds_its_files(command):
    """``--data a --data b`` names both files in every command (argparse's plain store kept only the last list:
    the first file's samples were dropped without a word)."""
    from varpack.cli.main import build_parser

    args, _ = build_parser().parse_known_args([command, "--data", "a.jsonl", "--data", "b.jsonl", "c.jsonl"])
    files = args.data_option if command == "plan" else args.data
    assert list(files) == ["a.jsonl", "b.jsonl", "c.jsonl"]


def test_plan_repeated_data_plans_every_file(tmp_path, capsys):
    first = _write(tmp_path, _chats(3), "a.jsonl")
    second = _write(tmp_path, _chats(4), "b.jsonl")
    assert main(["plan", "--data", str(first), "--data", str(second), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_samples"] == 7
