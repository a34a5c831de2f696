"""One GEMM for the projections that read the same input: an inductor pre-grad pass for compiled layers.

A decoder layer projects the same hidden states several times: ``q_proj``, ``k_proj`` and ``v_proj`` read the
attention norm's output, ``gate_proj`` and ``up_proj`` the MLP norm's. Run apart, each is its own GEMM forward,
its own input-gradient GEMM (whose results autograd then adds) and its own weight-gradient GEMM; at a hidden
size of 1,024 the weight gradients of ``k_proj`` / ``v_proj`` are 1,024 x 1,024 outputs, fewer tiles than an
H200 has SMs. :class:`FuseSharedInputLinears` rewrites the graph ``torch.compile`` traces so that linears
sharing one input run as one::

    linear(x, W1), linear(x, W2), ...   ->   y = linear(x, cat([W1, W2, ...])); y.split([n1, n2, ...], -1)

Each output element is the same dot product of the same row of ``x`` with the same row of a weight; only the
GEMM kernel that computes it changes, so results agree up to float summation order. The pass works token by
token, so it cannot mix samples of a packed row. The weights stay the model's own parameters (the
concatenation is part of the traced graph: its gradient splits back into each weight's gradient).

A group is fused only when it is safe to move every member up to the first one: same input node, all with or
all without a bias, the same weight dtype, every weight and bias defined before the first member, and no
in-place use of the input or of any member's output. Anything else is left as traced.

Source: the same rewrite as inductor's ``batch_linear_lhs`` pre-grad fusion
(``torch/_inductor/fx_passes/group_batch_fusion.py``), which matches 2-D inputs only; decoder layers project
``[B, T, D]`` hidden states.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["FuseSharedInputLinears", "fuse_shared_input_linears"]

_LINEARS = (torch._C._nn.linear, torch.nn.functional.linear)


def _linear_args(node: torch.fx.Node) -> tuple[Any, Any, Any] | None:
    """``(input, weight, bias)`` of a linear call node, else None."""
    if node.op != "call_function" or node.target not in _LINEARS:
        return None
    names = ("input", "weight", "bias")
    values = dict(zip(names, node.args))
    for name in names:
        if name in node.kwargs:
            values[name] = node.kwargs[name]
    if "input" not in values or "weight" not in values:
        return None
    return values["input"], values["weight"], values.get("bias")


def _mutates(node: torch.fx.Node) -> bool:
    """Whether ``node`` may write to one of its inputs (an in-place method / op, ``setitem``, ``out=``)."""
    if node.op not in ("call_function", "call_method"):
        return node.op == "call_module"  # a module could do anything to its input
    if node.target is operator.setitem or "out" in node.kwargs:
        return True
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        return True
    schema = getattr(node.target, "_schema", None)
    return bool(schema is not None and schema.is_mutable)


def _meta(node: Any) -> Any:
    return node.meta.get("example_value") if isinstance(node, torch.fx.Node) else None


def fuse_shared_input_linears(graph: torch.fx.Graph) -> int:
    """Rewrite ``graph`` in place: linears that read the same input become one linear over the concatenated
    weights followed by a split of its last dimension (module docstring). Returns the number of linears
    fused away (0: the graph is unchanged)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    groups: dict[tuple[Any, ...], list[torch.fx.Node]] = defaultdict(list)
    for node in graph.nodes:
        args = _linear_args(node)
        if args is None or not isinstance(args[0], torch.fx.Node) or not isinstance(args[1], torch.fx.Node):
            continue
        weight = _meta(args[1])
        if weight is None or weight.dim() != 2 or _meta(node) is None:
            continue
        if args[2] is not None and (not isinstance(args[2], torch.fx.Node) or _meta(args[2]) is None):
            continue
        groups[(args[0], args[2] is None, weight.dtype)].append(node)
    fused = 0
    for (x, _, _), nodes in groups.items():
        if len(nodes) < 2 or any(_mutates(user) for user in x.users):
            continue
        if any(_mutates(user) for node in nodes for user in node.users):
            continue
        first = min(nodes, key=order.__getitem__)
        weights = [_linear_args(n)[1] for n in nodes]
        biases = [_linear_args(n)[2] for n in nodes]
        inputs = weights + [b for b in biases if b is not None]
        if any(order[w] >= order[first] for w in inputs):
            continue
        sizes = [int(_meta(w).shape[0]) for w in weights]
        with graph.inserting_before(first):
            cat_w = graph.call_function(torch.cat, (weights,), {"dim": 0})
            cat_w.meta["example_value"] = torch.cat([_meta(w) for w in weights], dim=0)
            cat_b = None
            if biases[0] is not None:
                cat_b = graph.call_function(torch.cat, (biases,), {"dim": 0})
                cat_b.meta["example_value"] = torch.cat([_meta(b) for b in biases], dim=0)
            out = graph.call_function(torch._C._nn.linear, (x, cat_w, cat_b))
            out.meta["example_value"] = torch._C._nn.linear(_meta(x), cat_w.meta["example_value"],
                                                            None if cat_b is None else cat_b.meta["example_value"])  # fmt: skip
            parts = graph.call_function(torch.split, (out, sizes), {"dim": -1})
            parts.meta["example_value"] = torch.split(out.meta["example_value"], sizes, dim=-1)
            for i, node in enumerate(nodes):
                part = graph.call_function(operator.getitem, (parts, i))
                part.meta.update(node.meta)
                part.meta["example_value"] = parts.meta["example_value"][i]
                node.replace_all_uses_with(part)
        for node in nodes:
            graph.erase_node(node)
        fused += len(nodes) - 1
    return fused


class FuseSharedInputLinears(CustomGraphPass):
    """:func:`fuse_shared_input_linears` as inductor's ``pre_grad_custom_pass`` (a ``CustomGraphPass``, so
    inductor's FX graph cache keys on :meth:`uuid` instead of bypassing the cache). Instances compare equal:
    layers compiled with equal options share one dynamo backend, so the layers of a model (one ``forward`` code
    object) do not count as recompilations against dynamo's ``recompile_limit``."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        fuse_shared_input_linears(graph)

    def uuid(self) -> Any:
        return "varpack.fuse_shared_input_linears.v1"

    def __eq__(self, other: object) -> bool:  # equal passes: equal compile options, so one backend for all layers
        return isinstance(other, FuseSharedInputLinears) and other.uuid() == self.uuid()

    def __hash__(self) -> int:
        return hash(self.uuid())
