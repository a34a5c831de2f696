"""``flex`` backend: PyTorch FlexAttention with a document mask.

The stream is viewed as one batch row ``[1, H, T, D]``; a ``mask_mod`` keeps query i / key j only when both
belong to the same segment and (optionally) the causal / window rule holds inside that segment, with
flash-attn's bottom-right alignment. Softcap is a ``score_mod``. GQA goes through ``enable_gqa``. A value head
dim other than the query / key one (MLA) is FlexAttention's own. Attention sinks renormalize the output with
FlexAttention's log-sum-exp ``lse`` (a row's weights scale by ``exp(lse) / (exp(lse) + exp(sink))`` =
``sigmoid(lse - sink)``), differentiable through ``lse``.

The BlockMask is built once per batch and reused by every layer: it is kept on the batch's
:class:`varpack.varlen.VarlenMeta` (``meta.memo``, keyed by the mask parameters), the one object that reaches
every layer of a step; a direct call without a meta builds it for that call. On CUDA, ``flex_attention`` is compiled once per process
(module level) and the block mask is built with the compiled builder; nothing reads cu_seqlens values on the
host. On the CPU flex runs eagerly and forward-only (torch raises on a CPU backward; it also materializes the
masked ``[H, Tq, Tk]`` score matrix), so ``auto`` does not choose it there; it stays available by name for
inference.

Source: "FlexAttention: The Flexibility of PyTorch with the Performance of FlashAttention" (PyTorch blog,
2024) and ``torch.nn.attention.flex_attention`` (document masking example).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ._base import Backend, CallSpec, Capabilities

if TYPE_CHECKING:
    from varpack.varlen.meta import VarlenMeta

__all__ = ["FlexBackend", "document_block_mask"]

_COMPILED: dict[str, Any] = {}


def _flex_module():
    return importlib.import_module("torch.nn.attention.flex_attention")


def _flex_attention_fn(device: torch.device):
    """Compiled ``flex_attention`` on CUDA (compiled once per process), eager elsewhere.

    One model's training compiles it for a handful of shapes (the token count becomes a dynamic size after
    the first change). A process that runs many different head dims / dtypes / score mods (a test suite)
    can pass torch's recompile limit, after which ``torch.compile`` runs FlexAttention eagerly: still exact
    (the block mask is applied) but the dense math path, with host syncs; ``torch.compiler.reset()``
    starts a fresh cache.
    """
    fa = _flex_module()
    if device.type != "cuda":
        return fa.flex_attention
    fn = _COMPILED.get("flex_attention")
    if fn is None:
        fn = torch.compile(fa.flex_attention)
        _COMPILED["flex_attention"] = fn
    return fn


_PAD_TO = 128  # FlexAttention's block size: index tables cover whole blocks, so no lookup is out of bounds


def _doc_ids(cu: torch.Tensor, total: int, pad_id: int) -> torch.Tensor:
    """Segment index of every token, ``[total]`` rounded up to a multiple of 128 (int32); positions past
    ``cu[-1]`` (the tail of the last block included) get ``pad_id``."""
    padded = -(-max(total, 1) // _PAD_TO) * _PAD_TO
    positions = torch.arange(padded, device=cu.device, dtype=cu.dtype)
    ids = torch.searchsorted(cu[1:].contiguous(), positions, right=True)
    num_segments = cu.shape[0] - 1
    ids = torch.where(ids >= num_segments, torch.full_like(ids, pad_id), ids)
    return ids.to(torch.int32)


def document_block_mask(
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    total_q: int,
    total_k: int,
    *,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
):
    """FlexAttention ``BlockMask`` for a packed stream: same segment, plus causal / window per segment.

    Args:
        cu_seqlens_q, cu_seqlens_k: ``[N+1]`` int32 offsets on the target device (values never read here).
        total_q, total_k: Tq, Tk (Python ints).
        causal, window_size: flash-attn semantics (bottom-right aligned; ``-1`` = unbounded; causal forces
            right = 0).

    Returns:
        ``torch.nn.attention.flex_attention.BlockMask`` with ``B = H = 1`` broadcast.
    """
    fa = _flex_module()
    device = cu_seqlens_q.device
    num_segments = cu_seqlens_q.shape[0] - 1
    cu_q = cu_seqlens_q.to(torch.int32)
    cu_k = cu_seqlens_k.to(torch.int32)
    # Padding ids differ for q (N) and k (N + 1) so that tokens past the last offset never match.
    doc_q = _doc_ids(cu_q, total_q, num_segments)
    doc_k = _doc_ids(cu_k, total_k, num_segments + 1)
    zeros = torch.zeros(2, dtype=torch.int32, device=device)
    start_q = torch.cat([cu_q[:-1], zeros])
    start_k = torch.cat([cu_k[:-1], zeros])
    # bottom-right alignment: diag(i) = i + len_k - len_q inside a segment
    offset = torch.cat([(cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1]), zeros])
    left, right = int(window_size[0]), int(window_size[1])
    if causal:
        right = 0

    def mask_mod(b, h, q_idx, kv_idx):
        dq = doc_q[q_idx]
        keep = dq == doc_k[kv_idx]
        diag = q_idx - start_q[dq] + offset[dq]
        j = kv_idx - start_k[dq]
        if right >= 0:
            keep = keep & (j <= diag + right)
        if left >= 0:
            keep = keep & (j >= diag - left)
        return keep

    return fa.create_block_mask(
        mask_mod,
        B=None,
        H=None,
        Q_LEN=total_q,
        KV_LEN=total_k,
        device=device,
        _compile=device.type == "cuda",
    )


def _block_mask(cu_q, cu_k, total_q, total_k, causal, window_size, meta):
    """The document block mask: built once per batch and kept on the batch's :class:`VarlenMeta` (every layer
    of a step reads the same one); without a meta, built for this call."""
    if meta is None:
        return document_block_mask(cu_q, cu_k, total_q, total_k, causal=causal, window_size=window_size)
    key = ("flex_block_mask", str(cu_q.device), total_q, total_k, bool(causal), tuple(window_size))
    return meta.memo(
        key,
        lambda: document_block_mask(cu_q, cu_k, total_q, total_k, causal=causal, window_size=window_size),
    )


def _lse_request() -> dict[str, Any]:
    """flex_attention's keyword asking for the log-sum-exp: ``return_aux=AuxRequest(lse=True)`` where torch has
    it (``return_lse`` is deprecated there), else ``return_lse=True``."""
    fa = _flex_module()
    if hasattr(fa, "AuxRequest"):
        return {"return_aux": fa.AuxRequest(lse=True)}
    return {"return_lse": True}


def _softcap_score_mod(softcap: float):
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


class FlexBackend(Backend):
    name = "flex"
    capabilities = Capabilities(
        devices=frozenset({"cuda", "cpu"}),
        dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}),
        sinks=True,
        distinct_v_head_dim=True,
        notes=(
            "FlexAttention document mask; BlockMask built once per batch (cached on the cu_seqlens tensors); "
            "compiled on CUDA; eager and forward-only on the CPU (memory ~ H*Tq*Tk)"
        ),
    )

    def _probe(self) -> tuple[bool, str]:
        try:
            fa = _flex_module()
        except ImportError as exc:
            return False, f"torch {torch.__version__} has no FlexAttention ({exc})"
        for attr in ("flex_attention", "create_block_mask"):
            if not hasattr(fa, attr):
                return False, f"torch {torch.__version__} FlexAttention lacks {attr}"
        return True, f"torch {torch.__version__} FlexAttention"

    def _extra_supports(self, spec: CallSpec) -> tuple[bool, str]:
        if spec.device.type == "cpu" and spec.needs_grad:
            return False, f"FlexAttention has no backward on the CPU (torch {torch.__version__})"
        if spec.device.type == "cuda":
            for name, d in (("D", spec.head_dim), ("Dv", spec.head_dim_v or spec.head_dim)):
                if d < 16 or d > 256 or d & (d - 1):
                    return False, f"compiled FlexAttention needs power-of-two head dims in [16, 256], got {name}={d}"
        return True, "ok"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        *,
        causal: bool,
        window_size: tuple[int, int],
        softmax_scale: float,
        softcap: float,
        meta: VarlenMeta | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total_q, total_k = q.shape[0], k.shape[0]
        if total_q == 0:
            return q.new_zeros(0, q.shape[1], v.shape[-1])
        block_mask = _block_mask(cu_seqlens_q, cu_seqlens_k, total_q, total_k, causal, window_size, meta)
        fn = _flex_attention_fn(q.device)
        if q.device.type == "cpu" and not torch.is_grad_enabled():
            # eager CPU flex refuses inputs that require grad even under no_grad: nothing to track here
            q, k, v = q.detach(), k.detach(), v.detach()
        score_mod = _softcap_score_mod(softcap) if softcap > 0 else None
        qf, kf, vf = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, H, T, D]
        with warnings.catch_warnings():
            # eager (CPU) flex warns that it materializes the score matrix: known, documented above
            warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
            out = fn(
                qf,
                kf,
                vf,
                score_mod=score_mod,
                block_mask=block_mask,
                scale=softmax_scale,
                enable_gqa=q.shape[1] != k.shape[1],
                **(_lse_request() if sinks is not None else {}),
            )
        if sinks is not None:  # out * exp(lse) / (exp(lse) + exp(sink)), per head and row
            out, aux = out
            lse = getattr(aux, "lse", aux)
            weight = torch.sigmoid(lse.float() - sinks.float().view(1, -1, 1))
            out = (out.float() * weight.unsqueeze(-1)).to(q.dtype)
        return out.squeeze(0).transpose(0, 1)
