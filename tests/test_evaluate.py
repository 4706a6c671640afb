"""The evaluation harness: the command end to end, the quality gate (and that it catches a broken acceptance),
the T > 0 summaries, edge inputs, the aggregation, and the scenario files."""
import csv
import json
import math
import os
import re
import shutil
import sys

import pytest
import torch

import mtp_triton as mt
import mtp_triton.reference as reference
from mtp_triton.__main__ import main as cli
from mtp_triton.bench import evaluate as ev
from mtp_triton.generate import prefill
from mtp_triton.ops import get_ops

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tiny-stdlib-llama")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with the embedded tokenizer (vocab 4096), 4 random heads, context 256."""
    from transformers import LlamaConfig, LlamaForCausalLM
    d = str(tmp_path_factory.mktemp("tiny-llama"))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=136, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=0, bos_token_id=0, pad_token_id=0)
    LlamaForCausalLM(cfg).eval().save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(TOKENIZER, f), d)
    mt.init_heads(mt.load_model(d), 4).save(os.path.join(d, "heads"))
    return d


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    from transformers import AutoTokenizer
    model = mt.load_model(tiny_dir)
    return model, mt.load_heads(os.path.join(tiny_dir, "heads")), AutoTokenizer.from_pretrained(tiny_dir)


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


# ---- the command, end to end ----
def test_eval_command_quick_end_to_end(tiny_dir, tmp_path, capsys):
    out = str(tmp_path / "eval")
    rc = cli(["eval", "--model", tiny_dir, "--quick", "--sweep", "--long-run", "40", "--out", out, "--no-progress"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert "all gates passed" in captured.out
    rows = read_csv(os.path.join(out, "eval.csv"))
    sections = {r["section"] for r in rows}
    assert sections == {"ab", "sweep", "long_run", "long_summary", "edge", "compat"}
    for r in rows:                                                      # every row carries env_info()
        assert r["device"] and r["torch"] and r["commit"] and r["timestamp"] and r["command"].startswith("python -m")
    ab = [r for r in rows if r["section"] == "ab"]
    assert {r["scenario"] for r in ab} == set(ev.SCENARIOS)
    assert len(ab) == 2 * 2 * len(ev.SCENARIOS)                          # 2 items per set (--quick), off and on
    assert all(r["identical"] == "True" for r in ab)
    assert {r["mode"] for r in ab} == {"off", "on"}
    assert all(float(r["tokens_per_step"]) == 1.0 and r["tree_size"] == "1" for r in ab if r["mode"] == "off")
    assert all(int(r["new_tokens"]) <= 16 for r in ab)
    summary = [r for r in rows if r["section"] == "long_summary"][0]
    assert int(summary["tokens"]) >= 40 and summary["errors"] == "0" and summary["memory_growth_flag"] == "False"
    report = open(os.path.join(out, "report.md")).read()
    for text in ("quality gate: **PASS**", "edge inputs: **PASS**", "long-run stability: **PASS**", "CPU numbers",
                 "## 3. Performance", "## 5. Parameter sensitivity", "| width-2 |", "| chain-2 |", "acc d1"):
        assert text in report, text
    k, off, on, speedup = ev.ab_table(rows)[-1]                          # the tables recomputed from the CSV rows
    assert k == "all" and f"| all | 10 | {off['decode_tokens_per_s']:.2f} | {on['decode_tokens_per_s']:.2f} | " \
                          f"{speedup:.2f} |" in report
    assert ev.plot_all(rows, str(tmp_path)) == ["latency_cdf.png", "speedup.png", "acceptance.png", "sensitivity.png",
                                                "long_run.png"]
    for png in ("latency_cdf.png", "speedup.png", "acceptance.png", "sensitivity.png", "long_run.png"):
        with open(os.path.join(out, png), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n", png
        assert f"]({png})" in report


def test_missing_model_is_a_clear_error(tmp_path, capsys):
    assert ev.main(["--model", str(tmp_path / "nowhere"), "--out", str(tmp_path)]) == 2
    assert "no model" in capsys.readouterr().err


@pytest.mark.parametrize("args,match", [
    (["--scenarios", "poetry"], "unknown scenario set 'poetry'"),
    (["--tree", "bushy-9"], "unknown tree preset"),
    (["--tree", "chain-5"], "exceeds the 4 heads"),
], ids=["scenario", "tree", "too-deep"])
def test_bad_arguments_are_clear_errors(tiny_dir, tmp_path, capsys, args, match):
    assert ev.main(["--model", tiny_dir, "--out", str(tmp_path), *args]) == 2
    assert match in capsys.readouterr().err


# ---- the quality gate ----
def _accept_one_wrong_token(orig):
    """A broken tree_accept: after the real path, also accept the first child of the deepest accepted node
    (a draft the target rejected) and take the bonus after it."""
    def broken(draft_tokens, parents, target_tokens, **kw):
        n, nodes, nxt = (t.clone() for t in orig(draft_tokens, parents, target_tokens, **kw))
        par = parents if parents.dim() == 2 else parents[None].expand_as(draft_tokens)
        for b in range(draft_tokens.shape[0]):
            kids = [i for i in range(1, par.shape[1]) if int(par[b, i]) == int(nodes[b, n[b]])]
            if kids:
                n[b] += 1
                nodes[b, n[b]] = kids[0]
                nxt[b] = target_tokens[b, kids[0]]
        return n, nodes, nxt
    return broken


def test_quality_gate_fails_on_broken_acceptance(tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(reference, "tree_accept", _accept_one_wrong_token(reference.tree_accept))
    out = str(tmp_path / "broken")
    rc = ev.main(["--model", tiny_dir, "--quick", "--scenarios", "code_completion", "--no-edge", "--out", out,
                  "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1
    assert "FAILED" in err and "MTP output differs from serial at new token" in err
    assert "context :" in err and "serial  :" in err and "MTP     :" in err
    rows = [r for r in read_csv(os.path.join(out, "eval.csv")) if r["section"] == "ab" and r["mode"] == "on"]
    assert rows and all(r["identical"] == "False" and r["first_diff"] != "" for r in rows)
    assert "quality gate: **FAIL**" in open(os.path.join(out, "report.md")).read()


def test_quality_gate_passes_with_the_real_acceptance(loaded):
    model, heads, tok = loaded
    cfg = ev.EvalConfig.quick(scenarios=("repl_dialogue",), edge=False, compat=False, progress=False)
    res = ev.evaluate(model, heads, tok, cfg)
    assert not res.failures
    assert all(r["identical"] for r in res.rows if r["section"] == "ab")


@pytest.mark.parametrize("a,b,expect", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 9, 3], 1), ([1, 2], [1, 2, 3], 2), ([5], [6], 0),
], ids=["same", "middle", "prefix", "first"])
def test_first_difference(a, b, expect):
    assert ev.first_difference(a, b) == expect


def test_describe_mismatch_decodes_context(loaded):
    _, _, tok = loaded
    prompt = tok("def add(a, b):\n    return")["input_ids"]
    s, m = tok(" a + b\n")["input_ids"], tok(" a - b\n")["input_ids"]
    text = ev.describe_mismatch(tok, "x", s, m, prompt)
    i = ev.first_difference(s, m)
    assert f"at new token {i}" in text and "return" in text


# ---- temperature > 0: distribution summaries ----
def test_sampled_quality_summaries(loaded):
    model, heads, tok = loaded
    cfg = ev.EvalConfig.quick(scenarios=("code_completion",), max_prompts=ev.MIN_ITEMS, temperature=1.0, top_p=0.9,
                              max_new_cap=12, edge=False, compat=False, progress=False)
    res = ev.evaluate(model, heads, tok, cfg)
    q = [r for r in res.rows if r["section"] == "quality"]
    assert [r["metric"] for r in q] == ["mean_logprob", "distinct_ratio", "new_tokens"]
    assert all(r["n"] == ev.MIN_ITEMS and r["tolerance"] is not None and r["ok"] for r in q)
    on = [r for r in res.rows if r["section"] == "ab" and r["mode"] == "on"]
    assert all(r["mean_logprob"] < 0 and 0 < r["distinct_ratio"] <= 1 for r in on)


def test_sampled_quality_flags_a_shift():
    shift = [-1.0, -0.95, -1.05, -1.0, -0.9, -1.1, -1.0, -0.98]                # 8 items, on ~1 nat worse
    rows = []
    for i, d in enumerate(shift):
        for mode, lp in (("off", -2.0 - 0.1 * i), ("on", -2.0 - 0.1 * i + d)):
            rows.append(dict(section="ab", scenario="s", item=f"i{i}", mode=mode, mean_logprob=lp,
                             distinct_ratio=0.5, new_tokens=10))
    q = {r["metric"]: r for r in ev.sampled_quality(rows, "s")}
    assert q["mean_logprob"]["ok"] is False and q["mean_logprob"]["diff"] == pytest.approx(sum(shift) / 8)
    assert q["distinct_ratio"]["ok"] and q["new_tokens"]["ok"]                 # no spread: the floor decides
    few = ev.sampled_quality([r for r in rows if r["item"] in ("i0", "i1", "i2")], "s")
    assert all(r["n"] == 3 and r["ok"] is None for r in few)                    # too few items: no verdict


@pytest.mark.parametrize("df", [1, 2, 7, 400], ids=lambda d: f"df{d}")
def test_t_critical(df):
    from statistics import NormalDist
    x = ev.t_critical(1e-3, df)
    if df == 1:                                                                 # Cauchy: closed form
        assert x == pytest.approx(math.tan(math.pi / 2 * (1 - 1e-3)), rel=1e-4)
    elif df == 400:                                                             # close to the normal
        assert x == pytest.approx(NormalDist().inv_cdf(1 - 5e-4), rel=0.01)
    else:                                                                       # P(|T| > x) by sampling
        g = torch.Generator().manual_seed(df)
        z = torch.randn(400000, df + 1, generator=g, dtype=torch.float64)
        t = z[:, 0] / torch.sqrt((z[:, 1:] ** 2).sum(1) / df)                  # t = N(0,1) / sqrt(chi2_df / df)
        x2 = ev.t_critical(0.05, df)
        assert (t.abs() > x2).double().mean().item() == pytest.approx(0.05, abs=0.002)
        assert x > x2


def test_mean_logprob_matches_prefill(loaded):
    """One causal forward over prompt + output == the prefill of every prefix, one at a time."""
    model, _, _ = loaded
    prompt, out = [5, 17, 33, 42], [90, 1, 7]
    lp, ctx = [], list(prompt)
    for t in out:
        hidden = prefill(model, [ctx], model.new_cache([len(ctx)]), get_ops("torch"))     # [1, D] at the last token
        lp.append(torch.log_softmax(model.logits(hidden).double(), -1)[0, t].item())
        ctx.append(t)
    assert ev.mean_logprob(model, prompt, out) == pytest.approx(sum(lp) / len(lp), abs=1e-5)


# ---- bad and edge inputs ----
def test_edge_inputs(loaded):
    model, heads, tok = loaded
    h = ev.Harness(model, heads, tok, ev.EvalConfig.quick(progress=False))
    h.edge(ev.load_scenarios(("short_completion",), 1))
    rows = {r["case"].split(" (")[0]: r for r in h.rows}
    assert not h.failures, h.failures
    assert all(r["ok"] for r in rows.values())
    for case in ("empty input", "over-long context", "max_new_tokens = 0", "token id out of range"):
        assert rows[case]["outcome"] == "ValueError" and rows[case]["detail"], case
    assert rows["max_new_tokens = 1"]["outcome"].startswith("1 tokens, MTP == serial")
    assert rows["EOS as the first token"]["outcome"].startswith("1 tokens")
    assert "same as before and as serial" in rows["normal request after the bad inputs"]["outcome"]


def test_edge_section_flags_a_swallowed_error(loaded, monkeypatch):
    """If the engine silently accepted an empty prompt, the edge section must report it."""
    from mtp_triton.bench import eval_harness                           # the harness's sections call its generate
    model, heads, tok = loaded
    real = eval_harness.generate

    def lenient(model, prompts, max_new_tokens, **kw):
        if prompts == [[]]:
            prompts = [[1]]
        return real(model, prompts, max_new_tokens, **kw)
    monkeypatch.setattr(eval_harness, "generate", lenient)
    h = ev.Harness(model, heads, tok, ev.EvalConfig.quick(progress=False))
    h.edge(ev.load_scenarios(("short_completion",), 1))
    assert any("empty input: expected error" in f for f in h.failures)


# ---- aggregation and stability summaries ----
def _row(new, ttft, e2e, hist, rates, steps):
    return dict(section="ab", new_tokens=new, ttft_s=ttft, e2e_s=e2e, steps=steps, itl_p50_s=0.01, itl_p95_s=0.02,
                itl_p99_s=0.03, accept_len_histogram=json.dumps(hist), accept_rate_per_depth=json.dumps(rates),
                rejected_steps=0, wasted_drafts=0, drafted_tokens=0, fallback_count=0, time_draft_s=0.1,
                time_verify_s=0.2, time_accept_s=0.0, time_append_s=0.0, peak_memory_bytes=100, cache_bytes=10,
                energy_j=None)


def test_aggregate_sums_time_and_weights_acceptance_by_steps():
    a = ev.aggregate([_row(11, 0.5, 1.5, [1, 1], [0.5], 2), _row(31, 0.5, 2.5, [0, 0, 4], [1.0, 1.0], 4)])
    assert a["decode_tokens_per_s"] == pytest.approx(40 / 3.0)
    assert a["accept_per_depth"] == pytest.approx([(0.5 * 2 + 1.0 * 4) / 6, 1.0])
    assert a["tokens_per_step"] == pytest.approx(40 / 6)
    assert a["e2e_p99_ms"] == pytest.approx(2500.0)


def test_long_run_summary_drift_and_memory_flag():
    rows = [dict(new_tokens=10, request_s=t, memory_bytes=m, error="", timeout=False, spot_check="")
            for t, m in [(1.0, 100), (1.0, 100), (2.0, 100 + (200 << 20)), (2.0, 100 + (200 << 20))]]
    s = ev.long_run_summary(rows, "cpu")
    assert s["drift"] == pytest.approx(-0.5) and s["memory_growth_flag"] and s["errors"] == 0


# ---- trees and scenarios ----
@pytest.mark.parametrize("name,size,depth,top_k", [
    ("chain-1", 2, 1, 1), ("chain-3", 4, 3, 1), ("width-3", 13, 4, 3), ("medusa-16", 17, 3, None), ("tuned", 17, 3, None),
], ids=lambda x: str(x))
def test_tree_by_name(name, size, depth, top_k):
    t = ev.tree_by_name(name, 4)
    assert (t.size, t.max_depth) == (size, depth)
    if top_k:
        assert t.top_k == top_k


def test_sweep_tree_names_follow_the_heads():
    assert ev.sweep_tree_names(2)[:2] == ["chain-1", "chain-2"] and "chain-3" not in ev.sweep_tree_names(2)
    assert not any(n.startswith("medusa") for n in ev.sweep_tree_names(2))      # medusa presets are 3 deep
    assert "chain-8" in ev.sweep_tree_names(9) and "chain-9" not in ev.sweep_tree_names(9)
    for name in ("chain-3", "chain-6"):                                          # a preset and a built chain
        with pytest.raises(ValueError, match="exceeds the 2 heads"):
            ev.tree_by_name(name, 2)


@pytest.mark.parametrize("name", ev.SCENARIOS)
def test_scenario_files(name):
    items = ev.load_scenarios((name,))[name]
    assert 6 <= len(items) <= 12
    assert {it["length"] for it in items} == {"short", "medium", "long"}
    assert len({it["id"] for it in items}) == len(items)
    for it in items:
        assert isinstance(it["max_new_tokens"], int) and it["max_new_tokens"] >= 1 and it["text"].strip()
        m = re.match(r"^(\S+) (\S+): (\S+):(\d+)-(\d+)$", it["source"])
        assert m, it["source"]
        top = m.group(3).split("/")[0].split("-")[0]
        assert top not in sys.stdlib_module_names, it["source"]          # held out from the stdlib corpus
        assert it["stdlib_line_overlap"] <= 0.3
    if name == "long_form":
        assert min(it["max_new_tokens"] for it in items) >= 512
    short = max(it["max_new_tokens"] for it in items if it["length"] == "short")
    assert short < min(it["max_new_tokens"] for it in items if it["length"] == "long")


# ---- GPU: the same harness with the Triton kernels, exact memory accounting ----
@pytest.mark.gpu
def test_eval_quick_on_gpu_with_triton_kernels(tiny_dir):
    from transformers import AutoTokenizer
    model = mt.load_model(tiny_dir, device="cuda")
    heads = mt.load_heads(os.path.join(tiny_dir, "heads"), device="cuda", dtype=model.dtype)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    cfg = ev.EvalConfig.quick(kernels="triton", sweep=True, long_run=40, progress=False)
    res = ev.evaluate(model, heads, tok, cfg)
    assert not res.failures, res.failures
    ab = [r for r in res.rows if r["section"] == "ab"]
    assert all(r["kernels"] == "triton" and r["peak_memory_bytes"] > 0 for r in ab)
    summary = [r for r in res.rows if r["section"] == "long_summary"][0]
    assert summary["memory_growth_bytes"] <= ev.MEM_GROWTH_LIMIT["cuda"]
