"""Published tables, the analytic model, the measurement path (tables --quick, e2e, profile) and gpu_check.sh.

Everything runs on CPU at tiny sizes (torch ops); the numbers themselves are not checked except where they are
exact by construction (an oracle drafter that is always or never right, the NPU report table's own arithmetic).
The SmolLM2 suite's wiring runs on a tiny stand-in; the real model only when its package and heads are there.
"""
import csv
import os
import pathlib
import subprocess
import sys

import pytest

from cli_helpers import hang_guard
import torch

import mtp_triton as mt
from mtp_lab.bench import ab, e2e, profile_step, tables
from mtp_lab.bench.ab import SERIAL, Config, run_prompts
from mtp_triton.tree import Tree
from mtp_triton.costs import step_cost
from hf_models import make_hf

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCUMENTS = ("an MTP-on-NPU engineering report (BM1684, Llama-7B)", "an evaluation framework for MTP on local "
             "quantised models")        # the two sources without a public address (see data/published/README.md)
METRICS = {"throughput", "latency", "speedup", "speedup_pct", "energy_efficiency", "mean_accepted_tokens",
           "draft_acceptance_pct", "second_token_acceptance_pct"}


# ---- published numbers ------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", sorted((ROOT / "data" / "published").glob("*.csv")), ids=lambda p: p.stem)
def test_published_csv_parses_and_every_row_has_a_source(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert rows, f"{path.name} is empty"
    for i, r in enumerate(rows):
        assert None not in r and None not in r.values(), f"{path.name} row {i}: wrong number of fields"
        src = r["source"]
        assert "https://" in src or src.startswith(DOCUMENTS), f"{path.name} row {i}: source {src!r}"
        assert r["metric"] in METRICS, f"{path.name} row {i}: metric {r['metric']!r}"
        for col in ("system", "config", "model", "hardware", "batch", "unit"):
            assert r[col].strip(), f"{path.name} row {i}: empty {col}"
        v = float(r["value"])
        if r["value_high"]:
            assert float(r["value_high"]) > v, f"{path.name} row {i}: range high <= low"


def test_load_published_covers_the_systems():
    rows = tables.load_published()
    systems = {r["system"] for r in rows}
    for name in ("MTP on NPU (BM1684)", "MTP eval framework (consumer GPU)", "Medusa-1", "EAGLE-2", "DeepSeek-V3 MTP",
                 "SGLang", "gpt-fast", "vLLM", "Spec-Bench"):
        assert name in systems
    assert all(isinstance(r["value"], float) for r in rows)


def test_npu_report_table_is_internally_consistent():
    """The copied BM1684 table obeys its own arithmetic: ms/token = 1000 / tok/s, speedup % = tok/s ratio − 1."""
    npu = tables.npu_sweep(tables.load_published())
    assert set(npu) == {"serial", "MTP-2", "MTP-4", "MTP-8"}
    for cfg, m in npu.items():
        assert abs(1000 / m["throughput"] - m["latency"]) < 0.06, cfg
        if cfg != "serial":
            pct = 100 * (m["throughput"] / npu["serial"]["throughput"] - 1)
            assert abs(pct - m["speedup_pct"]) < 0.5, (cfg, pct)


# ---- the analytic model -----------------------------------------------------------------------------------
def test_analytic_model_hand_checked():
    # chain of 2, each depth right half the time: E[accepted] = 0.5 + 0.25, + 1 bonus = 1.75 tokens per step
    chain = Tree.chain(2)
    acc = [[0.5], [0.5]]
    assert tables.expected_tokens_per_step(chain, acc) == pytest.approx(1.75)
    assert tables.analytic_speedup(chain, acc, cost_ratio=1.25) == pytest.approx(1.4)
    # two candidates at depth 1 (ranks 0 and 1), one child under rank 0: 1 + 0.5 + 0.25 + 0.5 * 0.4 = 1.95
    tree = Tree.from_choices([(0,), (1,), (0, 0)])
    assert tables.expected_tokens_per_step(tree, [[0.5, 0.25], [0.4, 0.0]]) == pytest.approx(1.95)
    # the serial step: nothing to accept, cost 1 -> speedup 1
    assert tables.analytic_speedup(Tree.root_only(), acc, 1.0) == pytest.approx(1.0)


def test_accuracy_helpers():
    assert e2e.oracle_acc([0.8, 0.5]).flatten().tolist() == pytest.approx([0.8, 0.16, 0.5, 0.25])
    # P(accept length >= d) = 0.8, 0.4, 0.0 -> conditional 0.8, 0.5, 0.0
    acc = tables.acc_from_depth_rates([0.8, 0.4, 0.0])
    assert acc.shape == (3, 1) and acc.flatten().tolist() == pytest.approx([0.8, 0.5, 0.0])


@pytest.mark.parametrize("spec,expected", [("consumer80", [0.8] * 8), ("0.7", [0.7] * 8),
                                           ("0.9/0.5", [0.9] + [0.5] * 7)], ids=["name", "number", "per-depth"])
def test_parse_profile(spec, expected):
    assert e2e.parse_profile(spec)[1] == pytest.approx(expected)


@pytest.mark.parametrize("spec", ["consumer99", "1.5", "0.9/x"])
def test_parse_profile_rejects(spec):
    with pytest.raises(ValueError, match="profile"):
        e2e.parse_profile(spec)


@pytest.fixture(scope="module")
def tiny():
    """A tiny fp64 model (exact numerics: MTP output == serial output) with two prompts of odd lengths."""
    model = mt.LlamaEngine.from_hf(make_hf("gqa-hd16-v203-untied-L2"))
    return model, [[5, 17, 33, 42, 90, 1, 7], [11, 12, 13]]


@pytest.mark.parametrize("p,tau", [("1.0", 5.0), ("0.0", 1.0)], ids=["always-right", "never-right"])
def test_analytic_model_matches_the_oracle_exactly(tiny, p, tau):
    """At p = 1 every chain-4 step accepts 4 drafts (+ bonus); at p = 0 none: measured τ == E[tokens/step]."""
    model, prompts = tiny
    d = e2e.oracle_drafting(p)
    chain = Tree.chain(4)
    truth = e2e.serial_truth(model, prompts, 21, d.num_heads)
    configs = [Config(SERIAL, dict(mtp=False)), e2e.mtp_config("mtp", model, d, chain, truth)]
    table, tokens = e2e.measure(e2e.Target("embedded", model, prompts, "tiny"), configs, 21)   # 1 + 4 steps x 5
    assert tokens["mtp"] == tokens[SERIAL], "verification is real: the output must be the model's own"
    assert table["mtp"]["identical"] == len(prompts)
    assert table["mtp"]["tau"] == pytest.approx(tau)
    assert tables.expected_tokens_per_step(chain, d.acc) == pytest.approx(tau)


def test_ab_rows_keep_the_callers_fields(tiny):
    """A run's base fields (the demo's and prune's `tree_size`: the drafter's tree) are not overwritten by the
    measured ones; the candidate tree a configuration verified is `tree_nodes` (1 for serial)."""
    model, prompts = tiny
    heads = mt.init_heads(model, 2, seed=1)
    rows, _ = ab.run_prompt(model, prompts[0], 6, [Config(SERIAL, dict(mtp=False)),
                                                   Config("mtp", dict(heads=heads, tree="chain-2"))],
                            base=dict(tree_size=25))
    assert [r["tree_size"] for r in rows] == [25, 25] and [r["tree_nodes"] for r in rows] == [1, 3]
    assert ab.summarise(rows)["mtp"]["tree_size"] == 3


def test_verify_step_timer_runs(tiny):
    """The tables' c(T) comes from the one verify-step timer, `costs.step_cost`."""
    model, _ = tiny
    t1, t9 = step_cost(model, [Tree.root_only(), Tree.chain(8)], context=9)
    assert t1 > 0 and t9 > 0


def test_ab_batches_count_every_sequence(tiny):
    """At batch 2 a row is one group: decode tokens are new tokens - 1 per sequence, and the serial tokens equal
    batch 1's."""
    model, prompts = tiny
    target = e2e.Target("embedded", model, prompts, "tiny")
    one, tok1 = e2e.measure(target, [Config(SERIAL, dict(mtp=False))], 7)
    two, tok2 = e2e.measure(target, [Config(SERIAL, dict(mtp=False))], 7, batch=2)
    assert tok1 == tok2 and two[SERIAL]["prompts"] == 1 and one[SERIAL]["prompts"] == 2
    assert one[SERIAL]["tau"] == pytest.approx(1.0) and two[SERIAL]["tau"] == pytest.approx(1.0)


# ---- measurement plumbing ---------------------------------------------------------------------------------
def test_hf_twin_holds_the_same_weights(tiny):
    model, prompts = tiny
    hf = e2e.hf_twin(model)
    ours = run_prompts(model, prompts, 6, [Config(SERIAL, dict(mtp=False))])[1][SERIAL]
    theirs = e2e.time_hf(hf, prompts, 6)["tokens"]
    assert theirs == ours


def test_phase_profile_adds_up_and_restores_the_ops(tiny):
    model, prompts = tiny
    gen_mod = sys.modules["mtp_triton.generate"]
    before = gen_mod.get_ops
    heads = mt.init_heads(model, 2, seed=1)
    rows = profile_step.phase_rows(model, prompts, 7, [("chain-2", dict(heads=heads, tree="chain-2"))])
    assert gen_mod.get_ops is before
    assert [r["phase"] for r in rows] == list(profile_step.PHASES)
    assert sum(r["fraction"] for r in rows) == pytest.approx(1.0)
    assert all(r["ms_per_step"] >= 0 for r in rows if r["phase"] != "python-overhead")
    assert rows[0]["step_ms"] > 0


def test_kernel_table_and_categories():
    full = {"_tree_attention_kernel": (900.0, 40), "sm90_xmma_gemm_bf16": (3000.0, 200), "elementwise_add": (100.0, 90),
            "prefill_only": (50.0, 1)}
    first = {"_tree_attention_kernel": (100.0, 8), "sm90_xmma_gemm_bf16": (600.0, 40), "prefill_only": (50.0, 1)}
    rows = profile_step.kernel_table(full, first, steps=4, name="tree")
    cats = {r["category"]: r for r in rows if r["table"] == "kernel_categories"}
    assert set(cats) == {"attention", "gemm", "other (elementwise, norms, copies)"}
    assert cats["gemm"]["gpu_ms_per_step"] == pytest.approx(2400e-3 / 4)
    assert sum(r["fraction"] for r in cats.values()) == pytest.approx(1.0)
    ker = [r for r in rows if r["table"] == "kernels"]
    assert ker[0]["kernel"] == "sm90_xmma_gemm_bf16" and ker[0]["calls_per_step"] == 40
    assert profile_step.kernel_category("fused_draft_kernel") == "draft"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU message")
def test_llama7b_is_skipped_on_cpu_with_a_reason():
    with pytest.raises(RuntimeError, match="needs a GPU"):
        e2e.load_target("llama7b", quick=False)


def test_tables_quick_writes_csv_markdown_png(tmp_path):
    assert tables.main(["--quick", "--out", str(tmp_path)]) == 0
    for ext in ("csv", "md", "png"):
        assert (tmp_path / f"tables.{ext}").stat().st_size > 0
    rows = list(csv.DictReader(open(tmp_path / "tables.csv")))
    kinds = {r["table"] for r in rows}
    assert {"sweep", "analytic", "phases", "hf"} <= kinds
    hf = [r for r in rows if r["table"] == "hf"]                     # the peer, plain and zero-training speculation
    assert {r["provider"] for r in hf} == {"hf-generate", "hf-prompt-lookup"}
    assert all(float(r["tokens_per_s"]) > 0 and "token-identical" in r["note"] for r in hf)
    assert "hf-prompt-lookup" in (tmp_path / "tables.md").read_text()
    assert all(r["device"] and r["torch"] and r["commit"] and r["timestamp"] for r in rows), "rows need env_info()"
    sweep = [r for r in rows if r["table"] == "sweep"]
    assert {r["suite"] for r in sweep} == {"embedded", "llama7b"}
    for r in sweep:                                    # every measured speed row carries its roofline
        if r["tokens_per_s"]:
            assert int(r["weight_bytes_per_step"]) > 0 and float(r["copy_gb_s"]) > 0 and 0 < float(r["floor_fraction"])
    for r in sweep:                                    # measured, or skipped with the reason
        assert r["tokens_per_s"] or r["note"].startswith("skipped"), r
    assert {r["config"] for r in sweep} >= {"serial", "MTP-2", "MTP-4", "MTP-8", "tree"}
    oracle = [r for r in sweep if r["suite"] == "llama7b"]
    assert all("SYNTHETIC" in r["drafter"] for r in oracle)
    md = (tmp_path / "tables.md").read_text()
    npu = tables.npu_sweep(tables.load_published())
    assert f"{npu['MTP-4']['throughput']:.1f}" in md and "CPU numbers" in md
    assert "## 3. Analytic model vs measured" in md and "## 5. Hugging Face" in md


def test_smollm2_suite_sweeps_chains_and_the_stored_tree(tiny, tmp_path, monkeypatch):
    """The SmolLM2 suite's path on a stand-in (fp64 tiny model, 4 heads with a stored tree): serial, MTP-2/4 and the
    stored tree measured and identical to serial, MTP-8 skipped with a printed note, no HF / phase rows, and the
    markdown beside the NPU report's numbers."""
    model, prompts = tiny
    heads = mt.init_heads(model, 4, seed=1)
    heads.tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    stand_in = e2e.Target("smollm2", model, prompts, "SmolLM2 stand-in (tiny fp64)", heads=heads)
    monkeypatch.setattr(e2e, "_smollm2_target", lambda device, n, heads_dir=None: stand_in)
    logged = []
    rows, paths = tables.run_tables(str(tmp_path), ("smollm2",), max_new_tokens=9, log=logged.append)
    sweep = {r["config"]: r for r in rows if r["table"] == "sweep"}
    assert list(sweep) == ["serial", "MTP-2", "MTP-4", "MTP-8", "tree"]
    for name in ("serial", "MTP-2", "MTP-4", "tree"):
        assert sweep[name]["identical_to_serial"] is True and sweep[name]["tokens_per_s"] > 0, name
        assert sweep[name]["ms_per_token"] == pytest.approx(1e3 / sweep[name]["tokens_per_s"])
    assert sweep["MTP-4"]["tree_size"] == 5 and sweep["tree"]["tree_size"] == 5
    assert sweep["tree"]["note"] == "the heads' stored tree"
    assert "tokens_per_s" not in sweep["MTP-8"] and sweep["MTP-8"]["note"].startswith("skipped: needs 8 heads")
    assert any("MTP-8" in line and "skipped" in line for line in logged)
    assert {r["table"] for r in rows} == {"sweep", "analytic"}
    md = open(paths["md"]).read()
    npu = tables.npu_sweep(tables.load_published())
    assert "**Ours — smollm2" in md and f"{npu['MTP-8']['throughput']:.1f}" in md and "CPU numbers" in md


def test_smollm2_suite_is_skipped_with_the_reason(tmp_path):
    with pytest.raises(RuntimeError, match="smollm2: "):          # no package, or no heads at that folder
        e2e.load_target("smollm2", heads_dir=str(tmp_path / "no-heads"))


def test_smollm2_switch(monkeypatch, tmp_path):
    """--smollm2 adds the suite, --no-smollm2 drops it; by default it follows the package, except with --quick."""
    seen = []
    monkeypatch.setattr(tables, "run_tables", lambda out, shapes, **kw: (seen.append(list(shapes)),
                                                                    ([], dict(csv="c", md="m", png="p")))[1])
    monkeypatch.setattr(e2e, "smollm2_installed", lambda: True)
    for argv, want in ((["--shape", "embedded"], ["embedded", "smollm2"]),
                       (["--shape", "embedded", "--quick"], ["embedded"]),
                       (["--shape", "embedded", "--quick", "--smollm2"], ["embedded", "smollm2"]),
                       (["--shape", "embedded", "--no-smollm2"], ["embedded"]),
                       (["--shape", "--smollm2"], ["smollm2"])):
        seen.clear()
        assert tables.main([*argv, "--out", str(tmp_path)]) == 0
        assert seen == [want], argv
    monkeypatch.setattr(e2e, "smollm2_installed", lambda: False)
    seen.clear()
    assert tables.main(["--shape", "embedded", "--out", str(tmp_path)]) == 0 and seen == [["embedded"]]
    assert tables.main(["--shape", "--no-smollm2", "--out", str(tmp_path)]) == 2        # nothing to measure


def test_tables_ctrl_c_keeps_the_finished_suites_and_resume_runs_the_rest(tiny, tmp_path, monkeypatch, capsys):
    """Ctrl-C in the 2nd suite: the 1st suite's rows are in tables.csv, exit 130 with one line saying how to go on;
    --resume measures only the 2nd suite, and tables.md shows both."""
    model, prompts = tiny
    heads = mt.init_heads(model, 4, seed=1)
    monkeypatch.setattr(e2e, "load_target", lambda shape, *a, **kw: e2e.Target(shape, model, prompts, f"{shape} "
                                                                               "stand-in", heads=heads))
    measured = []

    def fake_suite(target, draftings, n, **kw):
        measured.append(target.suite)
        if target.suite == "llama7b" and len(measured) == 2:
            raise KeyboardInterrupt
        return [dict(e2e.env_info(), run_id=kw["run_id"], **target.row(), table="sweep", drafter="d",
                     config="serial", tokens_per_s=10.0, speedup=1.0)]
    monkeypatch.setattr(tables, "suite_rows", fake_suite)
    args = ["--quick", "--shape", "embedded", "llama7b", "--out", str(tmp_path)]
    capsys.readouterr()
    try:
        assert tables.main(args) == 130
    except KeyboardInterrupt:
        pytest.fail("tables let the KeyboardInterrupt through")
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--resume" in err, err
    assert [r["suite"] for r in csv.DictReader(open(tmp_path / "tables.csv"))] == ["embedded"]
    assert tables.main(args + ["--resume"]) == 0 and measured == ["embedded", "llama7b", "llama7b"]
    assert [r["suite"] for r in csv.DictReader(open(tmp_path / "tables.csv"))] == ["embedded", "llama7b"]
    md = (tmp_path / "tables.md").read_text()
    assert "embedded stand-in" in md and "llama7b stand-in" in md
    assert tables.main(args + ["--resume"]) == 0 and len(measured) == 3      # all kept: nothing measured


@pytest.mark.slow
@pytest.mark.skipif(not e2e.smollm2_installed() or not os.path.exists(ROOT / "data" / "smollm2-135m-instruct-heads"),
                    reason="needs the SmolLM2 package and its trained heads")
def test_smollm2_sweep_on_the_real_model(tmp_path):
    """SmolLM2-135M-Instruct in bf16 on a CPU, 1 chat prompt, 8 tokens: every measured config equals serial."""
    assert tables.main(["--shape", "--smollm2", "--num-prompts", "1", "--max-new-tokens", "8", "--out",
                        str(tmp_path)]) == 0
    sweep = [r for r in csv.DictReader(open(tmp_path / "tables.csv")) if r["table"] == "sweep"]
    assert {r["suite"] for r in sweep} == {"smollm2"} and sweep[0]["dtype"] == "bfloat16"
    assert all(r["identical_to_serial"] == "True" for r in sweep if r["tokens_per_s"])


def test_markdown_renders_gpu_style_rows():
    """Rows as a GPU run writes them (kernel tables, energy, a failed profiler) render without a CPU label."""
    base = dict(device="NVIDIA H200", torch="2.11", triton="3.6.0", interpreter="False", commit="x", timestamp="t",
                suite="llama7b", model="Llama-7B shape", dtype="bfloat16", layers="32", model_params_M="6738",
                prompt_len="128", max_new_tokens="128", num_prompts="2", batch="1",
                drafter="oracle consumer80 (SYNTHETIC)")
    rows = [dict(base, table="sweep", config="serial", tree_size="1", tokens_per_s="80", ms_per_token="12.5",
                 speedup="1", speedup_pct="0", tau="1", tokens_per_j="0.3", identical_to_serial="True"),
            dict(base, table="kernel_categories", config="tree-17", category="gemm", gpu_ms_per_step="3",
                 fraction="0.8"),
            dict(base, table="kernels", config="tree-17", kernel="(torch.profiler failed)", note="RuntimeError()")]
    md = tables.markdown(rows, tables.load_published())
    assert "NVIDIA H200" in md and "CPU numbers" not in md and "torch.profiler failed" in md


def test_gpu_check_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHON=sys.executable, OMP_NUM_THREADS="1")
    p = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=hang_guard(300))
    log = (tmp_path / "gpu_check.log").read_text()
    assert p.returncode == 0, log[-3000:]
    assert "SUMMARY: all stages passed" in log and "DRY RUN" in log
    files = [f for f in tmp_path.rglob("*") if f.is_file()]
    assert len(files) <= 8, files
    assert (tmp_path / "tables" / "tables.md").exists() and (tmp_path / "e2e.csv").exists()


@pytest.mark.gpu
def test_gpu_profiling_paths():
    """On a GPU: CUDA-event phase timers, the torch.profiler kernel table, c(T) and the HF twin, in bf16/Triton."""
    hf = make_hf("gqa-hd16-v203-untied-L2", dtype=torch.bfloat16).cuda()
    model = mt.LlamaEngine.from_hf(hf)
    prompts = [[5, 17, 33, 42, 90, 1, 7]]
    kw = dict(heads=mt.init_heads(model, 2, seed=1), tree="chain-2", kernels="triton")
    rows = profile_step.phase_rows(model, prompts, 9, [("chain-2", kw)])
    assert sum(r["fraction"] for r in rows) == pytest.approx(1.0)
    assert {r["phase"]: r for r in rows}["verify-attention"]["ms_per_step"] > 0
    ker = profile_step.kernel_rows(model, prompts, 9, "chain-2", kw)
    cats = {r["category"] for r in ker if r["table"] == "kernel_categories"}
    assert {"attention", "draft"} <= cats, cats
    assert min(step_cost(model, [Tree.chain(2)], context=33, kernels="triton")) > 0
    energy = e2e.gpu_energy_j("cuda")
    assert energy is None or energy > 0
    r = e2e.time_hf(e2e.hf_twin(model), prompts, 6)
    assert r["new_tokens"] == 6 and r["decode_tokens_per_s"] > 0
