"""StreamingPackedDataset: every sample exactly once (one process, DataLoader workers, ranks x workers),
resume after k packs, sources (JSONL, datasets, generator function, chats encoded on the fly)."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from torch.utils.data import DataLoader

from varpack.collate import PaddingFreeCollator
from varpack.data.stream import ChatStream, StreamingPackedDataset

L = 64


def encoded_rows(n=300, seed=0):
    """Encoded samples of lengths 0..150 (some empty, some longer than L), token ids tagged by sample."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        length = int(rng.integers(1, 50)) if i % 17 else int(rng.integers(65, 150))
        if i % 53 == 5:
            length = 0
        ids = [i * 1000 + t for t in range(length)]
        rows.append({"input_ids": ids, "labels": [-100] + ids[1:] if length else []})
    return rows


def _ids(packs):
    """[(sample_id, first token, last token + 1)] of every item."""
    out = []
    for pack in packs:
        for s in pack:
            start, stop = s.get("piece_range", (0, s["length"]))
            out.append((s["sample_id"], start, stop))
    return out


def _check_tokens(packs, rows):
    for pack in packs:
        assert sum(s["length"] for s in pack) <= L
        for s in pack:
            start, stop = s.get("piece_range", (0, s["length"]))
            assert list(s["input_ids"]) == rows[s["sample_id"]]["input_ids"][start:stop]
            assert s["labels"][0] == -100


def _items(rows, overflow):
    """[(sample_id, start, stop)] of every sample or piece the overflow policy keeps."""
    out = []
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        if n == 0 or (n > L and overflow == "drop"):
            continue
        if n > L and overflow == "truncate":
            out.append((i, 0, L))
        elif n > L:
            out.extend((i, a, min(a + L, n)) for a in range(0, n, L))
        else:
            out.append((i, 0, n))
    return out


def _expected(rows, overflow):
    """The packed items: those with a supervised token (a 1-token sample or piece has none: its only label is
    the first, never a target)."""
    return sorted(x for x in _items(rows, overflow) if x[2] - x[1] > 1)


@pytest.mark.parametrize("overflow", ["drop", "truncate", "split"])
def test_single_process_every_sample_once(overflow):
    rows = encoded_rows()
    ds = StreamingPackedDataset(rows, packing_length=L, buffer_size=16, overflow=overflow)
    packs = list(ds)
    assert sorted(_ids(packs)) == _expected(rows, overflow)
    _check_tokens(packs, rows)
    s = ds.last_summary
    assert s["finished"] and s["final_packs"] >= 1 and s["num_packs"] == len(packs)
    assert s["overflow"]["empty_ids"] == [i for i, r in enumerate(rows) if not r["input_ids"]]
    over = [i for i, r in enumerate(rows) if len(r["input_ids"]) > L]
    assert s["overflow"]["overlong_ids"] == over
    # the 1-token samples and pieces train nothing: left out, reported by id
    alone = [x for x in _items(rows, overflow) if x[2] - x[1] == 1]
    whole = [i for i, a, b in alone if len(rows[i]["input_ids"]) == 1]
    pieces = [[i, a, b] for i, a, b in alone if len(rows[i]["input_ids"]) > L]
    assert alone and s["overflow"]["unsupervised_ids"] == whole
    assert s["overflow"]["unsupervised_pieces"] == pieces
    assert list(ds) == packs  # a second pass reads the stream again and packs it the same way


def test_dataloader_workers_each_sample_once(tmp_path):
    rows = encoded_rows(400, seed=1)
    path = tmp_path / "rows.jsonl.gz"
    with gzip.open(path, "wt") as fh:
        for i, r in enumerate(rows):
            fh.write(json.dumps(r) + "\n")
            if i % 50 == 0:
                fh.write("\n")  # blank lines are not samples
    ds = StreamingPackedDataset(str(path), packing_length=L, buffer_size=32, overflow="split")
    loader = DataLoader(ds, batch_size=None, num_workers=2)
    packs = list(loader)
    assert sorted(_ids(packs)) == _expected(rows, "split")
    _check_tokens(packs, rows)
    # worker w packed exactly the samples i with i % 2 == w: each worker's leftovers came out at its end
    assert len(packs) == len(list(StreamingPackedDataset(rows, packing_length=L, buffer_size=32,
                                                         overflow="split", rank=0, world_size=2))) + len(
        list(StreamingPackedDataset(rows, packing_length=L, buffer_size=32, overflow="split", rank=1,
                                    world_size=2)))


def test_two_ranks_two_workers_each_sample_once():
    rows = encoded_rows(500, seed=2)

    def gen():  # a generator function: every worker reads the stream from its start
        yield from rows

    seen = []
    per_rank = []
    for rank in range(2):
        ds = StreamingPackedDataset(gen, packing_length=L, buffer_size=8, overflow="truncate", rank=rank,
                                    world_size=2)
        got = _ids(DataLoader(ds, batch_size=None, num_workers=2))
        per_rank.append({sid for sid, _, _ in got})
        seen += got
    assert sorted(seen) == _expected(rows, "truncate")
    assert not per_rank[0] & per_rank[1]
    # shard = rank * workers + worker: rank 0 has the samples i % 4 in {0, 1}
    assert {i % 4 for i in per_rank[0]} == {0, 1} and {i % 4 for i in per_rank[1]} == {2, 3}


def test_datasets_iterable_dataset_with_workers_reads_every_row():
    import datasets

    rows = encoded_rows(200, seed=3)
    hf = datasets.Dataset.from_list(rows).to_iterable_dataset(num_shards=1)
    ds = StreamingPackedDataset(hf, packing_length=L, buffer_size=16, overflow="split")
    packs = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert sorted(_ids(packs)) == _expected(rows, "split")


@pytest.mark.parametrize("k", [0, 1, 7, 40])
def test_resume_after_k_packs(k):
    rows = encoded_rows(300, seed=4)
    kw = dict(packing_length=L, buffer_size=16, overflow="split")
    full = _ids(StreamingPackedDataset(rows, **kw))
    ds = StreamingPackedDataset(rows, **kw)
    it = iter(ds)
    head = [next(it) for _ in range(k)]
    state = json.loads(json.dumps(ds.state_dict()))
    fresh = StreamingPackedDataset(rows, **kw)
    fresh.load_state_dict(state)
    tail = list(fresh)
    got = _ids(head) + _ids(tail)
    assert got == full  # exactly the remaining packs, in the same order
    assert sorted(got) == _expected(rows, "split") and len(set(got)) == len(got)
    _check_tokens(tail, rows)
    assert fresh.last_summary["num_packs"] == len(head) + len(tail)


def test_state_in_the_main_process_while_workers_read_the_stream_is_refused():
    """Read through a DataLoader with 2 workers, the main process's copy of the dataset never iterated:
    state_dict() returned a fresh state (position 0), and resuming from it trained the samples again."""
    rows = encoded_rows(60)
    kw = dict(packing_length=L, buffer_size=8, overflow="split")
    ds = StreamingPackedDataset(rows, **kw)
    it = iter(DataLoader(ds, batch_size=None, num_workers=2))
    head = [next(it) for _ in range(3)]
    assert len({s["sample_id"] for p in head for s in p}) >= 2  # read by the workers
    with pytest.raises(RuntimeError, match=r"DataLoader workers read the stream \(2 pass\(es\) started"):
        ds.state_dict()
    del it
    # negative control: read in this process, the state is this process's and resumes exactly
    full = _ids(StreamingPackedDataset(rows, **kw))
    it = iter(ds)
    mine = [next(it) for _ in range(3)]
    fresh = StreamingPackedDataset(rows, **kw)
    fresh.load_state_dict(json.loads(json.dumps(ds.state_dict())))
    assert _ids(mine) + _ids(fresh) == full


def test_resume_at_the_end_yields_nothing_and_shard_checked():
    rows = encoded_rows(50)
    kw = dict(packing_length=L, buffer_size=16, overflow="split")
    ds = StreamingPackedDataset(rows, **kw)
    list(ds)
    fresh = StreamingPackedDataset(rows, **kw)
    fresh.load_state_dict(ds.state_dict())
    assert list(fresh) == []
    other = StreamingPackedDataset(rows, rank=1, world_size=2, **kw)
    other.load_state_dict(ds.state_dict())
    with pytest.raises(ValueError, match="shard 0 of 1"):
        list(other)


def test_chats_encoded_on_the_fly_equal_encode_chat(tmp_path):
    from varpack.data.chat import encode_chat
    from varpack.data.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3")
    chats = [
        {"messages": [{"role": "user", "content": f"question {i} " * (1 + i % 5)},
                      {"role": "assistant", "content": f"answer {i} " * (1 + i % 7)}]}
        for i in range(40)
    ] + [{"instruction": "add", "input": "1 2", "output": "3"}]  # alpaca rows are converted too
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(c) + "\n" for c in chats))
    ds = StreamingPackedDataset(str(path), tok, packing_length=256, buffer_size=8)
    packs = list(ds)
    by_id = {s["sample_id"]: s for p in packs for s in p}
    assert sorted(by_id) == list(range(len(chats)))
    from varpack.data.formats import row_to_messages

    for i, c in enumerate(chats):
        want = encode_chat(row_to_messages(c, i)[0], tok, sample_id=i)
        assert list(by_id[i]["input_ids"]) == want["input_ids"] and list(by_id[i]["labels"]) == want["labels"]


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_pieces_and_samples_without_a_supervised_token_are_left_out(overflow):
    """A prompt longer than the packing length, truncated / split away from its answer, and a sample whose
    labels are all -100: the stream packed them (packs that train nothing); they are left out and reported."""
    from varpack.plan.report import summary_text

    rows = [
        {"input_ids": list(range(100, 110)), "labels": [-100, *range(101, 110)]},
        {"input_ids": list(range(200, 300)), "labels": [-100] * 90 + list(range(290, 300))},
        {"input_ids": [1, 2, 3], "labels": [-100] * 3},
    ]
    ds = StreamingPackedDataset(rows, packing_length=L, buffer_size=4, overflow=overflow)
    packs = list(ds)
    assert sorted(_ids(packs)) == [(0, 0, 10)] + ([(1, 64, 100)] if overflow == "split" else [])
    ov = ds.last_summary["overflow"]
    assert ov["unsupervised_ids"] == [2] and ov["unsupervised_pieces"] == [[1, 0, L]]
    assert "sample 2, sample 1 [0, 64)" in summary_text(ds.last_summary)


def test_bad_rows_are_named(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"input_ids": [1, 2], "labels": [-100, 2]}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2: sample 1: invalid JSON"):
        list(StreamingPackedDataset(str(path), packing_length=8, buffer_size=4))
    path.write_text(json.dumps({"input_ids": [1, 2], "labels": [-100]}) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: sample 0: 'labels' has 1 entries"):
        list(StreamingPackedDataset(str(path), packing_length=8, buffer_size=4))
    with pytest.raises(ValueError, match="sample 1 is longer than packing_length=8"):
        list(StreamingPackedDataset([{"input_ids": [1], "labels": [-100]},
                                     {"input_ids": list(range(9)), "labels": [-100] * 9}],
                                    packing_length=8, buffer_size=4))
    with pytest.raises(TypeError, match="generator function"):
        ChatStream(iter([{"input_ids": [1], "labels": [-100]}]))
    with pytest.raises(ValueError, match="JSON Lines"):
        (tmp_path / "x.parquet").write_bytes(b"x")
        ChatStream(str(tmp_path / "x.parquet"))


def test_collated_batches_and_reports():
    rows = encoded_rows(120, seed=5)
    reports = []
    ds = StreamingPackedDataset(rows, packing_length=L, buffer_size=16, overflow="split",
                                collator=PaddingFreeCollator(), report_every=5, report_fn=reports.append)
    batches = list(ds)
    for b in batches:
        cu = b["cu_seq_lens_q"].tolist()
        assert cu[0] == 0 and cu[-1] == b["input_ids"].shape[1] <= L
    assert [r["num_packs"] >= 5 * (i + 1) for i, r in enumerate(reports[:-1])] == [True] * (len(reports) - 1)
    assert reports[-1]["finished"] and reports[-1]["num_packs"] == len(batches)


def test_sft_streaming_trains_and_reads_every_sample_once(tmp_path):
    from varpack.models import load_model
    from varpack.train import SFTConfig, build_sft
    from varpack.train.sft import run_sft

    vocab = 512
    rows = [{"input_ids": [(i * 7 + t) % vocab for t in range(n)], "labels": [-100] + [(i * 7 + t) % vocab
             for t in range(1, n)]} for i, n in enumerate([5, 17, 30, 9, 23, 2, 31, 12, 8, 19, 26, 4])]
    kw = dict(
        model="tiny-qwen3", output_dir=str(tmp_path / "out"), packing_length=32, attn_backend="reference",
        save=False, streaming=True, buffer_size=4, max_steps=3,
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
    )

    class Tok:
        pad_token_id = 0

    def model():
        return load_model("tiny-qwen3", vocab_size=vocab, attn_backend="reference")

    run = build_sft(SFTConfig(**kw), model=model(), tokenizer=Tok(), encoded=rows)
    batches = iter(run.trainer.get_train_dataloader())  # endless: pass after pass (repeat=True)
    first_pass = []
    while sum(map(len, first_pass)) < len(rows):
        first_pass.append(list(next(batches)["sample_ids"]))
    seen = [s for b in first_pass for s in b]
    assert sorted(seen) == list(range(len(rows)))  # one pass: every sample once, leftovers included
    second_pass = [list(next(batches)["sample_ids"]) for _ in first_pass]
    assert second_pass == first_pass  # then the stream is read again, the same packs
    lines = []
    run = run_sft(SFTConfig(**kw), print_fn=lines.append, model=model(), tokenizer=Tok(), encoded=rows)
    assert run.trainer.state.global_step == 3 and len(run.history) == 3
    assert all(np.isfinite(h["loss"]) and 0 < h["pack_fill"] <= 1 for h in run.history)
    assert "streaming: bfd over a buffer of 4 samples" in lines[0]


def test_sft_streaming_needs_max_steps():
    from varpack.train import SFTConfig

    with pytest.raises(ValueError, match="max_steps.*streaming needs max_steps >= 1"):
        SFTConfig(streaming=True)
    with pytest.raises(ValueError, match="buffer_size"):
        SFTConfig(streaming=True, max_steps=1, buffer_size=1)


def _sft_rows_and_model(vocab=512):
    from varpack.models import load_model

    rows = [{"input_ids": [(i * 7 + t) % vocab for t in range(n)], "labels": [-100] + [(i * 7 + t) % vocab
             for t in range(1, n)]} for i, n in enumerate([5, 17, 30, 9, 23, 2, 31, 12, 8, 19, 26, 4])]

    class Tok:
        pad_token_id = 0

    return rows, Tok(), lambda: load_model("tiny-qwen3", vocab_size=vocab, attn_backend="reference")


def test_sft_streaming_grad_accum_steps_do_not_straddle_a_pass(tmp_path):
    """A pass of an odd number of packs with grad_accum=2: HF's Trainer, seeing an IterableDataset end in
    the middle of an accumulated step, skips that optimizer step and adds its gradient (divided by its own
    token count) to the next step's. varpack sft repeats the stream inside the dataset, so every optimizer
    step takes exactly grad_accum packs, and the loss of the step after the pass end is a token mean."""
    from varpack.data.stream import StreamingPackedDataset
    from varpack.train import SFTConfig
    from varpack.train.sft import run_sft

    rows, tok, model = _sft_rows_and_model()
    one_pass = list(StreamingPackedDataset(rows, packing_length=40, buffer_size=4))
    assert len(one_pass) % 2 == 1  # the pass ends in the middle of an accumulated step
    steps = len(one_pass) // 2 + 2
    kw = dict(
        model="tiny-qwen3", output_dir=str(tmp_path / "out"), packing_length=40, attn_backend="reference",
        save=False, streaming=True, buffer_size=4, max_steps=steps, grad_accum=2, logging_steps=1,
        lr=1e-9, extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
    )
    run = run_sft(SFTConfig(**kw), print_fn=lambda *a: None, model=model(), tokenizer=tok, encoded=rows)
    assert [h["packs_per_step"] for h in run.history] == [2.0] * steps
    losses = [h["loss"] for h in run.history]  # lr ~0: every step's loss is a token mean near ln(vocab)
    assert max(losses) < 1.2 * min(losses), losses


def test_sft_streaming_empty_stream_is_an_error(tmp_path):
    from varpack.train import SFTConfig
    from varpack.train.sft import run_sft

    rows, tok, model = _sft_rows_and_model()
    kw = dict(
        model="tiny-qwen3", output_dir=str(tmp_path / "out"), packing_length=1, attn_backend="reference",
        save=False, streaming=True, overflow="drop", max_steps=2, extra_training_args={"use_cpu": True},
    )
    with pytest.raises(ValueError, match="planned no pack in a pass"):  # every sample is dropped
        run_sft(SFTConfig(**kw), print_fn=lambda *a: None, model=model(), tokenizer=tok, encoded=rows)
    with pytest.raises(ValueError, match="planned no pack in a pass"):  # no rows
        run_sft(SFTConfig(**kw), print_fn=lambda *a: None, model=model(), tokenizer=tok, encoded=[])


def test_repeat_reads_pass_after_pass_and_refuses_an_empty_shard():
    rows = encoded_rows(40, seed=3)
    once = _ids(StreamingPackedDataset(rows, packing_length=L, buffer_size=8, overflow="split"))
    ds = StreamingPackedDataset(rows, packing_length=L, buffer_size=8, overflow="split", repeat=True)
    it = iter(ds)
    n = len(list(StreamingPackedDataset(rows, packing_length=L, buffer_size=8, overflow="split")))
    assert _ids([next(it) for _ in range(n)]) == once and _ids([next(it) for _ in range(n)]) == once
    with pytest.raises(ValueError, match="planned no pack"):
        next(iter(StreamingPackedDataset([], packing_length=L, repeat=True)))


def test_report_names_overlong_and_left_out_samples_with_file_line(tmp_path):
    """As the planned run's report: an overlong sample and a sample without a supervised token read from a file
    are named with their FILE:LINE; samples given as rows (no file) are named by id only."""
    from varpack.plan.report import summary_text

    rows = [
        {"input_ids": list(range(100, 110)), "labels": [-100, *range(101, 110)]},
        {"input_ids": list(range(200, 300)), "labels": [-100, *range(201, 300)]},
        {"input_ids": [1, 2, 3], "labels": [-100] * 3},
    ]
    path = tmp_path / "long.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = StreamingPackedDataset(str(path), packing_length=L, buffer_size=4, overflow="truncate")
    list(ds)
    text = summary_text(ds.last_summary)
    assert ds.last_summary["locations"] == {"1": f"{path}:2", "2": f"{path}:3"}  # the path as given
    assert f"sample 1: 100 tokens ({path}:2)" in text and f"({path}:3)" in text, text
    in_memory = StreamingPackedDataset(rows, packing_length=L, buffer_size=4, overflow="truncate")
    list(in_memory)
    assert "locations" not in in_memory.last_summary
