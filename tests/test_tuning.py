"""Tree size for the hardware: E[tokens/step] / measured cost ratio."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton import costs
from mtp_lab.training import measure
from hf_models import make_hf

ACC = [[0.7, 0.1], [0.6, 0.1], [0.5, 0.1]]


def test_best_tree_trades_tau_for_cost(monkeypatch):
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2", dtype=torch.float32))
    # cost grows with T (a CPU): the best budget is small; flat cost (a memory-bound GPU): the largest
    monkeypatch.setattr(measure, "step_cost", lambda m, trees, **kw: [1.0 + 0.5 * (t.size - 1) for t in trees])
    tree, table = measure.best_tree(model, ACC, budgets=(1, 2, 4, 8))
    assert tree.size == 2 and table[0]["expected_speedup"] == pytest.approx(1.7 / 1.5)
    monkeypatch.setattr(measure, "step_cost", lambda m, trees, **kw: [1.0 for _ in trees])
    tree, table = measure.best_tree(model, ACC, budgets=(1, 2, 4, 8))
    assert tree.size == 9 and [r["nodes"] for r in table] == [2, 3, 5, 9]


def test_step_cost_measures_real_steps():
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2", dtype=torch.float32))
    times = costs.step_cost(model, [mt.Tree.root_only(), mt.get_tree("medusa-16")], batch=2, context=32, reps=3)
    assert len(times) == 2 and all(c > 0 for c in times)
