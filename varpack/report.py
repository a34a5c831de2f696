"""Moved: the packing report (PNG histograms, summary, table and text) lives in :mod:`varpack.plan.report`.

This module re-exports ``plot_plan_report`` so that ``from varpack.report import plot_plan_report`` keeps
working; the package itself imports from ``varpack.plan.report``.
"""

from varpack.plan.report import plot_plan_report

__all__ = ["plot_plan_report"]
