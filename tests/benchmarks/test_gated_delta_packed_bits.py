"""benchmarks/gated_delta_packed_bits.py: one packed row against one call per sample, on the same inputs."""

from __future__ import annotations

import torch

import benchmarks.gated_delta_packed_bits as bits

DIMS = (2, 2, 16, 16)
LENGTHS = [70, 13, 65, 1]


def test_chunk_rule_computes_each_sample_alike_packed_or_alone():
    r = bits.trial("chunk", LENGTHS, DIMS, 0, "cpu", torch.float32)
    for name in bits.NAMES:
        assert r[name]["packed_vs_per_sample"] < 1e-5, (name, r[name])
        assert r[name]["packed_err"] < 1e-4 and r[name]["per_sample_err"] < 1e-4
    assert r["gate_sum"]["packed_err"] < 1e-4


def test_a_row_without_its_boundaries_is_reported(monkeypatch):
    """Negative control: the packed call loses its boundaries (the row becomes one sequence)."""
    real = bits._call

    def joined(backend, ins, do, cu, device):
        if len(cu) > 2:
            cu = torch.tensor([0, int(cu[-1])])
        return real(backend, ins, do, cu, device)

    monkeypatch.setattr(bits, "_call", joined)
    r = bits.trial("chunk", LENGTHS, DIMS, 0, "cpu", torch.float32)
    assert r["o"]["packed_vs_per_sample"] > 1e-2
    assert r["dg"]["packed_vs_per_sample"] > 1e-2


def test_main_prints_the_table(capsys):
    assert bits.main(["--backend", "chunk", "--device", "cpu", "--dims", "2", "2", "16", "16", "--lengths", "9",
                      "4", "--trials", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "| dg |" in out and "ratio packed / per sample" in out
