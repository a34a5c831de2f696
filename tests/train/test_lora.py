"""LoRA (peft) on packed rows: packed == each sample alone for logits, loss and every adapter gradient (also
with gradient checkpointing and on the gated-delta path), the negative control without boundaries, linear
cross entropy through a PeftModel, and `varpack sft --lora` training only the adapter and saving it (and the
merged model)."""

from __future__ import annotations

import json

import pytest
import torch

from tests._exact import LOGITS_RTOL, LOSS_RTOL, assert_differs, assert_exact
from varpack.collate import PaddingFreeCollator
from varpack.loss import causal_lm_loss
from varpack.models import load_model
from varpack.train import SFTConfig

peft = pytest.importorskip("peft")  # the `lora` extra; `make test` installs it

VOCAB = 512
LENGTHS = (5, 1, 7, 3)  # odd lengths, a 1-token sample
NOT_MODEL_INPUTS = ("labels", "sample_ids", "loss_scale")


def make_samples(lengths=LENGTHS, seed=0):
    g = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(0, VOCAB, (n,), generator=g)
        labels = ids.clone()
        labels[: max(1, n // 3)] = -100  # a prompt part; labels[0] == -100 always
        samples.append({"input_ids": ids.tolist(), "labels": labels.tolist(), "sample_id": i})
    return samples


def lora_model(name="tiny-qwen3", **cfg):
    """A tiny model on varpack attention wrapped in LoRA with lora_B non-zero (``init_lora_weights=False``),
    so the adapter changes the logits and both A and B get non-trivial gradients."""
    from varpack.train.lora import apply_lora

    model = load_model(name, vocab_size=VOCAB, attn_backend="reference")
    model.config.use_cache = False
    config = SFTConfig(**{"lora": True, "lora_r": 4, "lora_alpha": 8, **cfg})
    return apply_lora(model, config, init_lora_weights=False)


def packed_batch(samples, sabotage=False):
    batch = PaddingFreeCollator()([samples])
    if sabotage:  # one segment spanning the whole row: the boundaries are gone
        t = batch["input_ids"].shape[1]
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, t], dtype=torch.int32)
        batch["max_length_q"] = batch["max_length_k"] = t
        batch.pop("varlen_meta")  # the collator's meta would disagree with the replaced boundaries
    return batch


def trainable_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def packed_run(model, samples, sabotage=False):
    batch = packed_batch(samples, sabotage)
    model.zero_grad(set_to_none=True)
    logits = model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}).logits
    loss = causal_lm_loss(logits, batch["labels"], seq_idx=batch["seq_idx"])
    loss.backward()
    return logits[0].detach(), loss.detach(), trainable_grads(model)


def unpacked_run(model, samples):
    """Each sample alone through the model's own attention (sdpa); loss = token mean over all samples."""
    current = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        model.zero_grad(set_to_none=True)
        n_sup = sum(sum(x != -100 for x in s["labels"][1:]) for s in samples)
        logits_all, total = [], 0.0
        for s in samples:
            logits = model(input_ids=torch.tensor([s["input_ids"]])).logits
            total = total + causal_lm_loss(logits, torch.tensor([s["labels"]]), num_items_in_batch=1)
            logits_all.append(logits[0].detach())
        (total / n_sup).backward()
        return torch.cat(logits_all), (total / n_sup).detach(), trainable_grads(model)
    finally:
        model.set_attn_implementation(current)


CHECKPOINTING = {"off": None, "non-reentrant": {"use_reentrant": False}, "reentrant": {"use_reentrant": True}}


@pytest.mark.parametrize("checkpointing", sorted(CHECKPOINTING))
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_lora_packed_equals_unpacked(name, checkpointing):
    """Adapters on every linear layer (the gated-delta projections too): the packed row equals each sample
    alone for logits, loss and every adapter gradient; dropping the boundaries breaks it (negative control)."""
    model = lora_model(name)
    samples = make_samples()
    logits_u, loss_u, grads_u = unpacked_run(model, samples)
    kwargs = CHECKPOINTING[checkpointing]
    if kwargs is not None:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        model.train()
    logits_p, loss_p, grads_p = packed_run(model, samples)
    lora_names = {n for n, _ in model.named_parameters() if "lora_" in n}
    assert grads_p.keys() == lora_names and len(lora_names) > 0  # only the adapters train, all of them
    assert min(g.abs().max().item() for g in grads_p.values()) > 0  # every adapter got a gradient
    assert_exact(logits_p, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_exact(loss_p, loss_u, rtol=LOSS_RTOL, what="loss")
    assert_exact(grads_p, grads_u)

    logits_bad, _, grads_bad = packed_run(model, samples, sabotage=True)
    assert_differs(logits_bad, logits_u, rtol=LOGITS_RTOL, what="logits")
    assert_differs(grads_bad, grads_u)


def test_lora_changes_the_model():
    """The adapter is live on the packed path: without it (peft's disable_adapter) the logits differ."""
    model = lora_model()
    batch = packed_batch(make_samples())
    inputs = {k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}
    with torch.no_grad():
        with_adapter = model(**inputs).logits
        with model.disable_adapter():
            without = model(**inputs).logits
    assert (with_adapter - without).abs().max().item() > 1e-3


def test_linear_ce_sees_through_peft_model():
    """causal_lm_forward_with_linear_ce on a PeftModel == its logits + causal_lm_loss (loss and adapter
    gradients); an adapter on the LM head is refused (linear CE reads head.weight) and `auto` picks logits."""
    from varpack.ops.linear_ce import causal_lm_forward_with_linear_ce
    from varpack.ops.linear_ce.causal_lm import head_has_adapter

    model = lora_model()
    batch = packed_batch(make_samples())
    model.zero_grad(set_to_none=True)
    loss_ref = causal_lm_loss(
        model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS}).logits,
        batch["labels"],
        seq_idx=batch["seq_idx"],
    )
    loss_ref.backward()
    grads_ref = trainable_grads(model)
    model.zero_grad(set_to_none=True)
    loss = causal_lm_forward_with_linear_ce(model, {k: v for k, v in batch.items() if k != "sample_ids"})
    loss.backward()
    assert_exact(loss, loss_ref, rtol=LOSS_RTOL, what="loss")
    assert_exact(trainable_grads(model), grads_ref)
    assert not head_has_adapter(model)

    on_head = lora_model(lora_target_modules="q_proj,lm_head")
    assert head_has_adapter(on_head)
    with pytest.raises(ValueError, match="LM head .* adapter"):
        causal_lm_forward_with_linear_ce(on_head, {k: v for k, v in batch.items() if k != "sample_ids"})


def test_lora_config_validation():
    for bad in (
        {"lora_r": 0},
        {"lora_alpha": 0},
        {"lora_dropout": 1.0},
        {"lora_dropout": -0.1},
        {"lora_target_modules": " , "},
        {"lora_merge": True},  # without lora
    ):
        (field,) = bad
        with pytest.raises(ValueError, match=f"SFTConfig.{field} has an invalid value"):
            SFTConfig(**bad)
    assert SFTConfig(lora=True, lora_target_modules="q_proj, v_proj").lora_target_module_list() == ["q_proj", "v_proj"]
    assert SFTConfig().lora_target_module_list() == "all-linear"
    with pytest.raises(ValueError, match="lora_target_modules='no_such_proj'"):
        lora_model(lora_target_modules="no_such_proj")


class _Tok:
    pad_token_id = 0

    def save_pretrained(self, path):
        return None


def _synthetic(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = 2 + (7 * i + 3) % 23
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out.append({"input_ids": ids, "labels": [-100] + ids[1:], "length": length})
    return out


def _run_lora_sft(tmp_path, **cfg):
    from varpack.train.sft import run_sft

    model = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend="reference")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = SFTConfig(
        model="tiny-qwen3",
        output_dir=str(tmp_path / "out"),
        packing_length=32,
        attn_backend="reference",
        max_steps=2,
        lr=0.1,
        lora=True,
        lora_r=4,
        extra_training_args={"optim": "sgd", "max_grad_norm": 0.0, "use_cpu": True},
        **cfg,
    )
    run = run_sft(config, model=model, tokenizer=_Tok(), encoded=_synthetic(), print_fn=lambda *a: None)
    return run, before


@pytest.mark.parametrize("checkpointing", [False, True])
def test_sft_lora_trains_only_the_adapter_and_saves_it(tmp_path, checkpointing):
    import safetensors.torch

    run, before = _run_lora_sft(tmp_path, gradient_checkpointing=checkpointing)
    assert isinstance(run.model, peft.PeftModel)
    assert run.trainer.loss_impl_used == "linear_ce"  # auto: the head has no adapter
    base = run.model.get_base_model()
    params = dict(base.named_parameters())
    for name, value in before.items():  # every base weight as it was (peft names it ...base_layer.weight)
        key = (
            name
            if name in params
            else name.replace(".weight", ".base_layer.weight").replace(".bias", ".base_layer.bias")
        )
        assert torch.equal(params[key].detach(), value), name
    lora = {n: p.detach() for n, p in params.items() if "lora_" in n}
    assert lora and all(p.abs().max().item() > 0 for n, p in lora.items() if "lora_B" in n)  # B moved off 0
    out = tmp_path / "out"
    assert (out / "adapter_config.json").exists() and not (out / "model.safetensors").exists()
    saved = safetensors.torch.load_file(str(out / "adapter_model.safetensors"))
    assert len(saved) == len(lora) and all("lora_" in k for k in saved)
    assert json.loads((out / "adapter_config.json").read_text())["r"] == 4
    assert not (out / "merged").exists()


def test_sft_lora_merge_saves_base_plus_adapter(tmp_path):
    """The merged model (OUTPUT_DIR/merged) equals a fresh base model with the saved adapter loaded, and
    differs from the base alone."""
    from transformers import AutoModelForCausalLM

    _run_lora_sft(tmp_path, lora_merge=True)
    out = tmp_path / "out"
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    base = load_model("tiny-qwen3", vocab_size=VOCAB, attn_backend=None)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        plain = base(input_ids=ids).logits
        adapted = peft.PeftModel.from_pretrained(base, str(out))(input_ids=ids).logits
        got = merged(input_ids=ids).logits
    assert (adapted - plain).abs().max().item() > 1e-4
    assert (got - adapted).abs().max().item() <= 1e-5


def test_cli_sft_lora(tmp_path, capsys):
    """`varpack sft --lora ...` end to end: the adapter settings reach peft, the adapter and merged model
    are written."""
    from varpack.cli.main import main

    out = tmp_path / "run"
    # fmt: off
    code = main([
        "sft", "--model", "tiny-qwen3", "--packing-length", "256", "--overflow", "split", "--max-steps", "1",
        "--lora", "--lora-r", "2", "--lora-alpha", "4", "--lora-dropout", "0.1",
        "--lora-target-modules", "q_proj,v_proj", "--lora-merge", "--output-dir", str(out),
    ])
    # fmt: on
    text = capsys.readouterr().out
    assert code == 0, text
    assert "lora      r=2, alpha=4, dropout=0.1" in text and "done: 1 steps" in text
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 2 and cfg["lora_alpha"] == 4 and cfg["lora_dropout"] == 0.1
    assert sorted(cfg["target_modules"]) == ["q_proj", "v_proj"]
    assert (out / "merged" / "model.safetensors").exists() and (out / "merged" / "tokenizer.json").exists()


def test_adapter_on_gated_delta_conv_is_refused():
    """The packed short convolution reads conv1d.weight directly: an adapter there is an error, not dropped."""
    # peft's LoRA on a depthwise conv needs the rank divisible by its groups (128 channels here)
    model = lora_model("tiny-qwen3.5", lora_target_modules="conv1d", lora_r=128)
    batch = packed_batch(make_samples())
    with pytest.raises(ValueError, match=r"conv1d carries a LoRA"):
        model(**{k: v for k, v in batch.items() if k not in NOT_MODEL_INPUTS})
