"""`varpack sft` / training: CLI end to end, sampler and epoch order, gradient accumulation semantics."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests import _launch as launch
from varpack.models import load_model
from varpack.train import SFTConfig, build_sft

VOCAB = 512


def synthetic_samples(n=12, seed=0):
    """Encoded samples (input_ids, labels, length) of odd lengths 1..23, a prompt part unsupervised."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 1 + (7 * i + 3) % 23
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        labels = [-100] * max(1, length // 3) + ids[max(1, length // 3) :]
        out.append({"input_ids": ids, "labels": labels[:length], "length": length})
    return out


class _Tok:
    """The few tokenizer attributes build_sft needs when samples are pre-encoded."""

    pad_token_id = 0

    def save_pretrained(self, path):
        return None


def _build(tmp_path, **cfg):
    kw = dict(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        save=False,
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
    )
    kw.update(cfg)
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    return build_sft(SFTConfig(**kw), model=model, tokenizer=_Tok(), encoded=synthetic_samples())


def test_report_names_samples_passed_in(tmp_path):
    """build_sft(encoded=...): the packing report says the samples were given (not the built-in chats, nor
    config.data, which is not read)."""
    run = _build(tmp_path)
    data = [line for line in run.report.splitlines() if line.strip().startswith("data")]
    assert data and "given samples" in data[0] and "built-in" not in run.report, run.report
    dpo = _build(tmp_path / "dpo", objective="dpo", packing_length=64, data=("not-read.jsonl",))
    line = next(line for line in dpo.report.splitlines() if line.strip().startswith("data"))
    assert "given samples (6 preference pairs, each in one pack)" in line and "not-read" not in line, line


def test_sampler_visits_every_pack_once_per_epoch_in_plan_order(tmp_path):
    run = _build(tmp_path, packs_per_step=1)
    loader = run.trainer.get_train_dataloader()
    for epoch in (0, 1):
        loader.set_epoch(epoch)  # what Trainer does before each epoch (and PackEpochCallback)
        run.trainer.pack_sampler.set_epoch(epoch)  # Trainer reaches the batch sampler itself
        seen = [tuple(b["sample_ids"]) for b in loader]
        expected = [tuple(run.plan.pack(p).tolist()) for p in run.plan.pack_order(epoch)]
        assert seen == expected
        ids = sorted(s for pack in seen for s in pack)
        assert ids == list(range(run.plan.num_samples))  # every sample exactly once
    assert run.dataset.epoch == 1
    assert not torch.equal(torch.as_tensor(run.plan.pack_order(0)), torch.as_tensor(run.plan.pack_order(1)))


def test_ranks_get_disjoint_shares(tmp_path):
    """accelerate's own sharding of sequential batches of packs (rank r takes batches r, r+W, ...), which
    planned runs replace by BalancedPackSampler (tests/train/test_rank_balance.py): it may repeat a pack."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler, SequentialSampler

    run = _build(tmp_path)
    n = len(run.dataset)
    shares = []
    for rank in range(2):
        shard = BatchSamplerShard(
            BatchSampler(SequentialSampler(run.dataset), 1, False), num_processes=2, process_index=rank
        )
        shares.append([i for batch in shard for i in batch])
    assert set(shares[0]) | set(shares[1]) == set(range(n))
    overlap = set(shares[0]) & set(shares[1])
    assert len(overlap) <= 1  # even_batches may repeat at most W - 1 = 1 pack in the last step


def test_boundaries_stay_on_the_host(tmp_path):
    """accelerate's device placement moves the batch's tensors but leaves its VarlenMeta alone: the CPU
    offsets (validated once, at collate time) reach the model with the batch."""
    from accelerate.utils import send_to_device

    from varpack.varlen import VarlenMeta

    run = _build(tmp_path)
    batch = next(iter(run.trainer.get_train_dataloader()))
    assert isinstance(batch["varlen_meta"], VarlenMeta)
    moved = send_to_device(batch, "meta")
    assert moved["input_ids"].device.type == "meta"
    meta = moved["varlen_meta"]
    assert meta is batch["varlen_meta"]
    assert meta.cu_seqlens_q.device.type == "cpu" and meta.cu_seqlens_q.dtype == torch.int32
    assert meta.total_q == batch["input_ids"].shape[1] and int(meta.cu_seqlens_q[-1]) == meta.total_q
    # the moved kwargs are the meta's view (same entries): accepted by the guard without a host read
    from varpack.varlen import varlen_meta_from_kwargs

    assert varlen_meta_from_kwargs(moved, meta.total_q, "test") is meta


def test_epoch_callback_sets_dataset_epoch(tmp_path):
    from varpack.train import PackEpochCallback

    run = _build(tmp_path)
    cb = next(c for c in run.trainer.callback_handler.callbacks if isinstance(c, PackEpochCallback))

    class State:
        epoch = 2.0

    cb.on_epoch_begin(None, State(), None)
    assert run.dataset.epoch == 2


def _step_delta(tmp_path, name, **cfg):
    run = _build(tmp_path / name, max_steps=1, lr=1.0, **cfg)
    before = {n: p.detach().clone() for n, p in run.model.named_parameters()}
    run.trainer.train()
    return {n: p.detach() - before[n] for n, p in run.model.named_parameters()}, run


@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_gradient_accumulation_equals_one_big_batch(tmp_path, reduction):
    """One SGD step over packs {a, b} as ONE row == as 2 accumulation micro-batches (num_items_in_batch)."""
    big, run_big = _step_delta(tmp_path, "big", packs_per_step=2, grad_accum=1, loss_reduction=reduction)
    acc, run_acc = _step_delta(tmp_path, "acc", packs_per_step=1, grad_accum=2, loss_reduction=reduction)
    assert run_big.trainer.loss_impl_used == run_acc.trainer.loss_impl_used == "linear_ce"
    worst = max((big[n] - acc[n]).abs().max().item() for n in big)
    scale = max(big[n].abs().max().item() for n in big)
    assert scale > 1e-4 and worst <= 1e-6 + 1e-5 * scale
    # and the loss logged for the step is the same global mean
    assert run_big.trainer.state.log_history[0]["loss"] == pytest.approx(
        run_acc.trainer.state.log_history[0]["loss"], rel=1e-5
    )


def test_linear_ce_and_logits_give_the_same_step(tmp_path):
    a, _ = _step_delta(tmp_path, "lce", packs_per_step=2, loss_impl="linear_ce")
    b, run = _step_delta(tmp_path, "logits", packs_per_step=2, loss_impl="logits")
    assert run.trainer.loss_impl_used == "logits"
    assert max((a[n] - b[n]).abs().max().item() for n in a) <= 1e-6


def test_config_validation():
    with pytest.raises(ValueError, match="overflow"):
        SFTConfig(overflow="nope")
    with pytest.raises(ValueError, match="loss_reduction"):
        SFTConfig(loss_reduction="mean")
    with pytest.raises(ValueError, match="packing_length"):
        SFTConfig(packing_length=0)


def test_cli_sft_three_steps(tmp_path, capsys):
    """`varpack sft --max-steps 3` with the embedded Qwen3 tokenizer and tiny-qwen3: report, logs, saved model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from varpack.cli.main import main

    data = tmp_path / "chats.jsonl"
    topics = ["lists", "tuples", "sets", "dicts", "loops", "functions", "classes", "modules"]
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Explain Python {t} in one sentence."},
                {
                    "role": "assistant",
                    "content": f"Python {t} are a core part of the language; " * (1 + i % 3),
                },
            ]
        }
        for i, t in enumerate(topics)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    out_dir = tmp_path / "model"
    code = main(
        [
            "sft",
            "--model", "tiny-qwen3",
            "--data", str(data),
            "--packing-length", "128",
            "--max-steps", "3",
            "--lr", "3e-3",
            "--output-dir", str(out_dir),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "packing report" in out and "samples   8" in out and "fill" in out
    assert "done: 3 steps, loss" in out
    assert "engine    single process" in out  # the engine the Trainer actually ran
    # the step configuration and why, next to it torch_compile=auto stays eager on a CPU
    # and compiles on a GPU machine (the lead's CUDA run of this test)
    cuda = torch.cuda.is_available()
    speed = (
        "speed     regional torch.compile + chunked linear CE (auto on CUDA: fastest measured"
        if cuda
        else "speed     eager + chunked linear CE (auto: CPU run; compiled by default on CUDA only); "
        "CUDA graphs off (auto: CPU run; CUDA graphs need a CUDA GPU)\n"
    )
    assert "engine    single process\n" + speed in out
    import yaml

    saved = yaml.safe_load((out_dir / "varpack_config.yaml").read_text())
    assert saved["torch_compile"] is cuda  # resolved, so the rerun line runs the same step
    assert saved["cuda_graphs"] is False  # a CPU run, or float32 training on a GPU
    model = AutoModelForCausalLM.from_pretrained(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    assert model.config.vocab_size == 151936 and tok("Hello, world!")["input_ids"] == [9707, 11, 1879, 0]


def test_cli_sft_transformers_compile_runs_compiled(tmp_path, capsys):
    """``--extra-training-args '{"torch_compile": true}'``: Trainer's compiled forward is what the step runs
    (dynamo traces frames; the loss on the logits, as the speed line says). The chunked linear CE would call the
    base model outside the compiled forward, and no frame would be traced."""
    from torch._dynamo.utils import counters

    from varpack.cli.main import main

    data = tmp_path / "chats.jsonl"
    rows = [
        {"messages": [{"role": "user", "content": f"Explain {t}."}, {"role": "assistant", "content": f"{t}. " * 3}]}
        for t in ("lists", "sets", "dicts", "loops")
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    torch._dynamo.reset()
    before = counters["frames"]["ok"]
    code = main(
        [
            "sft", "--model", "tiny-qwen3", "--data", str(data), "--packing-length", "128", "--max-steps", "1",
            "--no-save", "--output-dir", str(tmp_path / "out"), "--extra-training-args", '{"torch_compile": true}',
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "speed     transformers' whole-model torch.compile + CE on the logits" in out, out
    assert counters["frames"]["ok"] > before
    torch._dynamo.reset()


_DDP_SCRIPT = r"""
import sys, torch
sys.path.insert(0, {root!r})
from tests.train.test_cli_sft import _build
import pathlib
out = pathlib.Path({out!r})
# round-robin (no cost balance): step 1 is the first 2 packs of the epoch's order under 1 or 2 ranks
run = _build(out, max_steps=1, lr=1.0, packs_per_step={pps}, loss_reduction={red!r}, rank_balance=False)
run.trainer.train()
if run.trainer.is_world_process_zero():
    torch.save({{n: p.detach() for n, p in run.model.named_parameters()}}, out / "params.pt")
    torch.save(run.trainer.state.log_history, out / "logs.pt")
del run  # no DDP-wrapped model may outlive the group (close_process_group)
from varpack.train.distributed import close_process_group
close_process_group()  # what `varpack sft` does: an open gloo group can abort the process at exit
"""


@pytest.mark.slow
@pytest.mark.parametrize("reduction", ["token", "sample"])
def test_torchrun_two_ranks_equal_one_process(tmp_path, reduction):
    """torchrun with 2 CPU ranks (one pack each, DDP over gloo) makes the same SGD step as one process with
    both packs in one row: each rank trains on its share, and the loss is the global mean."""
    import pathlib

    root = str(pathlib.Path(__file__).parents[2])
    params, logs = {}, {}
    for name, nproc, pps in (("ddp", 2, 1), ("single", 1, 2)):
        out = tmp_path / name
        out.mkdir()
        script = out / "run.py"
        script.write_text(_DDP_SCRIPT.format(root=root, out=str(out), pps=pps, red=reduction))
        proc = launch.run(launch.torchrun(nproc, script), timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        params[name] = torch.load(out / "params.pt")
        logs[name] = [h for h in torch.load(out / "logs.pt") if "loss" in h]
    start = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=None).state_dict()
    moved = max((params["single"][n] - start[n]).abs().max().item() for n in params["single"])
    worst = max((params["ddp"][n] - params["single"][n]).abs().max().item() for n in params["single"])
    assert moved > 1e-4 and worst <= 1e-6 + 1e-5 * moved
    # the logged counts are summed over ranks: 2 ranks x 1 pack log what 1 process x 2 packs logs
    keys = ("packs_per_step", "samples_per_step", "tokens_per_step", "supervised_tokens_per_step", "pack_fill")
    assert [{k: h[k] for k in keys} for h in logs["ddp"]] == [{k: h[k] for k in keys} for h in logs["single"]]
    assert logs["single"][0]["packs_per_step"] == 2


def test_liger_refused_before_encoding_without_cuda(tmp_path, capsys, monkeypatch):
    """--use-liger-kernel on a machine without CUDA (or without liger) is a clear error before any encoding."""
    import varpack.integrations.kernels as K
    import varpack.train.sft as vt  # build_sft (and the load_and_encode it calls) live here
    from varpack.cli.main import main

    def no_encoding(*a, **k):
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(vt, "load_and_encode", no_encoding)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for installed, expected in ((True, "needs a CUDA GPU"), (False, "pip install liger-kernel")):
        monkeypatch.setattr(K, "liger_available", lambda installed=installed: installed)
        code = main(["sft", "--use-liger-kernel", "--max-steps", "1", "--output-dir", str(tmp_path / "o")])
        assert code == 1 and expected in capsys.readouterr().err


def test_sft_refuses_early_and_clearly(tmp_path, capsys):
    """An unknown attention backend is refused before encoding; a plan with no pack (every sample dropped) is
    an error naming the samples, not an exit 0 that saves the untrained model."""
    from varpack.cli.main import main

    out = tmp_path / "o"
    code = main(["sft", "--attn-backend", "no-such", "--max-steps", "1", "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "--attn-backend" in err and "'flex'" in err
    data = tmp_path / "long.jsonl"
    long_answer = "word " * 200
    rows = [
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": long_answer}]}
        for _ in range(2)
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    args = ["sft", "--data", str(data), "--packing-length", "64", "--overflow", "drop", "--max-steps", "1"]
    code = main([*args, "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "no pack to train on" in err and "sample ids 0, 1" in err
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "fp16", "bf16"])
def test_bf16_beside_a_half_dtype_is_refused_before_encoding(dtype, tmp_path, capsys, monkeypatch):
    """``--dtype float16 --bf16`` (float16 weights under bfloat16 autocast) ran without a word (a fresh user's
    review); ``--dtype bfloat16 --bf16`` gave bfloat16 weights where --bf16 promises float32 master weights.
    Both are refused before the data is encoded, naming both flags and both ways out. Controls: each alone."""
    from varpack.cli.main import main
    from varpack.train import sft
    from varpack.train.config import check_precision

    def never(*a, **k):
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(sft, "load_and_encode", never)
    torch_name = {"fp16": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
    code = main(["sft", "--dtype", dtype, "--bf16", "--max-steps", "1", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == 1, err
    assert f"varpack sft: error: --dtype {torch_name} (dtype='{torch_name}') with --bf16 (bf16=True): " in err
    assert "--bf16 is bfloat16 autocast over float32 master weights" in err
    assert f"--bf16 alone (mixed precision, float32 master weights) or --dtype {torch_name} alone" in err
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match=rf"--dtype {torch_name} \(dtype='{torch_name}'\) with --bf16"):
        build_sft(SFTConfig(dtype=dtype, bf16=True, output_dir=str(tmp_path / "o")))
    check_precision(SFTConfig(dtype=dtype))
    check_precision(SFTConfig(bf16=True))
    check_precision(SFTConfig(dtype="float32", bf16=True))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a run on the CPU")
def test_fp16_on_the_cpu_is_refused_before_encoding(tmp_path, capsys, monkeypatch):
    """``--extra-training-args '{"fp16": true}'`` on the CPU said "fp16 autocast" while accelerate ran plain
    float32 (it turns float16 autocast off on the CPU): refused before the data is encoded, naming the setting
    and the ways out; the Trainer's own device is checked again (an accelerator seen up front, a CPU run)."""
    from varpack.cli.main import main
    from varpack.train import sft

    def never(*a, **k):
        raise AssertionError("encoded before refusing")

    monkeypatch.setattr(sft, "load_and_encode", never)
    argv = ["sft", "--max-steps", "1", "--output-dir", str(tmp_path / "o"), "--extra-training-args"]
    code = main([*argv, '{"fp16": true}'])
    err = capsys.readouterr().err
    assert code == 1, err
    assert "varpack sft: error: --extra-training-args '{\"fp16\": true}' (TrainingArguments.fp16=True): " in err
    assert "fp16 mixed precision does not run on the CPU" in err and "--bf16" in err
    assert not (tmp_path / "o").exists()
    monkeypatch.setattr(sft, "_accelerator_available", lambda: True)  # passes the up-front check
    with pytest.raises(ValueError, match=r"TrainingArguments.fp16=True\): fp16 mixed precision does not run"):
        build_sft(
            SFTConfig(output_dir=str(tmp_path / "o"), packing_length=32, extra_training_args={"fp16": True}),
            model=load_model("tiny-qwen3", vocab_size=VOCAB), tokenizer=_Tok(), encoded=synthetic_samples(),
        )  # fmt: skip


def one_step_cpu_run(tmp_path, model, **config_kw):
    """``(run, config, printed lines)`` of a 1-step, unsaved CPU ``run_sft`` of ``model`` (reference attention,
    packing_length 32) on :func:`synthetic_samples`, with ``config_kw`` set on the :class:`SFTConfig`."""
    from varpack.train import run_sft

    lines: list[str] = []
    config = SFTConfig(
        output_dir=str(tmp_path / "o"), packing_length=32, attn_backend="reference", max_steps=1, save=False,
        extra_training_args={"use_cpu": True}, **config_kw,
    )  # fmt: skip
    run = run_sft(config, print_fn=lines.append, model=model, tokenizer=_Tok(), encoded=synthetic_samples())
    return run, config, lines


@pytest.mark.parametrize("rank_balance", [True, False])
def test_model_without_attention_layers_trains(tmp_path, rank_balance):
    """tiny-mamba2 (Mamba-2 mixers only: no attention layer, no num_attention_heads) needs no attention cost:
    its packs cost their tokens (weight 0) and it trains."""
    from varpack.train import run_sft

    config = SFTConfig(
        model="tiny-mamba2", output_dir=str(tmp_path / "o"), packing_length=32, max_steps=1, save=False,
        rank_balance=rank_balance, extra_training_args={"use_cpu": True},
    )  # fmt: skip
    model = load_model("tiny-mamba2", vocab_size=VOCAB)
    run = run_sft(config, print_fn=lambda line: None, model=model, tokenizer=_Tok(), encoded=synthetic_samples())
    assert run.trainer.pack_sampler.attention_weight == 0.0
    assert len(run.history) == 1 and np.isfinite(run.history[0]["loss"])


@pytest.mark.parametrize(
    ("extra", "shown", "cls"),
    [
        ({"optim": "sgd"}, "optimizer SGD (optim sgd), peak lr 0.001 (set), constant schedule", torch.optim.SGD),
        ({"optim": "adagrad"}, "optimizer Adagrad (optim adagrad), peak lr 0.001", torch.optim.Adagrad),
        ({}, "optimizer AdamW (optim adamw_torch", torch.optim.AdamW),  # transformers' default
    ],
)
def test_optimizer_line_names_the_optimizer_that_runs(tmp_path, monkeypatch, extra, shown, cls):
    """The ``optimizer`` line names the optimizer the Trainer builds from its TrainingArguments (an ``optim``
    from ``--extra-training-args`` included), the one that then steps; naming it asks transformers without the
    model, so only the Trainer builds an optimizer for the model (a layer-wise optim would hook it twice)."""
    import transformers

    from varpack.train import run_sft

    seen = []
    original = transformers.Trainer.get_optimizer_cls_and_kwargs

    def recorded(args, model=None):
        seen.append(model is not None)
        return original(args, model)

    monkeypatch.setattr(transformers.Trainer, "get_optimizer_cls_and_kwargs", staticmethod(recorded))

    lines: list[str] = []
    config = SFTConfig(
        output_dir=str(tmp_path / "o"), packing_length=32, attn_backend="reference", max_steps=1, save=False,
        lr=1e-3, extra_training_args={"use_cpu": True, **extra},
    )  # fmt: skip
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    run = run_sft(config, print_fn=lines.append, model=model, tokenizer=_Tok(), encoded=synthetic_samples())
    (line,) = [line for line in lines if line.startswith("optimizer ")]
    assert line.startswith(shown), line
    assert type(getattr(run.trainer.optimizer, "optimizer", run.trainer.optimizer)) is cls
    assert seen.count(True) == 1 and False in seen, seen


@pytest.mark.parametrize(
    ("bf16", "dtype", "lora", "shown"),
    [
        (False, "float32", False, "precision float32 weights, "),
        (True, "float32", False, "precision bf16 autocast over float32 master weights, "),
        (False, "bfloat16", False, "precision bfloat16 weights, "),
        (False, "bfloat16", True, "precision float32 weights (frozen: bfloat16), "),  # peft's float32 adapter
    ],
)
def test_model_line_names_the_training_precision(tmp_path, bf16, dtype, lora, shown):
    """No line of `varpack sft` said the training precision (a fresh user's review): the ``model`` line does,
    from the Trainer's autocast and the trained parameters' dtype (frozen ones of another dtype named after)."""
    line = _model_line_precision(tmp_path, bf16, dtype, lora, shown)
    assert "float16 on the CPU" not in line


def test_model_line_says_float16_on_the_cpu_is_slow(tmp_path):
    """A CPU run in float16 weights (a fresh user's slow first run, with no word why) says so on the model line."""
    from varpack.train.sft import CPU_FLOAT16_NOTE

    line = _model_line_precision(tmp_path, False, "float16", False, "precision float16 weights (")
    assert CPU_FLOAT16_NOTE in line


def _model_line_precision(tmp_path, bf16, dtype, lora, shown):
    """The ``model`` line of a 1-step CPU run of tiny-qwen3 in ``dtype`` (``shown`` in it, precision said once)."""
    if lora:
        pytest.importorskip("peft")

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", dtype=getattr(torch, dtype))
    _, _, lines = one_step_cpu_run(tmp_path, model, bf16=bf16, dtype=dtype, lora=lora)
    (line,) = [line for line in lines if line.startswith("model     ")]
    assert shown in line and line.count("precision") == 1, line
    return line


@pytest.mark.parametrize("overflow", ["truncate", "split"])
def test_samples_and_pieces_without_a_supervised_token_are_left_out(tmp_path, overflow):
    """A prompt longer than the packing length (truncated / split away from its answer) and an encoded sample
    whose labels are all -100 train nothing: `varpack sft` leaves them out of the packs and its packing report
    names them (the report only warned about such pieces and packed them; whole samples went unreported)."""
    import datasets

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    long_prompt = {"input_ids": ids, "labels": [-100] * 36 + ids[36:], "length": 40}
    masked = {"input_ids": ids[:5], "labels": [-100] * 5, "length": 5}
    samples = synthetic_samples() + [long_prompt, masked]
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    config = SFTConfig(
        model="tiny-qwen3", output_dir=str(tmp_path / "out"), packing_length=32, overflow=overflow,
        attn_backend="reference", save=False, extra_training_args={"use_cpu": True},
    )  # fmt: skip
    run = build_sft(config, model=model, tokenizer=_Tok(), encoded=datasets.Dataset.from_list(samples))
    ov = run.plan.overflow
    assert ov["unsupervised_ids"] == [13] and ov["unsupervised_pieces"] == [[12, 0, 32]]
    assert "no loss   1 sample(s), 1 piece(s) left out" in run.report
    assert "sample 13, sample 12 [0, 32)" in run.report
    packed = [(s["sample_id"], s.get("piece_range")) for i in range(len(run.dataset)) for s in run.dataset[i]]
    want = [(i, None) for i in range(12)] + ([(12, (32, 40))] if overflow == "split" else [])
    assert sorted(packed, key=str) == sorted(want, key=str)
    for i in range(len(run.dataset)):  # every pack, so every optimizer step, has a supervised token
        assert any((np.asarray(s["labels"])[1:] != -100).any() for s in run.dataset[i])


def test_attention_dropout_refused_before_training_naming_the_key(tmp_path):
    """A model whose config sets attention dropout is refused while the run is built (before any step), naming
    the config key; with it at 0.0 the same build goes through (control)."""
    kw = dict(model="tiny-qwen3", output_dir=str(tmp_path / "out"), packing_length=32, attn_backend="reference",
              save=False, extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True})  # fmt: skip
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference",
                       config_overrides={"attention_dropout": 0.1})  # fmt: skip
    with pytest.raises(ValueError, match=r"varpack sft: .*Qwen3Config sets attention_dropout=0.1: set it to 0.0"):
        build_sft(SFTConfig(**kw), model=model, tokenizer=_Tok(), encoded=synthetic_samples())
    model.config.attention_dropout = 0.0
    assert build_sft(SFTConfig(**kw), model=model, tokenizer=_Tok(), encoded=synthetic_samples()).trainer


def test_attention_dropout_of_a_model_directory_refused_before_encoding(tmp_path, monkeypatch):
    """A model directory whose config.json sets GPT-2's attn_pdrop: refused from the config alone, before any
    data is read or encoded."""
    import transformers

    import varpack.train.sft as sft_mod

    transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2).save_pretrained(tmp_path / "gpt2")
    monkeypatch.setattr(sft_mod, "load_and_encode", lambda *a, **k: pytest.fail("data encoded first"))
    config = SFTConfig(model=str(tmp_path / "gpt2"), output_dir=str(tmp_path / "o"), save=False)
    with pytest.raises(ValueError, match=r"GPT2Config sets attn_pdrop=0.1: set it to 0.0 in the model's config"):
        build_sft(config, tokenizer=_Tok())


def test_split_report_counts_the_targets_at_the_cuts(tmp_path):
    """overflow='split' cuts an 80-token sample at 32 and 64: the two supervised tokens there start a piece
    and are not trained, and the report says so; a cut inside the prompt (label -100) costs nothing. Rows as a
    list count the same as the Dataset (read through Arrow)."""
    import datasets

    from varpack.train.sft import split_targets_at_cuts

    long = {"input_ids": list(range(10, 90)), "labels": [-100] + list(range(11, 90)), "length": 80}
    prompt = {"input_ids": list(range(10, 90)), "labels": [-100] * 40 + list(range(50, 90)), "length": 80}
    short = {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "length": 3}  # the cut at 32 of prompt: label -100
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    run = build_sft(SFTConfig(model="tiny-qwen3", output_dir=str(tmp_path / "o"), packing_length=32,
                              attn_backend="reference", save=False, overflow="split",
                              extra_training_args={"optim": "sgd", "use_cpu": True}),
                    model=model, tokenizer=_Tok(),
                    encoded=datasets.Dataset.from_list([long, prompt, short]))  # fmt: skip
    assert "3 supervised tokens at the cuts not trained" in run.report, run.report
    assert split_targets_at_cuts(run.plan, [long, prompt, short]) == 3
