"""The packing report (varpack.plan.report): one summary dict, rendered as the `varpack plan` table, the
`varpack sft` text and PNG histograms."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest

from varpack.plan import plan_packs
from varpack.plan.report import format_packing_report, plan_summary, summary_table, summary_text

LENGTHS = [3, 10, 0, 7, 25, 4]  # packing_length 6: samples 1, 3, 4 overlong, sample 2 empty


def _render(table) -> str:
    from rich.console import Console

    buf = io.StringIO()
    Console(file=buf, width=200).print(table)
    return buf.getvalue()


def test_summary_is_the_stats_then_input_tokens_overflow_and_context():
    plan = plan_packs(LENGTHS, 6, overflow="split")
    summary = plan_summary(plan, np.asarray(LENGTHS, np.int32), data="toy", seed=plan.seed)
    keys = list(summary)
    assert keys[: len(plan.stats)] == list(plan.stats)
    assert keys[len(plan.stats) :] == ["input_tokens", "overflow", "data", "seed"]
    assert summary["input_tokens"] == sum(LENGTHS) == 49 and summary["total_tokens"] == 49
    assert summary["overflow"] == plan.overflow and summary["num_pieces"] == 2 + 2 + 5


def test_summary_refuses_lengths_of_another_dataset():
    plan = plan_packs(LENGTHS, 6, overflow="drop")
    with pytest.raises(ValueError, match="lengths has 5 entries but the plan was made for 6 samples"):
        plan_summary(plan, LENGTHS[:5], data="toy")


@pytest.mark.parametrize(
    "overflow, table_over, text_over",
    [
        (
            "drop",
            "3 overlong (dropped), 1 empty, 42 tokens dropped",
            "3 overlong (dropped), 1 empty, 42 tokens",
        ),
        ("truncate", "3 overlong (truncated), 1 empty, 24 tokens dropped", "3 overlong (truncated)"),
        (
            "split",
            "3 overlong (split, 9 pieces), 1 empty, 0 tokens",
            "3 overlong (split into 9 pieces), 1 empty",
        ),
    ],
)
def test_table_and_text_render_the_same_summary(overflow, table_over, text_over):
    plan = plan_packs(LENGTHS, 6, overflow=overflow, strategy="sequential")
    summary = plan_summary(plan, LENGTHS, data=["a.jsonl", "b.jsonl"], seconds={"encode": 1.5, "plan": 0.25})
    table = _render(summary_table(summary))
    assert f"varpack plan: sequential, packing_length=6, overflow={overflow}" in table
    assert "a.jsonl, b.jsonl" in table and table_over in table
    assert f"{plan.fill_ratio:.4%}" in table and "encode 1.50 s, plan 0.250 s" in table
    assert re.search(rf"│ packs\s+│\s+{plan.num_packs} │", table)
    assert re.search(rf"│ lower bound\s+│\s+{plan.lower_bound_packs} │", table)
    text = summary_text({**summary, "data": "toy"})
    assert text.splitlines()[0] == f"packing report (sequential, packing_length=6, overflow={overflow})"
    assert "  samples   6 (49 tokens)" in text and f"  fill      {plan.fill_ratio:.2%}" in text
    assert text_over in text and "warning" not in text
    # the convenience entry point (input token count instead of lengths) gives the same text
    assert format_packing_report(plan, data="toy", input_tokens=49) == text


def test_table_without_optional_rows():
    plan = plan_packs([3, 5, 4], 8)
    table = _render(summary_table(plan_summary(plan, [3, 5, 4], data="builtin")))
    assert "built-in chats" in table and "none overlong, 0 empty, 0 tokens dropped" in table
    assert "time" not in table and "format" not in table
