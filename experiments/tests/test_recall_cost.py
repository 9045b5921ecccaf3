"""The options' cost script (recall/cost.py): every method runs, one row each, the CSV as documented."""

from __future__ import annotations

import csv

import pytest
import torch

from mita_experiments.recall import cost


def test_inputs_repeat_three_quarters():
    q, k, v = cost.inputs(16, batch=2)
    assert k.shape == v.shape == q.shape
    assert q.shape == (2, 2, 16, 32) and q.requires_grad
    assert torch.equal(q[:, :, 4:], q[:, :, 4:5].expand(-1, -1, 12, -1)) and not torch.equal(q[:, :, 0], q[:, :, 1])


def test_main_writes_one_row_per_method(tmp_path, capsys):
    out = tmp_path / "cost.csv"
    threads = torch.get_num_threads()
    try:
        assert cost.main(["--out", str(out), "--lengths", "16", "--rounds", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["method"] for r in rows] == list(cost.METHODS) and all(float(r["ms_median"]) > 0 for r in rows)
    assert set(rows[0]) == set(cost.FIELDS) and "distinct + merge" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cost.main(["--out", str(out), "--rounds", "0"])
