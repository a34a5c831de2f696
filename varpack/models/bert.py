"""BERT-style encoders run as causal LMs (``*ForCausalLM`` / ``*LMHeadModel`` with ``is_decoder=True``: BERT,
RoBERTa, XLM-R, ELECTRA, ERNIE, ...): softmax attention through transformers' attention interface, absolute
position embeddings read from ``position_ids`` (restarting at 0 for every packed sample), token type 0.

The model zoo verified these model types exact with ``is_decoder=True`` (docs/MODELS.md). Cross-attention on
encoder states (``add_cross_attention``) is refused by varpack attention (``encoder_hidden_states``).
"""

from __future__ import annotations

from varpack.models.registry import ModelFamily

__all__ = ["BERT_DECODER", "FAMILIES"]

BERT_DECODER = ModelFamily(
    name="bert-decoder",
    model_types=(
        "bert", "bert-generation", "camembert", "data2vec-text", "electra", "ernie", "roberta",
        "roberta-prelayernorm", "roc_bert", "xlm-roberta", "xlm-roberta-xl",
    ),  # fmt: skip
    mixers="attention",
    vision=False,
    position_ids="1d",
)

FAMILIES = (BERT_DECODER,)
