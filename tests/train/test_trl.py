"""TRL drop-in (`varpack.train.trl.VarpackSFTTrainer`): a TRL `SFTTrainer` run on varpack's packs
equals varpack's own trainer (loss per optimizer step, with gradient accumulation and an optimizer), one
step's gradients equal each sample alone (negative control: the boundaries dropped), and TRL settings that
would mix, cut or re-weight samples are refused."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")  # the `trl` extra; `make test` installs it
datasets = pytest.importorskip("datasets")

from trl import SFTConfig  # noqa: E402

from tests._exact import LOSS_RTOL, assert_differs, assert_exact  # noqa: E402
from varpack.loss import causal_lm_loss  # noqa: E402
from varpack.models import load_model, load_tokenizer_for  # noqa: E402
from varpack.train import SFTConfig as VarpackConfig  # noqa: E402
from varpack.train.sft import build_sft  # noqa: E402
from varpack.train.trl import VarpackSFTTrainer, samples_from_trl  # noqa: E402

VOCAB = 512
PACKING_LENGTH = 16
LENGTHS = (5, 9, 3, 12, 7, 4, 11, 6, 8, 2, 13, 5, 10, 3, 7, 9)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer_for("tiny-qwen3")  # the embedded Qwen3 tokenizer, built offline


def rows(lengths=LENGTHS, seed=0):
    """Pre-tokenized TRL rows: ``input_ids`` and ``labels`` with a prompt part (-100); ``labels[0]`` is a
    token (TRL's own datasets leave it so), which varpack sets to -100."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        labels = [-100] * (n // 3) + ids[n // 3 :]
        out.append({"input_ids": ids, "labels": labels})
    return out


def tiny_model(seed=0):
    return load_model(
        "tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", dtype=torch.float32, seed=seed
    )


def trl_args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path / "trl"),
        max_length=PACKING_LENGTH,
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
        max_steps=3,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        logging_steps=1,
        logging_nan_inf_filter=False,
        save_strategy="no",
        report_to=[],
        train_sampling_strategy="sequential",
        gradient_checkpointing=False,
        bf16=False,
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
    )
    base.update(kw)
    return SFTConfig(**base)


def trl_trainer(tmp_path, tokenizer, model=None, args=None, **kw):
    return VarpackSFTTrainer(
        model=model if model is not None else tiny_model(),
        args=args if args is not None else trl_args(tmp_path),
        train_dataset=datasets.Dataset.from_list(rows()),
        processing_class=tokenizer,
        attn_backend="reference",
        **kw,
    )


def varpack_run(tmp_path, tokenizer, samples, **kw):
    config = VarpackConfig(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "varpack"),
        packing_length=PACKING_LENGTH,
        packs_per_step=1,
        grad_accum=2,
        max_steps=3,
        lr=1e-2,
        attn_backend="reference",
        save=False,
        report_to="none",
        **kw,
    )
    return build_sft(config, model=tiny_model(), tokenizer=tokenizer, encoded=samples)


def step_losses(trainer):
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.mark.parametrize("loss_reduction", ["token", "sample"])
def test_trl_run_equals_varpack_trainer(tmp_path, tokenizer, loss_reduction):
    """Same samples, same plan, same packs in the same order: the TRL trainer's loss at every optimizer step
    (AdamW, 2 accumulation micro-batches) equals varpack's PackedSFTTrainer's (fp32)."""
    trl_trainer_ = trl_trainer(tmp_path, tokenizer, loss_reduction=loss_reduction)
    run = varpack_run(tmp_path, tokenizer, trl_trainer_.samples, loss_reduction=loss_reduction)
    assert [p.tolist() for p in trl_trainer_.plan.packs] == [p.tolist() for p in run.plan.packs]
    assert trl_trainer_.plan.num_packs >= 6  # 3 steps x 2 micro-batches, all distinct packs
    # both deal the packs with the same pack sampler layout (under torchrun: balanced per rank)
    assert trl_trainer_.pack_sampler.fingerprint() == run.trainer.pack_sampler.fingerprint()
    got, want = step_losses(trl_trainer_), step_losses(run.trainer)
    assert len(got) == len(want) == 3
    assert got != [got[0]] * 3  # the optimizer moved the model
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-6, atol=1e-6)
    assert trl_trainer_.loss_impl_used == run.trainer.loss_impl_used


def test_trl_samples_keep_token_fields_and_first_label():
    """TRL rows become varpack samples: first label -100, the rest unchanged, raw columns dropped, labels =
    input_ids when TRL gave none; an empty sample is named."""
    ds = datasets.Dataset.from_list(
        [
            {"input_ids": [5, 6, 7], "labels": [5, -100, 7], "messages": "raw"},
            {"input_ids": [8, 9], "labels": [8, 9]},
        ]
    )
    s = samples_from_trl(ds)
    assert s.column_names == ["input_ids", "labels", "length", "sample_id"]
    assert s[0]["labels"] == [-100, -100, 7] and s[1]["labels"] == [-100, 9]
    assert s["length"] == [3, 2] and s["sample_id"] == [0, 1]
    assert samples_from_trl(datasets.Dataset.from_list([{"input_ids": [3, 4]}]))[0]["labels"] == [-100, 4]
    with pytest.raises(ValueError, match="sample 1 of the train dataset has no tokens"):
        samples_from_trl(datasets.Dataset.from_list([{"input_ids": [3]}, {"input_ids": []}]))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def unpacked_grads(model, samples):
    """Each sample alone on the model's own sdpa attention; token-mean loss over all samples."""
    current = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        model.zero_grad(set_to_none=True)
        n_sup = sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
        total = 0.0
        for s in samples:
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits
            total = total + causal_lm_loss(logits, torch.tensor([s["labels"]]), num_items_in_batch=1)
        (total / n_sup).backward()
        return (total / n_sup).detach(), _grads(model)
    finally:
        model.set_attn_implementation(current)


@pytest.mark.parametrize("loss_impl", ["logits", "linear_ce"])
def test_trl_step_gradients_equal_unpacked(tmp_path, tokenizer, loss_impl):
    """One micro-batch from the TRL trainer's own dataloader (two packs) through its compute_loss: loss and
    every gradient equal each of its samples alone; the same batch with its boundaries dropped does not."""
    trainer = trl_trainer(
        tmp_path, tokenizer, args=trl_args(tmp_path, per_device_train_batch_size=2), loss_impl=loss_impl
    )
    model = trainer.model
    model.train()
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["num_packs"] == 2 and len(batch["sample_ids"]) > 2
    samples = [trainer.samples[int(i)] for i in batch["sample_ids"]]
    loss_u, grads_u = unpacked_grads(model, samples)

    def packed(b):
        model.zero_grad(set_to_none=True)
        loss = trainer.compute_loss(model, dict(b))
        loss.backward()
        return loss.detach(), _grads(model)

    loss_p, grads_p = packed(batch)
    assert trainer.loss_impl_used == loss_impl
    assert grads_p.keys() == grads_u.keys() and len(grads_p) == len(list(model.parameters()))
    assert_exact(loss_p, loss_u, rtol=LOSS_RTOL, what="loss")
    assert_exact(grads_p, grads_u)

    t = batch["input_ids"].shape[1]  # negative control: one segment spanning the row
    bad = {k: v for k, v in batch.items() if k != "varlen_meta"}
    bad["cu_seq_lens_q"] = bad["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
    bad["max_length_q"] = bad["max_length_k"] = t
    _, grads_bad = packed(bad)
    assert_differs(grads_bad, grads_u)


@pytest.mark.parametrize(
    ("setting", "match"),
    [
        ({"packing": True}, "packing=True"),
        ({"eval_packing": True}, "eval_packing=True"),
        ({"padding_free": True}, "padding_free=True"),
        ({"loss_type": "dft"}, "loss_type='dft'"),
        ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
        ({"train_sampling_strategy": "group_by_length"}, "train_sampling_strategy='group_by_length'"),
        ({"max_length": None}, "max_length=None"),
        # transformers scales NEFTune's noise by the row length: a pack's, not the sample's
        ({"neftune_noise_alpha": 5.0}, "neftune_noise_alpha=5.0 -- NEFTune .* what it is packed with"),
    ],
)
def test_conflicting_trl_settings_refused(tmp_path, tokenizer, setting, match):
    with pytest.raises(ValueError, match=match):
        trl_trainer(tmp_path, tokenizer, args=trl_args(tmp_path, **setting))


def test_settings_varpack_does_not_run_are_refused_by_name(tmp_path, tokenizer):
    """use_liger_kernel=True off CUDA (Liger's Triton kernels failed at the first step with "0 active
    drivers"), and truncation_mode='keep_end' with overflow='truncate' (varpack keeps the start): refused
    when the trainer is built; keep_end without truncation cuts nothing, so it is accepted (control)."""
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_liger_kernel=True -- .* this run trains on cpu"):
            trl_trainer(tmp_path, tokenizer, args=trl_args(tmp_path, use_liger_kernel=True))
    keep_end = trl_args(tmp_path, truncation_mode="keep_end")
    with pytest.raises(ValueError, match="truncation_mode='keep_end' with overflow='truncate'"):
        trl_trainer(tmp_path, tokenizer, args=keep_end, overflow="truncate")
    assert trl_trainer(tmp_path, tokenizer, args=keep_end).packing_settings["overflow"] == "error"


def test_conflicting_trainer_arguments_refused(tmp_path, tokenizer):
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    with pytest.raises(ValueError, match="data_collator=DataCollatorForLanguageModeling"):
        trl_trainer(tmp_path, tokenizer, data_collator=DataCollatorForLanguageModeling(pad_token_id=0))
    with pytest.raises(ValueError, match="compute_loss_func"):
        trl_trainer(tmp_path, tokenizer, compute_loss_func=lambda *a, **k: 0)
    with pytest.raises(ValueError, match="pass a model object"):
        trl_trainer(tmp_path, tokenizer, model="Qwen/Qwen3-0.6B")
    with pytest.raises(TypeError, match="trl.SFTConfig"):
        VarpackSFTTrainer(model=tiny_model(), args=None, train_dataset=datasets.Dataset.from_list(rows()))
    with pytest.raises(ValueError, match="overlong|longer|packing_length"):  # overflow="error": nothing cut
        trl_trainer(tmp_path, tokenizer, args=trl_args(tmp_path, max_length=8))


def test_model_put_on_varpack_attention(tmp_path, tokenizer):
    """A model on sdpa (which would ignore the pack boundaries) is switched to varpack attention; the
    trainer then refuses evaluate() with a dataset it did not pack."""
    from varpack.integrations.transformers import is_varpack_attention

    model = tiny_model()
    model.set_attn_implementation("sdpa")
    trainer = trl_trainer(tmp_path, tokenizer, model=model)
    assert is_varpack_attention(trainer.model.config._attn_implementation)
    with pytest.raises(ValueError, match="evaluate"):
        trainer.evaluate(datasets.Dataset.from_list(rows()))


def test_empty_train_dataset_is_named(tmp_path, tokenizer):
    """An empty train_dataset raised a bare StopIteration from the vision-dataset probe."""
    with pytest.raises(ValueError, match="train_dataset -- it has no rows"):
        VarpackSFTTrainer(
            model=tiny_model(),
            args=trl_args(tmp_path),
            train_dataset=datasets.Dataset.from_list([]),
            processing_class=tokenizer,
        )


@pytest.mark.parametrize("mask", ["completion_mask", "assistant_masks"])
def test_masks_without_labels_are_refused(tmp_path, tokenizer, mask):
    """With skip_prepare_dataset=True TRL does not fold its masks into labels; TRL's own trainer refuses such
    a dataset (it would train on every token), varpack's took labels = input_ids silently."""
    ds = datasets.Dataset.from_list([{"input_ids": r["input_ids"], mask: [0, 0] + [1] * (len(r["input_ids"]) - 2)}
                                     for r in rows()])
    with pytest.raises(ValueError, match=rf"mask columns \['{mask}'\] but no 'labels'"):
        samples_from_trl(ds)
    with pytest.raises(ValueError, match="drop skip_prepare_dataset"):
        VarpackSFTTrainer(
            model=tiny_model(),
            args=trl_args(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=ds,
            processing_class=tokenizer,
        )


def test_truncation_leaves_no_step_without_a_supervised_token(tmp_path, tokenizer, caplog):
    """``overflow="truncate"`` with prompts longer than max_length: each truncated piece kept no supervised
    token, filled a pack on its own, and 2 of 4 steps logged loss 0.0 (train_loss half its value), silently.
    Such pieces, and a row whose labels are all -100, are left out and logged by sample id; the run equals one
    on the supervised rows alone."""
    import logging

    g = torch.Generator().manual_seed(1)

    def row(n, prompt):
        ids = torch.randint(0, VOCAB, (n,), generator=g).tolist()
        return {"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]}

    normal = [row(12, 4), row(10, 3)]
    data = [normal[0], row(25, 20), normal[1], row(30, 24), row(6, 6)]

    def trainer_on(rows_, **kw):
        return VarpackSFTTrainer(
            model=tiny_model(),
            args=trl_args(tmp_path, gradient_accumulation_steps=1, max_steps=4),
            train_dataset=datasets.Dataset.from_list(rows_),
            processing_class=tokenizer,
            attn_backend="reference",
            overflow="truncate",
            **kw,
        )

    with caplog.at_level(logging.WARNING, logger="varpack.train.trl"):
        trainer = trainer_on(data)
    ov = trainer.plan.overflow
    assert ov["truncated_ids"] == [1, 3] and ov["unsupervised_ids"] == [4]
    assert ov["unsupervised_pieces"] == [[1, 0, PACKING_LENGTH], [3, 0, PACKING_LENGTH]]
    assert "sample 4, sample 1 [0, 16), sample 3 [0, 16)" in caplog.text
    assert sorted(int(i) for i in trainer.plan.items) == [0, 2]
    losses = step_losses(trainer)
    assert len(losses) == 4 and min(losses) > 0.5  # no step of unsupervised pieces alone
    ref = trainer_on(normal)
    want = step_losses(ref)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=1e-6)
    train_loss = [h["train_loss"] for h in trainer.state.log_history if "train_loss" in h]
    ref_loss = [h["train_loss"] for h in ref.state.log_history if "train_loss" in h]
    assert train_loss == pytest.approx(ref_loss, rel=1e-6)


def test_attention_dropout_refused_by_the_drop_in(tmp_path, tokenizer):
    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference", dtype=torch.float32,
                       config_overrides={"attention_dropout": 0.1})  # fmt: skip
    with pytest.raises(ValueError, match=r"VarpackSFTTrainer: .*sets attention_dropout=0.1: set it to 0.0"):
        trl_trainer(tmp_path, tokenizer, model=model)
    model.config.attention_dropout = 0.0
    assert trl_trainer(tmp_path, tokenizer, model=model).model is not None


def test_conversations_checked_as_varpack_sft_checks_them(tmp_path, tokenizer):
    """A chat dataset with an empty assistant answer, or without an assistant turn, is refused naming the
    dataset, the row and the field, before TRL prepares it; the same rows with answers train (control)."""
    def chats(answer):
        return [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": answer}]}
                for i in range(4)]  # fmt: skip

    bad = chats("an answer")
    bad[2]["messages"][1]["content"] = "  "
    with pytest.raises(ValueError, match=r"train_dataset, sample 2: messages\[1\].content is empty"):
        VarpackSFTTrainer(model=tiny_model(), args=trl_args(tmp_path), train_dataset=datasets.Dataset.from_list(bad),
                          processing_class=tokenizer, attn_backend="reference")  # fmt: skip
    no_answer = chats("an answer")
    no_answer[1]["messages"] = no_answer[1]["messages"][:1]
    with pytest.raises(ValueError, match=r"eval_dataset, sample 1: no assistant message to supervise"):
        VarpackSFTTrainer(model=tiny_model(), args=trl_args(tmp_path), processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(chats("an answer")),
                          eval_dataset=datasets.Dataset.from_list(no_answer), attn_backend="reference")  # fmt: skip
    trainer = VarpackSFTTrainer(model=tiny_model(), args=trl_args(tmp_path), processing_class=tokenizer,
                                train_dataset=datasets.Dataset.from_list(chats("an answer")),
                                attn_backend="reference")  # fmt: skip
    assert len(trainer.samples) == 4


def test_conversation_check_leaves_roles_content_types_and_streams_to_trl():
    """Only empty answers and chats without one are refused: a ``developer`` role and list-of-parts content pass
    (the template decides), and an IterableDataset is not read (an endless stream would never end the check)."""
    from varpack.train.trl import check_conversations

    parts = [{"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
             {"role": "user", "content": [{"type": "text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "text", "text": "hello"}]}]  # fmt: skip
    check_conversations(datasets.Dataset.from_list([{"messages": parts}]), "train_dataset")

    def endless():
        while True:
            yield {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}

    turn = {"role": datasets.Value("string"), "content": datasets.Value("string")}
    features = datasets.Features({"messages": [turn]})
    stream = datasets.IterableDataset.from_generator(endless, features=features)
    assert "messages" in stream.column_names
    check_conversations(stream, "train_dataset")  # returns without reading it


def test_model_without_attention_layers_trains(tmp_path, tokenizer):
    """tiny-mamba2 has no attention layer: its packs cost their tokens (attention weight 0) and the drop-in
    trains it."""
    model = load_model("tiny-mamba2", vocab_size=VOCAB, dtype=torch.float32, seed=0)
    trainer = trl_trainer(tmp_path, tokenizer, model=model, args=trl_args(tmp_path, max_steps=1))
    assert trainer.pack_sampler.attention_weight == 0.0
    losses = step_losses(trainer)
    assert len(losses) == 1 and torch.isfinite(torch.tensor(losses[0]))


def test_fp16_on_the_cpu_is_refused(tmp_path, tokenizer):
    """fp16=True on the CPU trained in plain float32 (accelerate runs no float16 autocast there): refused by
    name, with bf16 as the way out; bf16=True on the CPU is accepted (control)."""
    with pytest.raises(ValueError, match=r"fp16=True -- fp16 mixed precision does not run on the CPU.*bf16=True"):
        trl_trainer(tmp_path, tokenizer, args=trl_args(tmp_path, fp16=True))
    assert trl_trainer(tmp_path, tokenizer, args=trl_args(tmp_path, bf16=True)).args.bf16
