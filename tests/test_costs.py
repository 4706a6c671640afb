"""The verify-step cost model (mtp_triton.costs) and what it drives on a CPU by default: the pruner (sizing.CostPruner),
and the fallback by cost with the calibration it feeds the pruner (policy.RuntimePolicy): the table's interpolation
and cache, the choice of n per row, the fallback's deficit and backoff, and lossless decoding with both."""
import json

import pytest
import torch

import mtp_triton as mt
from mtp_triton import costs
from mtp_triton.costs import LiveCosts, StepCosts, live_costs, step_costs
from mtp_triton.drafters import OracleDrafter
from mtp_triton.policy import RuntimeConfig, RuntimePolicy
from mtp_triton.sizing import CostPruner
from mtp_triton.tree import get_tree
from hf_models import make_hf
from test_pruning import _path_probs, case  # noqa: F401  (case: the tiny model, two prompts, transformers' tokens)


def test_step_costs_interpolate_and_refuse_bad_tables():
    c = StepCosts([1, 2, 4, 8], [0.10, 0.08, 0.12, 0.20])
    assert c.seconds(1) == 0.10 and c.seconds(3) == pytest.approx(0.10) and c.seconds(6) == pytest.approx(0.16)
    assert c.seconds(50) == 0.20                                          # clamped past the last size
    assert c.ratios(4).tolist() == pytest.approx([1.0, 0.8, 1.0, 1.2])
    assert "2:0.80" in c.describe()
    for sizes, secs in (([2, 4], [1, 1]), ([1, 4, 2], [1, 1, 1]), ([1, 2], [1.0]), ([1, 2], [0.1, 0.0]),
                        ([1, 2], [0.1, float("inf")]), ([1, 2.0], [1, 1]), ([True, 2], [1, 1]), ([1, 2], [1, True])):
        with pytest.raises(ValueError, match="StepCosts"):
            StepCosts(sizes, secs)


def test_step_costs_are_measured_once_then_read_from_the_cache(case, tmp_path, monkeypatch):
    model = case[0]
    path = str(tmp_path / "sub" / "step_costs.json")
    calls = []
    # plausible times (c(T) / c(1) in bounds): one timing of the tiny model can be all noise, and an implausible
    # table is measured again, which is another test's business
    monkeypatch.setattr(costs, "step_cost", lambda m, trees, **kw: calls.append([t.size for t in trees])
                        or [0.001 * (1 + 0.05 * t.size) for t in trees])
    first = step_costs(model, 17, path=path)
    assert calls == [[1, 2, 4, 8, 16, 17]] and first.sizes == [1, 2, 4, 8, 16, 17]
    again = step_costs(model, 12, path=path)                              # smaller tree: the same entry serves
    assert len(calls) == 1 and again.times == first.times and "cached" in again.source
    step_costs(model, 40, path=path)                                      # a bigger tree: measured again
    assert calls[-1][-1] == 40
    with open(path, "w") as f:                                            # a damaged cache: measured again
        f.write('{"torn')
    step_costs(model, 17, path=path)
    assert len(calls) == 3 and json.load(open(path))                      # ... and the file rewritten whole
    monkeypatch.setattr(torch, "get_num_threads", lambda: 99)            # another machine setting: its own entry
    assert costs.machine_key(model, "torch", 1) not in json.load(open(path))


def test_live_costs_follow_the_machine_and_forget_a_busy_spell():
    """The level of a slower or faster machine cancels in c(T) / c(1); a change of shape is learned from steps of
    several sizes; steps of one size alone keep the table's shape (the ridge); a busy spell fades after it ends."""
    table = StepCosts([1, 2, 4, 8, 16, 32], [0.040, 0.041, 0.045, 0.055, 0.070, 0.100])
    live = LiveCosts(table)
    for _ in range(50):                                   # everything 1.7x slower: the ratios stay the table's
        for T in (1, 4, 16, 32):
            live.observe(T, 1.7 * table.seconds(T))
    assert live.seconds(8) == pytest.approx(1.7 * table.seconds(8), rel=1e-6)
    assert live.ratios(32).tolist() == pytest.approx(table.ratios(32).tolist(), rel=1e-6)
    one = LiveCosts(table)
    for _ in range(50):                                   # only 8-node steps, slower: level moves, shape holds
        one.observe(8, 3 * table.seconds(8))
    assert one.seconds(8) == pytest.approx(3 * table.seconds(8), rel=0.05)
    assert float(one.ratios(32)[-1]) == pytest.approx(float(table.ratios(32)[-1]), rel=0.35)
    busy = LiveCosts(table)
    for _ in range(60):                                   # a busy spell that slows big trees most: c(32)/c(1) up
        for T in (1, 32):
            busy.observe(T, table.seconds(T) * (1 if T == 1 else 2.0))
    assert busy.ratios(32)[-1] > 1.6 * table.ratios(32)[-1]
    for _ in range(200):                                  # the spell ends: back to the table's shape
        for T in (1, 32):
            busy.observe(T, table.seconds(T))
    assert float(busy.ratios(32)[-1]) == pytest.approx(float(table.ratios(32)[-1]), rel=0.05)
    busy.observe(4, float("nan")), busy.observe(4, -1.0)  # a broken timing is ignored
    assert "live over 520 steps" in busy.describe()


def test_generate_feeds_the_live_costs_and_keeps_them_for_the_process(case, tmp_path, monkeypatch):
    model, prompts = case[0], case[1]
    monkeypatch.setenv("MTP_TRITON_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "step_cost", lambda m, trees, **kw: [0.01 * (1 + 0.1 * t.size) for t in trees])
    heads = mt.init_heads(model, num_heads=3, seed=0)
    run = lambda: mt.generate(model, prompts[:1], 12, heads=heads, runtime=RuntimeConfig(size_by_cost=True))
    run()
    live = live_costs(model, 1)                                         # the one that run used, kept
    before = live.steps
    res = run()
    assert live.steps - before == res.stats.steps > 0                   # every step observed, in the same model
    assert live_costs(model, 1) is live and "live over" in res.stats.cost_model


@pytest.mark.parametrize("sizes, secs", [
    ([1, 2, 32], [0.01, 0.01, float("inf")]),             # Infinity seconds
    ([1, 2, 32], [0.01, 0.012, 0.5]),                      # c(32) / c(1) = 50
    ([1, 2.0, 4], [0.01, 0.01, 0.01]),                     # a float size
    ([True, 2, 4], [0.01, 0.01, 0.01]),                    # a bool for a size
    ([1, 2, 10 ** 12], [0.01, 0.01, 0.01]),                # an absurd size
    ([1, 2], [0.01, True]),                                # a bool for seconds
])
def test_an_implausible_stored_table_is_measured_again_and_replaced(case, tmp_path, monkeypatch, sizes, secs):
    """A damaged or hand-made entry in the cache file (issue: 'cost tables without bounds' switched speculation off
    until the file was deleted) is refused, measured again and overwritten."""
    model = case[0]
    path = str(tmp_path / "step_costs.json")
    key = costs.machine_key(model, mt.ops.get_ops("auto", model.device).kind, 1)
    with open(path, "w") as f:
        json.dump({key: dict(sizes=sizes, seconds=secs)}, f)
    calls = []
    real = costs.step_cost
    monkeypatch.setattr(costs, "step_cost", lambda m, trees, **kw: calls.append(1) or real(m, trees, reps=1, **kw))
    c = step_costs(model, 8, path=path)
    assert calls == [1] and "measured now" in c.source
    assert json.load(open(path))[key]["sizes"] == [1, 2, 4, 8]


def test_an_unwritable_cache_is_measured_once_per_process_with_a_warning(case, tmp_path, monkeypatch):
    model = case[0]
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    path = str(blocker / "step_costs.json")                                # its folder cannot be made
    calls = []
    real = costs.step_cost
    monkeypatch.setattr(costs, "step_cost", lambda m, trees, **kw: calls.append(1) or real(m, trees, reps=1, **kw))
    with pytest.warns(UserWarning, match="cannot write"):
        first = step_costs(model, 8, path=path)
    again = step_costs(model, 8, path=path)
    assert calls == [1] and again is first and "not cached" in first.source


def _pruner(times):
    return CostPruner(StepCosts(list(range(1, len(times) + 1)), times))


def test_cost_pruner_keeps_the_n_that_pays_per_row():
    tree = get_tree("medusa-16")
    T = tree.size
    g = torch.Generator().manual_seed(0)
    node = torch.rand(3, T, generator=g)
    node[:, 0] = 1.0
    prob = _path_probs(tree, node)
    tokens = torch.randint(0, 100, (3, T), generator=g)
    flat = _pruner([1.0] * T)                                             # free nodes: verify all of them
    sub, _, _ = flat(tree, tokens, prob, tree.parents)
    assert sub.size == T
    dear = _pruner([1.0] + [1e6] * (T - 1))                               # any second node costs a fortune: serial
    sub, sub_tokens, _ = dear(tree, tokens[:1], prob[:1], tree.parents)
    assert sub.size == 1 and sub_tokens.tolist() == tokens[:1, :1].tolist()
    # linear cost c(n) = 1 + 0.1 (n - 1): by hand, each row keeps its n most probable nodes for the best
    # 1 + alpha S(n) - rho c(n) / c(1), S(n) the sum of its n - 1 largest path probabilities; first without history
    # (alpha = rho = 1), then with a drafter found twice too confident on row 1 and a rate of 1.5 on row 2
    lin = _pruner([1.0 + 0.1 * n for n in range(T)])
    for alpha, rho in (([1.0] * 3, [1.0] * 3), ([1.0, 0.5, 1.0], [1.0, 1.0, 1.5])):
        if alpha[1] != 1.0:
            lin.weigh(alpha, rho)
        keep = lin.keep(prob, torch.ones(3, T, dtype=torch.bool))
        for a in range(3):
            p = sorted(prob[a, 1:].tolist(), reverse=True)
            score = [1 + alpha[a] * sum(p[:n - 1]) - rho[a] * (1 + 0.1 * (n - 1)) for n in range(1, T + 1)]
            n_best = score.index(max(score)) + 1
            assert int(keep[a].sum()) == n_best
            assert float(lin.predicted[a]) == pytest.approx(sum(p[:n_best - 1]))
            kept = set(keep[a].nonzero()[:, 0].tolist())
            assert all(int(tree.parents[i]) in kept for i in kept if i > 0)   # a subtree
    off = torch.ones(3, T, dtype=torch.bool)
    off[:, T // 2:] = False                                               # nodes a row does not use stay off
    assert not lin.keep(prob, off)[:, T // 2:].any()


def test_default_decoding_sizes_by_cost_and_stays_lossless(case):
    model, prompts, ref = case
    heads = mt.init_heads(model, 4, seed=2)
    heads.tree = mt.get_tree("medusa-16").paths[1:]                       # a tree stored with the heads
    auto = mt.generate(model, prompts, 24, heads=heads)
    full = mt.generate(model, prompts, 24, heads=heads, runtime=mt.RuntimeConfig(size_by_cost=False))
    pinned = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16")   # a tree passed in: verified whole
    assert auto.tokens == full.tokens == pinned.tokens == ref
    assert auto.stats.cost_model.startswith("c(T)/c(1) 1:1.00") and full.stats.cost_model is None
    assert pinned.stats.cost_model is None and pinned.stats.verified_nodes_per_step == 17
    assert full.stats.verified_nodes_per_step == 17 and 1 <= auto.stats.verified_nodes_per_step <= 17
    forced = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16", runtime=mt.RuntimeConfig(size_by_cost=True))
    assert forced.tokens == ref and forced.stats.cost_model is not None
    serial = mt.generate(model, prompts, 24, heads=heads, mtp=False)
    assert serial.stats.cost_model is None and serial.tokens == ref
    sampled = [mt.generate(model, prompts, 12, heads=heads, temperature=0.8, seed=3,
                           runtime=mt.RuntimeConfig(size_by_cost=flag)).tokens for flag in (True, False)]
    assert all(len(t) == 12 for row in sampled for t in row)


def test_size_by_cost_settings_are_checked(case):
    model, prompts, _ = case
    with pytest.raises(ValueError, match="size_by_cost must be"):
        mt.RuntimeConfig(size_by_cost="yes")
    with pytest.raises(ValueError, match="set one"):
        mt.RuntimeConfig(size_by_cost=True, prune_below=0.1)
    oracle = OracleDrafter([[1] * 40] * 2, [0.9] * 4, model.config.vocab_size)
    with pytest.raises(ValueError, match="reports probabilities"):
        mt.generate(model, prompts, 4, drafter=oracle, tree="chain-4", runtime=mt.RuntimeConfig(size_by_cost=True))
    res = mt.generate(model, prompts, 4, drafter=oracle, tree="chain-4")   # auto: off for such a drafter
    assert res.stats.cost_model is None


def test_an_fp32_model_drafts_in_bf16_where_the_cpu_has_it(case, monkeypatch):
    """Drafts only steer speed: an fp32 engine on a CPU with native bf16 drafts with bf16 weights (half the LM-head
    bytes per draft), and the output is still the target's own."""
    import mtp_triton.drafters as drafters
    import mtp_triton.ops as ops_mod
    from mtp_triton.ops import get_ops
    model, prompts, _ = case
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"), dtype=torch.float32)
    ref = mt.generate(model, prompts, 24, mtp=False).tokens
    heads = mt.init_heads(model, 4, seed=2)
    ops = get_ops("torch", model.device)
    monkeypatch.setattr(ops_mod, "native_bf16", lambda: True)
    d = drafters.HeadsDrafter(heads, model, ops)
    assert d.fused_draft is drafters.bf16_draft and d.lm_head.dtype == d.res_weight.dtype == torch.bfloat16
    assert mt.generate(model, prompts, 24, heads=heads).tokens == ref
    monkeypatch.setattr(ops_mod, "native_bf16", lambda: False)
    d = drafters.HeadsDrafter(heads, model, ops)
    assert d.fused_draft is not drafters.bf16_draft and d.lm_head.dtype == torch.float32
    assert drafters.HeadsDrafter(heads, model, ops, draft_dtype=torch.bfloat16).fused_draft is drafters.bf16_draft
    with pytest.raises(ValueError, match="draft_dtype"):
        drafters.HeadsDrafter(heads, model, get_ops("triton", model.device), draft_dtype=torch.bfloat16)


def test_a_step_costs_its_verify_ratio_and_its_drafting_in_serial_steps():
    c = StepCosts([1, 2, 4], [0.10, 0.13, 0.15])
    assert c.serial_steps(1, 0.10, 0.0) == pytest.approx(1.0)
    assert c.serial_steps(4, 0.20, 0.05) == pytest.approx(1.5 * 0.20 / 0.15)    # c(4)/c(1), scaled by drafting
    assert c.serial_steps(2, 0.01, 0.02) == pytest.approx(1.3)                  # a timer glitch: the ratio alone


def test_fallback_by_cost_adds_up_the_loss_and_backs_off():
    cfg = RuntimeConfig(fallback_steps=4, fallback_deficit=2.0)
    pol = RuntimePolicy(cfg, batch=2, max_depth=3, by_cost=True)

    def step(tokens, cost, acc=0, pred=1.0):
        depths = pol.depths([0, 1])
        return depths, pol.update([0, 1], depths, [acc, acc], [tokens, 3], [pred, pred], cost)

    # sequence 0 emits 1 token per step costing 1.5 serial steps: 0.5 lost a step, serial after 4 steps
    # (sequence 1 emits 3 per step: it never falls back)
    for _ in range(3):
        assert step(1, 1.5) == ([3, 3], 0)
    assert pol.deficit[0] == pytest.approx(1.5) and pol.deficit[1] == 0.0
    assert step(1, 1.5) == ([3, 3], 1)
    for _ in range(4):                                                     # 4 serial steps, then speculation again
        assert step(1, 1.5)[0] == [0, 3]
    for _ in range(4):
        assert step(1, 1.5)[0] == [3, 3]
    for _ in range(8):                                                     # a second fallback in a row: twice as long
        assert step(1, 1.5)[0] == [0, 3]
    assert step(3, 1.5)[0] == [3, 3] and pol.deficit[0] == 0.0 and pol.backoff[0] == 1   # it paid: backoff reset
    # a sequence drafts at most one level below the deepest node the pruner kept at its last step
    pol.update([0, 1], [3, 3], [0, 0], [3, 3], [1.0, 1.0], 1.0, [1, 0])
    assert pol.depths([0, 1]) == [2, 1]
    # the calibration the pruner gets: accepted over predicted drafts (+1 each), and the rate, at least 1
    pol = RuntimePolicy(cfg, batch=1, max_depth=3, by_cost=True)
    assert pol.calibration([0]) == ([1.0], [1.0])
    pol.update([0], [3], [1], [2], [3.0], 1.25)
    pol.update([0], [3], [0], [1], [1.0], 1.25)
    alpha, rho = pol.calibration([0])
    assert alpha[0] == pytest.approx((1 + 1) / (4 + 1)) and rho[0] == pytest.approx(3 / 2.5)
    for bad in (dict(fallback_deficit=-1.0), dict(fallback_by_cost="yes")):
        with pytest.raises(ValueError, match="fallback_"):
            RuntimeConfig(**bad)


def test_default_decoding_falls_back_by_cost_and_stays_lossless(case, monkeypatch):
    model, prompts, ref = case
    heads = mt.init_heads(model, 4, seed=2)                               # random heads: drafts rarely right
    heads.tree = mt.get_tree("medusa-16").paths[1:]
    monkeypatch.setattr(costs, "cache_file", lambda: "/nonexistent/step_costs.json")   # measured, not cached
    res = mt.generate(model, prompts, 24, heads=heads, runtime=mt.RuntimeConfig(fallback_deficit=1e-9))
    assert res.tokens == ref and res.stats.fallback_count >= 1
    off = mt.generate(model, prompts, 24, heads=heads, runtime=mt.RuntimeConfig(fallback_by_cost=False,
                                                                              fallback_deficit=1e-9))
    assert off.tokens == ref and off.stats.fallback_count == 0
    with pytest.raises(ValueError, match="fallback_by_cost=True"):
        mt.generate(model, prompts, 4, heads=heads, runtime=mt.RuntimeConfig(fallback_by_cost=True,
                                                                            size_by_cost=False))
