"""The evaluation harness: MTP on vs off, everything else identical, over five scenario sets (seed 004's framework).

    python -m mtp_triton eval --out out/eval                       # embedded model, tuned tree, all scenarios
    python -m mtp_triton eval --quick --out out/eval-quick         # tiny sizes (CI)
    python -m mtp_triton eval --sweep --long-run 10000 --out out/eval-full
    python -m mtp_triton.bench.evaluate ...                         # the same

Each item runs serial (MTP off) and MTP (on) back to back, same prompt, max_new_tokens, EOS, temperature, seed and
kernels; the order alternates from item to item so that drift on a busy machine hits both modes.

What it measures (the seed's dimensions -> what is recorded; every number comes from `generate`'s stats):
    quality gate   T = 0: MTP output must equal serial output token for token (any mismatch: first differing
                   position + decoded context, exit status 1). T > 0: paired comparison of distribution summaries
                   (mean log-prob under the model, distinct-token ratio, length) within a stated tolerance.
    performance    decode tokens/s, TTFT, end-to-end latency (mean, P95, P99 over requests), inter-token P50/P95/P99,
                   tokens per step (tau), acceptance per depth, rejected steps, wasted drafts, fallbacks, time per
                   phase (draft / verify / accept / append), verification overhead (verify time per step, on / off)
    resources      peak memory (GPU: max_memory_allocated per request; CPU: process RSS high-water, monotone),
                   KV-cache bytes, heads bytes, energy (GPU with NVML, else None)
    sensitivity    --sweep: tree depth (chain-1..chain-H), tree size (medusa-8..64, tuned), candidate width (width-k)
    stability      --long-run N: N tokens in many requests; throughput drift (first vs last quarter), memory growth,
                   errors, timeouts (requests slower than --timeout, measured after the fact: a hung request is not
                   interrupted), spot checks against serial (every 10th request at T = 0)
    edge inputs    empty, over-long, at the context limit, repeated token, unusual characters, max_new_tokens 1 / 0,
                   EOS first, out-of-range id — then a normal request must still match serial
    compatibility  a batch of different-length prompts must give the single-request outputs
Outputs in --out: eval.csv (raw rows, each stamped with env_info()), report.md (tables), *.png (plots) — the report
and the plots are computed from the rows. On CPU the numbers are CPU numbers and are labelled so.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..generate import RuntimeConfig, generate
from ..ops import get_ops
from ..tree import PRESETS, Tree, get_tree
from .common import append_rows, env_info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCENARIO_DIR = os.path.join(ROOT, "data", "scenarios")
EMBEDDED = os.path.join(ROOT, "data", "tiny-stdlib-llama")
SCENARIOS = ("short_completion", "repl_dialogue", "code_completion", "structured_output", "long_form")
ALPHA = 1e-4                              # T > 0 gate: two-sided false-alarm rate of one check (Student t)
MIN_ITEMS = 5                             # ... and the fewest paired items it will judge (fewer: reported, no verdict)
FLOOR = {"mean_logprob": 0.02, "distinct_ratio": 0.01, "new_tokens": 0.5}
MEM_GROWTH_LIMIT = {"cpu": 64 << 20, "cuda": 1 << 20}     # bytes: CPU RSS is noisy, GPU allocations are exact


@dataclass
class EvalConfig:
    """Everything a run varies; `EvalConfig.quick()` is the CI size."""
    tree: str = "tuned"                   # 'tuned' | preset | 'chain-N' | 'width-K'
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    kernels: str = "auto"
    scenarios: tuple = SCENARIOS
    max_prompts: int = None               # per scenario set (items come short, medium, long in turn)
    max_new_cap: int = None               # cap on each item's max_new_tokens
    prompt_cap: int = None                # keep only the last N prompt tokens
    fallback: float = None                # RuntimeConfig.fallback_threshold (None: off)
    sweep: bool = False
    sweep_trees: tuple = None             # default: see sweep_tree_names()
    sweep_prompts: int = 5
    sweep_tokens: int = 128
    long_run: int = 0                     # tokens
    long_request_tokens: int = 128
    timeout_s: float = 300.0
    edge: bool = True
    edge_limit_tokens: int = 16           # new tokens of the "context at the limit" edge case
    compat: bool = True
    progress: bool = True
    scenario_dir: str = SCENARIO_DIR

    @classmethod
    def quick(cls, **kw):
        base = dict(max_prompts=2, max_new_cap=16, prompt_cap=96, sweep_prompts=1, sweep_tokens=12,
                    sweep_trees=("chain-1", "chain-2", "medusa-8", "width-2", "tuned"), long_request_tokens=16,
                    edge_limit_tokens=4)
        base.update(kw)
        return cls(**base)


@dataclass
class EvalResult:
    rows: list
    failures: list = field(default_factory=list)
    info: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- inputs
def load_scenarios(names=SCENARIOS, max_prompts=None, folder=SCENARIO_DIR):
    """{name: [item, ...]} from folder/<name>.jsonl; items have id, length, max_new_tokens, source, text."""
    out = {}
    for name in names:
        path = os.path.join(folder, f"{name}.jsonl")
        if not os.path.exists(path):
            known = sorted(f[:-6] for f in os.listdir(folder) if f.endswith(".jsonl"))
            raise ValueError(f"unknown scenario set {name!r} (no {path}); known: {known}")
        with open(path, encoding="utf-8") as f:
            items = [json.loads(line) for line in f if line.strip()]
        out[name] = items[:max_prompts] if max_prompts else items
    return out


def tree_by_name(name, num_heads, heads_dir=None):
    """'tuned' (heads/accuracy.json, else the default preset), a preset, 'chain-N' or 'width-K'.

    width-K is the candidate-count sweep: K candidates (top-K ranks) of every head, hanging off the top-1 chain,
    so the tree has H * K nodes besides the root and needs top-K drafts from each head.
    """
    if name in (None, "tuned"):
        from ..demo import default_tree
        return default_tree(heads_dir or "", num_heads)
    if name.startswith("chain-") and name not in PRESETS:
        return get_tree(Tree.chain(int(name.split("-")[1])), num_heads)
    if name.startswith("width-"):
        k = int(name.split("-")[1])
        return Tree.from_choices([(0,) * d + (r,) for d in range(num_heads) for r in range(k)])
    return get_tree(name, num_heads)


def sweep_tree_names(num_heads):
    names = [f"chain-{n}" for n in range(1, min(8, num_heads) + 1)]
    names += [f"medusa-{n}" for n in (8, 16, 32, 64) if Tree.from_choices(PRESETS[f"medusa-{n}"]).max_depth <= num_heads]
    return names + ["tuned"] + [f"width-{k}" for k in (2, 4, 8)]


def encode(tok, text, max_new, ctx, prompt_cap=None):
    """Prompt ids cut from the left so that prompt + max_new fits the context: (ids, max_new, truncated)."""
    ids = tok(text)["input_ids"]
    max_new = max(1, min(max_new, ctx - 32))
    keep = ctx - max_new if prompt_cap is None else min(prompt_cap, ctx - max_new)
    return ids[-keep:], max_new, len(ids) > keep


# ----------------------------------------------------------------------------------------------- metrics
def request_metrics(stats, tree_size):
    """The per-request numbers a row carries, from generate()'s stats (histogram-derived counts included)."""
    stats = stats.as_dict()
    hist = stats["accept_len_histogram"]
    steps_seq = sum(hist)
    depth = len(stats["accept_rate_per_depth"])
    accepted = sum(i * n for i, n in enumerate(hist))
    drafted = steps_seq * (tree_size - 1)
    return dict(
        new_tokens=stats["new_tokens"], steps=stats["steps"], tokens_per_step=stats["tokens_per_step"],
        decode_tokens_per_s=stats["decode_tokens_per_s"], tokens_per_s=stats["tokens_per_s"],
        ttft_s=stats["ttft_s"], e2e_s=stats["total_s"], itl_p50_s=stats["itl_p50_s"], itl_p95_s=stats["itl_p95_s"],
        itl_p99_s=stats["itl_p99_s"], accept_rate_per_depth=json.dumps([round(r, 4) for r in stats["accept_rate_per_depth"]]),
        accept_len_histogram=json.dumps(hist), rejected_steps=sum(hist[:depth]) if depth else 0,
        drafted_tokens=drafted, accepted_drafts=accepted, wasted_drafts=drafted - accepted,
        fallback_count=stats["fallback_count"], time_draft_s=stats["time_draft_s"],
        time_verify_s=stats["time_verify_s"], time_accept_s=stats["time_accept_s"],
        time_append_s=stats["time_append_s"], peak_memory_bytes=stats["peak_memory_bytes"],
        cache_bytes=stats["cache_bytes"], energy_j=stats["energy_j"], kernels=stats["kernels"])


@torch.no_grad()
def mean_logprob(model, prompt, out):
    """Mean log p(out[j] | prompt, out[:j]) under the model (temperature 1, no top-p): one causal forward."""
    ids = list(prompt) + list(out)
    S, dev = len(ids), model.device
    cache = model.new_cache([S])
    tokens = torch.tensor([ids], device=dev)
    mask = torch.tril(torch.ones(S, S, dtype=torch.bool, device=dev))
    pos = torch.arange(S, device=dev)[None]
    hidden, _, _ = model.forward_tree(tokens, pos, mask, cache, torch.tensor([0], device=dev), get_ops("torch", dev))
    logp = torch.log_softmax(model.logits(hidden[0, len(prompt) - 1: S - 1]).double(), dim=-1)
    return float(logp.gather(1, tokens[0, len(prompt):, None]).mean())


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_mismatch(tok, where, serial, mtp, prompt=()):
    """A loud, readable account of where two greedy outputs part (context = prompt tail + the common prefix)."""
    i = first_difference(serial, mtp)
    dec = (lambda ids: tok.decode(ids)) if tok is not None else (lambda ids: str(ids))
    return (f"{where}: MTP output differs from serial at new token {i} (serial {len(serial)} tokens, MTP {len(mtp)})\n"
            f"    context : ...{dec((list(prompt) + serial[:i])[-24:])!r}\n"
            f"    serial  : {dec(serial[i:i + 12])!r}  ids {serial[i:i + 6]}\n"
            f"    MTP     : {dec(mtp[i:i + 12])!r}  ids {mtp[i:i + 6]}")


def _bar(total, desc, cfg, unit="it"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not cfg.progress, leave=False, file=sys.stderr)


# ----------------------------------------------------------------------------------------------- sections
class Harness:
    """Holds the model, heads, tokenizer and config of one run; each section appends rows."""

    def __init__(self, model, heads, tok, cfg, heads_dir=None):
        self.model, self.heads, self.tok, self.cfg = model, heads, tok, cfg
        self.ctx = model.config.max_position_embeddings
        self.eos = getattr(tok, "eos_token_id", None)
        self.tree = tree_by_name(cfg.tree, heads.num_heads, heads_dir)
        self.heads_dir = heads_dir
        self.runtime = RuntimeConfig(fallback_threshold=cfg.fallback) if cfg.fallback is not None else None
        self.env = env_info(model.device)
        self.base = dict(self.env, run_id=uuid.uuid4().hex[:8], tree=cfg.tree, tree_size=self.tree.size,
                         tree_depth=self.tree.max_depth, temperature=cfg.temperature, top_p=cfg.top_p)
        self.rows, self.failures = [], []

    def run(self, ids, max_new, mtp, tree=None, temperature=None, seed=None, eos=-1, batch=False):
        """One request (or a batch when batch=True) with everything but the MTP switch fixed by the config."""
        t = self.cfg.temperature if temperature is None else temperature
        return generate(self.model, ids if batch else [ids], max_new, heads=self.heads if mtp else None, mtp=mtp,
                        tree=tree or self.tree, temperature=t, top_p=self.cfg.top_p,
                        seed=self.cfg.seed if seed is None else seed, eos_token_id=self.eos if eos == -1 else eos,
                        kernels=self.cfg.kernels, runtime=self.runtime)

    def fail(self, section, message):
        self.failures.append(f"[{section}] {message}")

    # ---- A/B over the scenario sets ----
    def ab(self, scenarios):
        cfg = self.cfg
        first = next(iter(scenarios.values()))[0]
        ids, _, _ = encode(self.tok, first["text"], 4, self.ctx, cfg.prompt_cap)
        self.run(ids, 4, False)                                              # warm-up, not recorded
        self.run(ids, 4, True)
        n = sum(len(v) for v in scenarios.values())
        bar = _bar(n, "A/B requests", cfg)
        for name, items in scenarios.items():
            for k, item in enumerate(items):
                cap = min(item["max_new_tokens"], cfg.max_new_cap or item["max_new_tokens"])
                ids, m, trunc = encode(self.tok, item["text"], cap, self.ctx, cfg.prompt_cap)
                seed = cfg.seed + k                                          # the same seed for off and on
                order = ("off", "on") if k % 2 == 0 else ("on", "off")       # alternate, so drift hits both
                res = {mode: self.run(ids, m, mode == "on", seed=seed) for mode in order}
                res = {"off": res["off"], "on": res["on"]}
                same = res["off"].tokens == res["on"].tokens
                for mode, r in res.items():
                    row = dict(self.base, section="ab", scenario=name, item=item["id"], length=item["length"],
                               mode=mode, tree_size=r.stats.tree_size, prompt_tokens=len(ids),
                               prompt_truncated=trunc, max_new_tokens=m, identical=same,
                               first_diff=first_difference(res["off"].tokens[0], res["on"].tokens[0]),
                               **request_metrics(r.stats, r.stats.tree_size))
                    if cfg.temperature > 0:
                        out = r.tokens[0]
                        row.update(mean_logprob=mean_logprob(self.model, ids, out),
                                   distinct_ratio=len(set(out)) / len(out))
                    self.rows.append(row)
                if cfg.temperature == 0 and not same:
                    self.fail("quality", describe_mismatch(self.tok, f"{name}/{item['id']}", res["off"].tokens[0],
                                                           res["on"].tokens[0], ids))
                bar.update(1)
        bar.close()
        if cfg.temperature > 0:
            for name in scenarios:
                for q in sampled_quality(self.rows, name):
                    self.rows.append(dict(self.base, section="quality", scenario=name, **q))
                    if q["ok"] is False:
                        self.fail("quality", f"{name}: {q['metric']} differs: on {q['on']:.4f} vs off {q['off']:.4f}"
                                             f" (|diff| {abs(q['diff']):.4f} > tolerance {q['tolerance']:.4f})")

    # ---- parameter sensitivity ----
    def sweep(self, scenarios):
        cfg = self.cfg
        names = list(cfg.sweep_trees or sweep_tree_names(self.heads.num_heads))
        items = [it for its in scenarios.values() for it in its[:1]][:cfg.sweep_prompts]
        reqs = [encode(self.tok, it["text"], cfg.sweep_tokens, self.ctx, cfg.prompt_cap)[:2] for it in items]
        bar = _bar(len(reqs) * (len(names) + 1), "sweep", cfg)
        serial = []
        for ids, m in reqs:
            serial.append(self.run(ids, m, False))
            bar.update(1)
        self._sweep_rows("serial", Tree.root_only(), serial)
        for name in names:
            tree = tree_by_name(name, self.heads.num_heads, self.heads_dir)
            runs = []
            for (ids, m), ref in zip(reqs, serial):
                r = self.run(ids, m, True, tree=tree)
                if cfg.temperature == 0 and r.tokens != ref.tokens:
                    self.fail("quality", describe_mismatch(self.tok, f"sweep {name}", ref.tokens[0], r.tokens[0], ids))
                runs.append(r)
                bar.update(1)
            self._sweep_rows(name, tree, runs)
        bar.close()

    def _sweep_rows(self, name, tree, runs):
        for r in runs:
            self.rows.append(dict(self.base, section="sweep", sweep_tree=name, sweep_size=tree.size,
                                  sweep_depth=tree.max_depth, sweep_top_k=tree.top_k, mode="off" if tree.size == 1 else "on",
                                  **request_metrics(r.stats, tree.size)))

    # ---- long-run stability ----
    def long_run(self, scenarios, total_tokens):
        cfg = self.cfg
        items = [it for its in scenarios.values() for it in its]
        reqs = [encode(self.tok, it["text"], min(it["max_new_tokens"], cfg.long_request_tokens), self.ctx,
                       cfg.prompt_cap)[:2] for it in items]
        bar = _bar(total_tokens, "long run", cfg, unit="tok")
        done, i, check_every = 0, 0, 10
        while done < total_tokens:
            ids, m = reqs[i % len(reqs)]
            t0 = time.perf_counter()
            row = dict(self.base, section="long_run", request=i, error="", timeout=False, spot_check="")
            try:
                r = self.run(ids, m, True, seed=cfg.seed + i)
                row.update(request_metrics(r.stats, r.stats.tree_size))
                n = r.stats.new_tokens
                if cfg.temperature == 0 and i % check_every == 0:
                    ser = self.run(ids, m, False).tokens
                    row["spot_check"] = "match" if ser == r.tokens else "MISMATCH"
                    if ser != r.tokens:
                        self.fail("long-run", describe_mismatch(self.tok, f"request {i}", ser[0], r.tokens[0], ids))
            except Exception as e:                                           # counted, reported, run continues
                row["error"], n = f"{type(e).__name__}: {e}", 0
                self.fail("long-run", f"request {i}: {row['error']}")
            row.update(request_s=time.perf_counter() - t0 if not row.get("e2e_s") else row["e2e_s"],
                       memory_bytes=current_memory(self.model.device))
            row["timeout"] = row["request_s"] > cfg.timeout_s
            if row["timeout"]:
                self.fail("long-run", f"request {i} took {row['request_s']:.1f}s > timeout {cfg.timeout_s}s")
            self.rows.append(row)
            done, i = done + max(n, 1), i + 1
            bar.update(max(n, 1))
        bar.close()
        summary = long_run_summary([r for r in self.rows if r["section"] == "long_run"], self.model.device)
        self.rows.append(dict(self.base, section="long_summary", **summary))
        if summary["memory_growth_flag"]:
            self.fail("long-run", f"memory grew by {summary['memory_growth_bytes'] / 2**20:.1f} MiB after warm-up")

    # ---- bad and edge inputs (always at temperature 0, so outputs can be checked exactly) ----
    def edge(self, scenarios):
        tok, ctx, V = self.tok, self.ctx, self.model.config.vocab_size
        m = 8
        first = next(iter(scenarios.values()))[0]
        normal, _, _ = encode(tok, first["text"], m, ctx, self.cfg.prompt_cap or 256)
        before = self.run(normal, m, True, temperature=0.0).tokens
        text_ids = tok(first["text"])["input_ids"] or [1]
        odd = "# 🐍 naïve café — ∑ λ 中文 \x00 NUL, RTL: مرحبا بالعالم שלום, e\u0301, tab\t, CRLF\r\n"
        first_tok = self.run(normal, 1, False, temperature=0.0).tokens[0][0]
        limit_new = self.cfg.edge_limit_tokens
        cases = [  # (case, prompt ids or text, max_new, expect 'error' or 'output', extra kwargs)
            ("empty input", "", m, "error", {}),
            ("over-long context (context + 10 tokens)", (text_ids * (ctx // len(text_ids) + 2))[:ctx + 10], m, "error", {}),
            (f"context at the limit (context - {limit_new} tokens)", (text_ids * (ctx // len(text_ids) + 2))[:ctx - limit_new],
             limit_new, "output", {}),
            (f"repeated input (one token x {min(200, ctx - 2 * m)})", [text_ids[0]] * min(200, ctx - 2 * m), m,
             "output", {}),
            ("unusual characters (emoji, NUL, RTL, combining)", odd, m, "output", {}),
            ("max_new_tokens = 1", normal, 1, "output", {}),
            ("max_new_tokens = 0", normal, 0, "error", {}),
            ("EOS as the first token (stop id = the model's first choice)", normal, m, "output", {"eos": first_tok}),
            ("EOS token as the whole input", [self.eos if self.eos is not None else 0], m, "output", {}),
            ("token id out of range (= vocab size)", [1, 2, V], m, "error", {}),
        ]
        for case, prompt, mx, expect, kw in cases:
            row = dict(self.base, section="edge", case=case, expect=expect, outcome="", detail="", ok=False)
            ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else prompt
            if isinstance(prompt, str) and prompt:
                back = tok.decode(ids)
                if back != prompt:
                    row["detail"] = f"tokenizer round trip changed the text: {back!r}"
            try:
                ser = self.run(ids, mx, False, temperature=0.0, **kw).tokens[0]
                mtp = self.run(ids, mx, True, temperature=0.0, **kw).tokens[0]
                row["outcome"] = f"{len(mtp)} tokens, MTP {'==' if ser == mtp else '!='} serial"
                ok = ser == mtp and 1 <= len(mtp) <= mx
                if "eos" in kw:
                    ok = ok and mtp == [kw["eos"]]
                if ser != mtp:
                    row["detail"] += describe_mismatch(tok, case, ser, mtp, ids)
                tok.decode(mtp)                                              # decoding the output must not fail
                row["ok"] = expect == "output" and ok and not row["detail"]
            except ValueError as e:
                row["outcome"], row["detail"] = "ValueError", str(e)[:200]
                row["ok"] = expect == "error"
            except Exception as e:                                           # anything else is a failure
                row["outcome"], row["detail"] = type(e).__name__, str(e)[:200]
            if not row["ok"]:
                self.fail("edge", f"{case}: expected {expect}, got {row['outcome']} {row['detail']}")
            self.rows.append(row)
        after = self.run(normal, m, True, temperature=0.0).tokens
        ser = self.run(normal, m, False, temperature=0.0).tokens
        ok = after == before == ser
        self.rows.append(dict(self.base, section="edge", case="normal request after the bad inputs", expect="output",
                              outcome=f"{len(after[0])} tokens, {'same as before and as serial' if ok else 'CHANGED'}",
                              detail="", ok=ok))
        if not ok:
            self.fail("edge", "a normal request after the edge cases no longer matches its earlier output / serial")

    # ---- compatibility: batch vs single requests ----
    def compat(self, scenarios):
        items = [it for its in scenarios.values() for it in its][:4]
        m = min(16, self.cfg.max_new_cap or 16)
        reqs = [encode(self.tok, it["text"], m, self.ctx, self.cfg.prompt_cap or 256)[0] for it in items]
        reqs = [r[: max(8, len(r) - 7 * k)] for k, r in enumerate(reqs)]           # different lengths on purpose
        single = [self.run(r, m, False, temperature=0.0).tokens[0] for r in reqs]
        batch = self.run(reqs, m, True, temperature=0.0, batch=True).tokens
        ok = batch == single
        self.rows.append(dict(self.base, section="compat", case=f"batch of {len(reqs)} (MTP) vs single requests (serial)",
                              batch=len(reqs), ok=ok, detail="" if ok else "outputs differ"))
        if not ok:
            b = next(i for i in range(len(reqs)) if batch[i] != single[i])
            self.fail("compat", describe_mismatch(self.tok, f"batch row {b}", single[b], batch[b], reqs[b]))


def current_memory(device):
    """Bytes in use now: GPU tensors (memory_allocated) or this process's resident set (CPU)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.memory_allocated(device)
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import psutil
        return psutil.Process().memory_info().rss


# ----------------------------------------------------------------------------------------------- aggregation
def _f(x):
    """Number from a row value (rows read back from CSV hold strings)."""
    if x is None or x == "" or x == "None":
        return None
    if isinstance(x, (bool, int, float)):
        return float(x)
    if x in ("True", "False"):
        return float(x == "True")
    return float(x)


def _pct(xs, q):
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))] if s else None


def _rows(rows, section, **match):
    return [r for r in rows if r.get("section") == section and all(str(r.get(k)) == str(v) for k, v in match.items())]


def aggregate(rows):
    """Per request group: tokens/s over summed time, latency percentiles over requests, acceptance per depth."""
    if not rows:
        return None
    tok = sum(_f(r["new_tokens"]) for r in rows)
    dec_tok = sum(_f(r["new_tokens"]) - 1 for r in rows)
    dec_time = sum(_f(r["e2e_s"]) - _f(r["ttft_s"]) for r in rows)
    steps = sum(_f(r["steps"]) for r in rows)
    e2e = [_f(r["e2e_s"]) for r in rows]
    hists = [json.loads(r["accept_len_histogram"]) for r in rows]
    rates = [json.loads(r["accept_rate_per_depth"]) for r in rows]
    depth = max((len(x) for x in rates), default=0)
    seq = [sum(h) for h in hists]
    acc = [sum(x[d] * n for x, n in zip(rates, seq) if d < len(x)) / max(sum(n for x, n in zip(rates, seq) if d < len(x)), 1)
           for d in range(depth)]
    mem = [_f(r["peak_memory_bytes"]) for r in rows if _f(r["peak_memory_bytes"]) is not None]
    energy = [_f(r["energy_j"]) for r in rows if _f(r.get("energy_j")) is not None]
    return dict(
        requests=len(rows), new_tokens=tok, decode_tokens_per_s=dec_tok / max(dec_time, 1e-12),
        ttft_ms=1e3 * statistics.mean(_f(r["ttft_s"]) for r in rows),
        e2e_ms=1e3 * statistics.mean(e2e), e2e_p95_ms=1e3 * _pct(e2e, 95), e2e_p99_ms=1e3 * _pct(e2e, 99),
        itl_p50_ms=1e3 * statistics.mean(_f(r["itl_p50_s"]) for r in rows if _f(r["itl_p50_s"]) is not None),
        itl_p95_ms=1e3 * statistics.mean(_f(r["itl_p95_s"]) for r in rows if _f(r["itl_p95_s"]) is not None),
        itl_p99_ms=1e3 * statistics.mean(_f(r["itl_p99_s"]) for r in rows if _f(r["itl_p99_s"]) is not None),
        tokens_per_step=dec_tok / max(sum(seq), 1), accept_per_depth=acc,
        rejected_steps=sum(_f(r["rejected_steps"]) for r in rows), wasted_drafts=sum(_f(r["wasted_drafts"]) for r in rows),
        drafted_tokens=sum(_f(r["drafted_tokens"]) for r in rows), fallback=sum(_f(r["fallback_count"]) for r in rows),
        draft_ms_step=1e3 * sum(_f(r["time_draft_s"]) for r in rows) / max(steps, 1),
        verify_ms_step=1e3 * sum(_f(r["time_verify_s"]) for r in rows) / max(steps, 1),
        accept_ms_step=1e3 * sum(_f(r["time_accept_s"]) for r in rows) / max(steps, 1),
        append_ms_step=1e3 * sum(_f(r["time_append_s"]) for r in rows) / max(steps, 1),
        peak_memory_bytes=max(mem) if mem else None, cache_bytes=max(_f(r["cache_bytes"]) for r in rows),
        energy_j=sum(energy) if energy else None)


def ab_table(rows, by="scenario"):
    """[(key, off aggregate, on aggregate, speedup)] for the A/B rows grouped by `by` (scenario or length)."""
    ab = _rows(rows, "ab")
    keys = list(dict.fromkeys(r[by] for r in ab))
    out = []
    for k in keys + ["all"]:
        sel = ab if k == "all" else [r for r in ab if r[by] == k]
        off, on = aggregate([r for r in sel if r["mode"] == "off"]), aggregate([r for r in sel if r["mode"] == "on"])
        if off and on:
            out.append((k, off, on, on["decode_tokens_per_s"] / off["decode_tokens_per_s"]))
    return out


def sampled_quality(rows, scenario):
    """T > 0: paired on-minus-off differences per item of mean log-prob, distinct ratio and length."""
    ab = _rows(rows, "ab", scenario=scenario)
    off = {r["item"]: r for r in ab if r["mode"] == "off"}
    on = {r["item"]: r for r in ab if r["mode"] == "on"}
    items = [i for i in off if i in on]
    out = []
    for metric in ("mean_logprob", "distinct_ratio", "new_tokens"):
        a = [_f(on[i][metric]) for i in items]
        b = [_f(off[i][metric]) for i in items]
        d = [x - y for x, y in zip(a, b)]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) >= MIN_ITEMS else None
        tol = None if se is None else t_critical(ALPHA, len(d) - 1) * se + FLOOR[metric]
        out.append(dict(metric=metric, n=len(d), on=statistics.mean(a), off=statistics.mean(b), diff=statistics.mean(d),
                        tolerance=tol, ok=None if tol is None else abs(statistics.mean(d)) <= tol))
    return out


def t_critical(alpha, df):
    """x with P(|T| > x) = alpha for Student's t with df degrees of freedom.

    With x = sqrt(df) tan(theta) the density becomes proportional to cos(theta)^(df - 1) on [0, pi/2), a bounded
    integrand, so a trapezoid rule gives the central mass P(|T| <= x) accurately; df = 1 gives tan(pi/2 (1 - alpha)).
    """
    theta = torch.linspace(0, math.pi / 2, 200001, dtype=torch.float64)
    f = torch.cos(theta) ** (df - 1)
    mass = torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum((f[1:] + f[:-1]) / 2, 0)])
    mass = mass / mass[-1]                                                   # P(|T| <= sqrt(df) tan(theta))
    i = int(torch.searchsorted(mass, torch.tensor([1 - alpha], dtype=torch.float64)))
    w = (1 - alpha - mass[i - 1]) / (mass[i] - mass[i - 1])
    return math.sqrt(df) * math.tan(float(theta[i - 1] + w * (theta[i] - theta[i - 1])))


def long_run_summary(rows, device):
    ok = [r for r in rows if not r["error"]]
    q = max(1, len(ok) // 4)
    first, last = ok[:q], ok[-q:]
    tput = lambda rs: sum(_f(r["new_tokens"]) for r in rs) / max(sum(_f(r["request_s"]) for r in rs), 1e-12)
    mem = [_f(r["memory_bytes"]) for r in rows]
    warm = mem[min(len(mem) - 1, q)] if mem else 0.0
    growth = (mem[-1] - warm) if mem else 0.0
    kind = torch.device(device).type
    return dict(requests=len(rows), tokens=int(sum(_f(r["new_tokens"]) for r in ok)), errors=len(rows) - len(ok),
                timeouts=sum(bool(_f(r["timeout"])) for r in rows),
                spot_checks=sum(r["spot_check"] != "" for r in rows), spot_mismatches=sum(r["spot_check"] == "MISMATCH" for r in rows),
                tput_first=tput(first) if first else None, tput_last=tput(last) if last else None,
                drift=(tput(last) / tput(first) - 1) if first and last else None,
                memory_start_bytes=mem[0] if mem else None, memory_warm_bytes=warm, memory_end_bytes=mem[-1] if mem else None,
                memory_growth_bytes=growth, memory_growth_limit=MEM_GROWTH_LIMIT.get(kind, MEM_GROWTH_LIMIT["cpu"]),
                memory_growth_flag=growth > MEM_GROWTH_LIMIT.get(kind, MEM_GROWTH_LIMIT["cpu"]))


# ----------------------------------------------------------------------------------------------- the run
def evaluate(model, heads, tok, cfg=None, heads_dir=None):
    """Run every requested section; returns EvalResult(rows, failures, info). Rows carry env_info()."""
    cfg = cfg or EvalConfig()
    h = Harness(model, heads, tok, cfg, heads_dir)
    scenarios = load_scenarios(cfg.scenarios, cfg.max_prompts, cfg.scenario_dir)
    h.ab(scenarios)
    if cfg.sweep:
        h.sweep(scenarios)
    if cfg.long_run:
        h.long_run(scenarios, cfg.long_run)
    if cfg.edge:
        h.edge(scenarios)
    if cfg.compat:
        h.compat(scenarios)
    info = dict(device=h.env["device"], interpreter=h.env["interpreter"], tree=cfg.tree, tree_size=h.tree.size,
                tree_depth=h.tree.max_depth, num_heads=heads.num_heads, dtype=str(model.dtype).replace("torch.", ""),
                heads_bytes=sum(p.numel() * p.element_size() for p in heads.parameters()),
                model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                context=h.ctx, temperature=cfg.temperature, top_p=cfg.top_p, kernels=cfg.kernels,
                cpu=model.device.type != "cuda")
    return EvalResult(h.rows, h.failures, info)


# ----------------------------------------------------------------------------------------------- report
def _fmt(x, nd=2):
    if x is None:
        return "n/a"
    if isinstance(x, bool):
        return "yes" if x else "NO"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def md_table(header, body):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _mib(x):
    return None if x is None else x / 2 ** 20


def performance_tables(rows):
    """Markdown tables of the A/B rows: per scenario, per output length, observability, phases."""
    parts = []
    head = ["scenario", "req", "tok/s off", "tok/s on", "speedup", "TTFT ms off", "TTFT ms on", "e2e ms off",
            "e2e ms on", "e2e P95 off", "e2e P95 on", "e2e P99 off", "e2e P99 on", "ITL P50/P95/P99 ms off",
            "ITL P50/P95/P99 ms on"]
    itl = lambda a: f"{a['itl_p50_ms']:.2f} / {a['itl_p95_ms']:.2f} / {a['itl_p99_ms']:.2f}"
    body = [(k, on["requests"], off["decode_tokens_per_s"], on["decode_tokens_per_s"], sp, off["ttft_ms"], on["ttft_ms"],
             off["e2e_ms"], on["e2e_ms"], off["e2e_p95_ms"], on["e2e_p95_ms"], off["e2e_p99_ms"], on["e2e_p99_ms"],
             itl(off), itl(on)) for k, off, on, sp in ab_table(rows, "scenario")]
    parts.append(md_table(head, body))
    body = [(k, on["requests"], on["new_tokens"] / on["requests"], off["decode_tokens_per_s"], on["decode_tokens_per_s"],
             sp, off["ttft_ms"], on["ttft_ms"], off["e2e_ms"], on["e2e_ms"]) for k, off, on, sp in ab_table(rows, "length")]
    parts.append("By output length (each scenario set has short, medium and long items):\n\n" + md_table(
        ["output length", "req", "mean new tokens", "tok/s off", "tok/s on", "speedup", "TTFT ms off", "TTFT ms on",
         "e2e ms off", "e2e ms on"], body))
    table = ab_table(rows, "scenario")
    depth = max((len(on["accept_per_depth"]) for _, _, on, _ in table), default=0)
    body = [(k, on["tokens_per_step"], *[f"{a:.0%}" for a in on["accept_per_depth"]],
             *[""] * (depth - len(on["accept_per_depth"])), int(on["rejected_steps"]),
             f"{int(on['wasted_drafts'])} / {int(on['drafted_tokens'])}", int(on["fallback"])) for k, _, on, _ in table]
    parts.append("MTP observability (tau = tokens per verify step, bonus included; acceptance at depth d = share of steps "
                 "whose accepted path reached depth d; rejected steps = steps whose path stopped short of the tree's "
                 "depth):\n\n" + md_table(["scenario", "tau", *[f"acc d{d + 1}" for d in range(depth)], "rejected steps",
                                           "wasted / drafted tokens", "fallbacks"], body))
    body = []
    for k, off, on, _ in table:
        for mode, a in (("off", off), ("on", on)):
            body.append((k, mode, a["draft_ms_step"], a["verify_ms_step"], a["accept_ms_step"], a["append_ms_step"],
                         a["verify_ms_step"] / off["verify_ms_step"] if off["verify_ms_step"] else None))
    parts.append("Time per phase (ms per step) and verification overhead (verify time per step relative to the serial "
                 "step):\n\n" + md_table(["scenario", "MTP", "draft", "verify", "accept", "append", "verify / serial"], body))
    return parts


def sweep_table(rows):
    sw = _rows(rows, "sweep")
    base = aggregate([r for r in sw if r["sweep_tree"] == "serial"])
    body = []
    for name in dict.fromkeys(r["sweep_tree"] for r in sw):
        sel = [r for r in sw if r["sweep_tree"] == name]
        a = aggregate(sel)
        acc = a["accept_per_depth"]
        body.append((name, int(_f(sel[0]["sweep_size"])), int(_f(sel[0]["sweep_depth"])), int(_f(sel[0]["sweep_top_k"])),
                     a["tokens_per_step"], f"{acc[0]:.0%}" if acc else "", f"{acc[-1]:.0%}" if acc else "",
                     a["decode_tokens_per_s"], a["decode_tokens_per_s"] / base["decode_tokens_per_s"],
                     a["verify_ms_step"]))
    return md_table(["tree", "nodes", "depth", "top-k", "tau", "acc d1", "acc deepest", "tok/s", "speedup",
                     "verify ms/step"], body)


def write_report(result, path, command=""):
    rows, info, fails = result.rows, result.info, result.failures
    r0 = rows[0] if rows else {}
    used = sorted({str(r["kernels"]) for r in rows if r.get("kernels")})
    ops = " + ".join("Triton interpreter" if k == "triton" and info["interpreter"] else
                     "PyTorch ops" if k == "torch" else "Triton kernels" for k in used) or info["kernels"]
    hw = f"{info['device']}, {ops}" + (" — CPU numbers; they say nothing about GPU speed" if info["cpu"] else "")
    L = ["# MTP evaluation report", "",
         f"- hardware: **{hw}**",
         f"- torch {r0.get('torch')}, triton {r0.get('triton')}, python {r0.get('python')}, commit {r0.get('commit')}, "
         f"{r0.get('timestamp')}, run {r0.get('run_id')}",
         f"- model: {info['model_bytes'] / 2**20:.1f} MiB of weights ({info['dtype']}), context {info['context']}; "
         f"{info['num_heads']} heads ({info['heads_bytes'] / 2**20:.2f} MiB)",
         f"- tree: {info['tree']} ({info['tree_size']} nodes, depth {info['tree_depth']}); kernels {info['kernels']}; "
         f"temperature {info['temperature']}, top-p {info['top_p']}",
         f"- command: `{command}`" if command else "", "",
         "## Verdict", ""]
    sections = {"quality": "quality gate", "edge": "edge inputs", "long-run": "long-run stability", "compat": "compatibility"}
    ab = _rows(rows, "ab")
    ran = {"quality": bool(ab), "edge": bool(_rows(rows, "edge")), "long-run": bool(_rows(rows, "long_summary")),
           "compat": bool(_rows(rows, "compat"))}
    for key, name in sections.items():
        n = sum(f.startswith(f"[{key}]") for f in fails)
        L.append(f"- {name}: " + ("not run" if not ran[key] else "**PASS**" if n == 0 else f"**FAIL** ({n} problems)"))
    if fails:
        L += ["", "Problems:", "", "```", *fails, "```"]
    L += ["", "## 1. Functional completeness", ""]
    off = [r for r in ab if r["mode"] == "off"]
    L.append(md_table(["check", "result"], [
        ("MTP off runs the serial path (1 node per step, tau = 1)",
         bool(off) and all(_f(r["tree_size"]) == 1 and abs(_f(r["tokens_per_step"]) - 1) < 1e-9 for r in off)),
        ("draft length / candidate count configurable", f"--tree (this run: {info['tree']}); sweep covers "
         f"{len(set(r['sweep_tree'] for r in _rows(rows, 'sweep')))} trees" if _rows(rows, "sweep") else "--tree, --sweep"),
        ("fallback to serial", "RuntimeConfig.fallback_threshold (--fallback); fallbacks this run: "
         f"{int(sum(_f(r['fallback_count']) for r in ab))}"),
        ("statistics exposed", "acceptance per depth, accept-length histogram, phase times, TTFT, ITL percentiles"),
    ]))
    L += ["", "## 2. Quality", ""]
    if info["temperature"] == 0:
        body = []
        for sc in dict.fromkeys(r["scenario"] for r in ab):
            on = [r for r in ab if r["scenario"] == sc and r["mode"] == "on"]
            body.append((sc, len(on), sum(bool(_f(r["identical"])) for r in on)))
        L.append("Greedy decoding: the MTP output must equal the serial output token for token.\n")
        L.append(md_table(["scenario", "requests", "identical"], body))
    else:
        L.append(f"Sampling (T = {info['temperature']}): outputs cannot match token for token, so the paired per-item "
                 f"differences (on - off) of three summaries are compared with a paired t-test: |mean diff| <= t(1 - "
                 f"{ALPHA:g}/2, n - 1) x its standard error + a floor ({', '.join(f'{k} {v}' for k, v in FLOOR.items())})"
                 f", so a correct engine fails one check with probability {ALPHA:g}; sets with fewer than {MIN_ITEMS} "
                 f"items get no verdict. With few items the tolerance is wide: more items (--max-prompts) make the "
                 f"check sharper.\n")
        body = [(r["scenario"], r["metric"], r["n"], _f(r["off"]), _f(r["on"]), _f(r["diff"]), _f(r["tolerance"]),
                 f"n/a (< {MIN_ITEMS} items)" if r["ok"] in (None, "", "None") else bool(_f(r["ok"])))
                for r in _rows(rows, "quality")]
        L.append(md_table(["scenario", "summary", "n", "off", "on", "diff", "tolerance", "within"], body))
    if ab:
        L += ["", f"## 3. Performance ({'CPU' if info['cpu'] else info['device']}, batch 1)", "",
              "Decode tokens/s = (new tokens - 1) / (end-to-end - TTFT), summed over requests; latency percentiles "
              "are over requests; ITL percentiles are the per-request engine percentiles, averaged.", ""]
        L += [p + "\n" for p in performance_tables(rows)]
        L += ["## 4. Resources", ""]
        body = [(k, _mib(off["peak_memory_bytes"]), _mib(on["peak_memory_bytes"]), _mib(off["cache_bytes"]),
                 _mib(on["cache_bytes"]), off["energy_j"], on["energy_j"]) for k, off, on, _ in ab_table(rows, "scenario")]
        L.append(("Peak memory is the process RSS high-water mark on CPU (monotone over the run: not an A/B "
                  "measure); on GPU it is max_memory_allocated per request. " if info["cpu"] else
                  "Peak memory = torch.cuda.max_memory_allocated per request. ") +
                 f"MTP adds the heads ({info['heads_bytes'] / 2**20:.2f} MiB) and tree slack in the KV cache.\n")
        L.append(md_table(["scenario", "peak MiB off", "peak MiB on", "KV cache MiB off", "KV cache MiB on",
                           "energy J off", "energy J on"], body))
    if _rows(rows, "sweep"):
        L += ["", "## 5. Parameter sensitivity", "",
              "Same prompts, one per scenario set, MTP on with each tree; speedup against serial on the same prompts. "
              "chain-n = depth n, one candidate per head; medusa-N = N-node trees; width-k = k candidates per head.", "",
              sweep_table(rows)]
    s = _rows(rows, "long_summary")
    if s:
        s = s[0]
        L += ["", "## 6. Long-run stability", "", md_table(["metric", "value"], [
            ("requests / tokens", f"{s['requests']} / {int(_f(s['tokens']))}"),
            ("errors / timeouts", f"{s['errors']} / {s['timeouts']}"),
            ("spot checks vs serial (mismatches)", f"{s['spot_checks']} ({s['spot_mismatches']})"),
            ("throughput first / last quarter (tok/s)", f"{_fmt(_f(s['tput_first']))} / {_fmt(_f(s['tput_last']))}"),
            ("throughput drift", "n/a" if s["drift"] in (None, "") else f"{_f(s['drift']):+.1%}"),
            ("memory after warm-up / at end (MiB)", f"{_mib(_f(s['memory_warm_bytes'])):.1f} / "
                                                     f"{_mib(_f(s['memory_end_bytes'])):.1f}"),
            ("memory growth (MiB; limit)", f"{_mib(_f(s['memory_growth_bytes'])):+.2f} (limit "
                                           f"{_mib(_f(s['memory_growth_limit'])):.0f})"),
        ])]
    if _rows(rows, "edge"):
        L += ["", "## 7. Bad and edge inputs (temperature 0)", "",
              md_table(["case", "expected", "outcome", "ok", "detail"],
                       [(r["case"], r["expect"], r["outcome"], bool(_f(r["ok"])), str(r["detail"]).replace("\n", " ")[:120])
                        for r in _rows(rows, "edge")])]
    if _rows(rows, "compat"):
        L += ["", "## 8. Compatibility", "", md_table(["case", "identical"], [(r["case"], bool(_f(r["ok"])))
                                                                            for r in _rows(rows, "compat")])]
    L += ["", "## Plots", ""] + [f"![{p}]({p})" for p in result.info.get("plots", [])]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(L) + "\n")
    return path


# ----------------------------------------------------------------------------------------------- plots
def plot_all(rows, out, label=""):
    """PNG plots from the rows; returns the file names written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(os.path.join(out, name), dpi=80)
        plt.close(fig)
        written.append(name)

    ab = _rows(rows, "ab")
    if ab:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        for mode, color in (("off", "grey"), ("on", "tab:blue")):
            sel = [r for r in ab if r["mode"] == mode]
            per_tok = sorted(1e3 * (_f(r["e2e_s"]) - _f(r["ttft_s"])) / max(_f(r["new_tokens"]) - 1, 1) for r in sel)
            e2e = sorted(1e3 * _f(r["e2e_s"]) for r in sel)
            for a, xs in ((ax[0], per_tok), (ax[1], e2e)):
                a.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", color=color,
                       label="MTP " + mode)
        ax[0].set_xlabel("decode ms / token (per request)")
        ax[1].set_xlabel("end-to-end latency, ms (per request)")
        ax[1].set_xscale("log")
        for a in ax:
            a.set_ylabel("fraction of requests")
            a.legend(fontsize=8)
        ax[0].set_title(f"latency CDF {label}", fontsize=9)
        save(fig, "latency_cdf.png")

        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2), gridspec_kw={"width_ratios": [3, 2]})
        for a, by in ((ax[0], "scenario"), (ax[1], "length")):
            t = ab_table(rows, by)
            a.bar(range(len(t)), [sp for *_, sp in t], color=["tab:blue"] * (len(t) - 1) + ["tab:orange"])
            a.set_xticks(range(len(t)))
            a.set_xticklabels([k.replace("_", "\n") for k, *_ in t], fontsize=7)
            a.axhline(1.0, color="k", lw=0.8)
            a.set_ylabel("decode tok/s, on / off")
        ax[0].set_title(f"speedup per scenario {label}", fontsize=9)
        ax[1].set_title("by output length", fontsize=9)
        save(fig, "speedup.png")

        fig, ax = plt.subplots(figsize=(5, 3.2))
        for k, _, on, _ in ab_table(rows, "scenario"):
            acc = on["accept_per_depth"]
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=k, lw=2.5 if k == "all" else 1)
        ax.set_xlabel("depth")
        ax.set_ylabel("acceptance rate")
        ax.set_ylim(0, 1)
        ax.legend(fontsize=7)
        ax.set_title(f"acceptance per depth {label}", fontsize=9)
        save(fig, "acceptance.png")

    sw = _rows(rows, "sweep")
    if sw:
        base = aggregate([r for r in sw if r["sweep_tree"] == "serial"])
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.2))
        for name in dict.fromkeys(r["sweep_tree"] for r in sw if r["sweep_tree"] != "serial"):
            sel = [r for r in sw if r["sweep_tree"] == name]
            a = aggregate(sel)
            size = _f(sel[0]["sweep_size"])
            style = {"chain": ("o", "tab:blue"), "medusa": ("s", "tab:green"), "width": ("^", "tab:red")}.get(
                name.split("-")[0], ("*", "tab:orange"))
            for axis, y in ((ax[0], a["tokens_per_step"]), (ax[1], a["decode_tokens_per_s"] / base["decode_tokens_per_s"])):
                axis.scatter([size], [y], marker=style[0], color=style[1])
                axis.annotate(name, (size, y), fontsize=6, xytext=(2, 2), textcoords="offset points")
        ax[0].set_ylabel("tau (tokens / step)")
        ax[1].set_ylabel("speedup vs serial")
        ax[1].axhline(1.0, color="k", lw=0.8)
        for axis in ax:
            axis.set_xscale("log", base=2)
            axis.set_xlabel("tree nodes (root included)")
        ax[0].set_title(f"sensitivity: chain (o), medusa (s), width (^), tuned (*) {label}", fontsize=8)
        save(fig, "sensitivity.png")

    lr = [r for r in _rows(rows, "long_run") if not r["error"]]
    if lr:
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.0))
        ax[0].plot([_f(r["new_tokens"]) / _f(r["request_s"]) for r in lr], lw=0.8)
        ax[0].set_xlabel("request")
        ax[0].set_ylabel("tokens/s")
        ax[1].plot([_mib(_f(r["memory_bytes"])) for r in lr], lw=0.8)
        ax[1].set_xlabel("request")
        ax[1].set_ylabel("memory in use, MiB")
        ax[0].set_title(f"long run {label}", fontsize=9)
        save(fig, "long_run.png")
    return written


def write_outputs(result, out, command=""):
    """eval.csv (appended), report.md and the PNGs in `out`; returns the report path."""
    os.makedirs(out, exist_ok=True)
    append_rows(os.path.join(out, "eval.csv"), [dict(r, command=command) for r in result.rows])
    label = "(CPU)" if result.info["cpu"] else f"({result.info['device']})"
    result.info["plots"] = plot_all(result.rows, out, label)
    return write_report(result, os.path.join(out, "report.md"), command)


# ----------------------------------------------------------------------------------------------- command line
def build_parser():
    ap = argparse.ArgumentParser(prog="python -m mtp_triton eval", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED, help="checkpoint folder (config.json + *.safetensors + tokenizer)")
    ap.add_argument("--heads", default=None, help="heads folder (default <model>/heads)")
    ap.add_argument("--tree", default="tuned", help="'tuned', a preset (medusa-16, chain-4, ...), chain-N or width-K")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kernels", default="auto", choices=["auto", "torch", "triton"])
    ap.add_argument("--device", default=None)
    ap.add_argument("--out", default=os.path.join("out", "eval"), help="output folder")
    ap.add_argument("--scenarios", nargs="+", default=None, help=f"subset of {', '.join(SCENARIOS)}")
    ap.add_argument("--scenario-dir", default=SCENARIO_DIR)
    ap.add_argument("--max-prompts", type=int, default=None, help="items per scenario set")
    ap.add_argument("--max-new-cap", type=int, default=None, help="cap on every item's max_new_tokens")
    ap.add_argument("--sweep", action="store_true", help="parameter sensitivity: tree depth, size and width")
    ap.add_argument("--long-run", type=int, default=0, metavar="N", help="long-run stability over N generated tokens")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request before it counts as a timeout")
    ap.add_argument("--fallback", type=float, default=None, help="RuntimeConfig.fallback_threshold (off by default)")
    ap.add_argument("--no-edge", action="store_true", help="skip the bad / edge input section")
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CI): 2 items per set, <= 16 new tokens")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if not os.path.exists(os.path.join(a.model, "config.json")):
        print(f"error: no model at {a.model!r} (config.json missing). Pass --model <checkpoint folder>, or build the "
              f"embedded model first.", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from ..heads import load_heads
    from ..model import load_model
    heads_dir = a.heads or os.path.join(a.model, "heads")
    try:
        load_scenarios(a.scenarios or SCENARIOS, 1, a.scenario_dir)
        model = load_model(a.model, device=a.device)
        heads = load_heads(heads_dir, device=model.device, dtype=model.dtype)
        tree_by_name(a.tree, heads.num_heads, heads_dir)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(a.model)
    kw = dict(tree=a.tree, temperature=a.temperature, top_p=a.top_p, seed=a.seed, kernels=a.kernels,
              scenarios=tuple(a.scenarios or SCENARIOS), scenario_dir=a.scenario_dir, sweep=a.sweep,
              long_run=a.long_run, timeout_s=a.timeout, fallback=a.fallback, edge=not a.no_edge,
              progress=not a.no_progress)
    for k, v in (("max_prompts", a.max_prompts), ("max_new_cap", a.max_new_cap)):
        if v is not None:
            kw[k] = v
    cfg = EvalConfig.quick(**kw) if a.quick else EvalConfig(**kw)
    where = "CPU (numbers are CPU numbers)" if model.device.type != "cuda" else torch.cuda.get_device_name()
    print(f"eval: {a.model} on {where}; tree {a.tree}; T={a.temperature}; scenarios {', '.join(cfg.scenarios)}"
          + ("; --quick (tiny sizes)" if a.quick else ""), file=sys.stderr)
    t0 = time.perf_counter()
    result = evaluate(model, heads, tok, cfg, heads_dir)
    report = write_outputs(result, a.out, "python -m mtp_triton eval " + " ".join(argv))
    for k, off, on, sp in ab_table(result.rows, "scenario"):
        print(f"{k:18s} tok/s off {off['decode_tokens_per_s']:8.1f}  on {on['decode_tokens_per_s']:8.1f}  "
              f"speedup {sp:5.2f}x  tau {on['tokens_per_step']:.2f}  TTFT ms {off['ttft_ms']:.1f} -> {on['ttft_ms']:.1f}")
    print(f"wrote {report}, {a.out}/eval.csv and {len(result.info['plots'])} plots in {time.perf_counter() - t0:.0f}s")
    if result.failures:
        print(f"\nFAILED: {len(result.failures)} problem(s)", file=sys.stderr)
        for f in result.failures:
            print(f, file=sys.stderr)
        return 1
    print("all gates passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
