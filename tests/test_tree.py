"""Tree: from_choices, presets, validation, and the builder from measured accuracies."""
import itertools

import pytest
import torch

from mtp_triton.tree import PRESETS, TYPICAL_ACC, Tree, get_tree


def test_from_choices_structure():
    t = Tree.from_choices([(1,), (0, 0), (0,), (1, 0), (0, 1)])
    assert t.paths == ((), (0,), (1,), (0, 0), (0, 1), (1, 0))
    assert t.parents.tolist() == [-1, 0, 0, 1, 1, 2]
    assert t.depth.tolist() == [0, 1, 1, 2, 2, 2]
    assert t.rank.tolist() == [0, 0, 1, 0, 1, 0]
    assert t.top_k == 2 and t.max_depth == 2 and t.size == 6
    # mask[i, j] = j is i or an ancestor of i
    for i, j in itertools.product(range(6), range(6)):
        pi, pj = t.paths[i], t.paths[j]
        assert bool(t.mask[i, j]) == (pi[: len(pj)] == pj)


@pytest.mark.parametrize("choices,match", [
    ([(0,), (0, 0), (1, 1)], "no parent"), ([(0,), (0,)], "duplicate"), ([(0,), (5,)], "top_k"),
    ([()], "root"), ([(0,), (-1,)], ">= 0"), ([3], "tuple"),
])
def test_bad_choices(choices, match):
    with pytest.raises(ValueError, match=match):
        Tree.from_choices(choices, top_k=4)


def test_presets_valid():
    for name in PRESETS:
        t = get_tree(name)
        n = int(name.split("-")[1])
        assert t.size == n + 1
        assert torch.all(t.parents[1:] < torch.arange(1, t.size))
    with pytest.raises(ValueError, match="exceeds"):
        get_tree("chain-8", num_heads=4)


def test_from_accuracies_is_optimal_and_prefix_closed():
    acc = [[0.7, 0.2, 0.05], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]]
    for budget in (1, 3, 5, 8):
        t = Tree.from_accuracies(acc, budget)
        assert t.size == budget + 1
        # brute force: best expected accepted length over all prefix-closed trees of this size
        all_paths = [p for d in (1, 2, 3) for p in itertools.product(range(3), repeat=d)]
        prob = {p: torch.prod(torch.tensor([acc[d][r] for d, r in enumerate(p)])).item() for p in all_paths}
        best = sum(sorted(prob.values(), reverse=True)[:budget])   # upper bound, achieved by a prefix-closed set
        assert t.expected_accept_len(acc) == pytest.approx(best)


def test_typical_presets_grow_expected_length():
    e = [get_tree(f"medusa-{n}").expected_accept_len(TYPICAL_ACC) for n in (8, 16, 32, 64)]
    assert e == sorted(e) and e[0] > get_tree("chain-4").expected_accept_len(TYPICAL_ACC) * 0.9
