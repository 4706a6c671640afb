"""The evaluation harness: one model, its heads, a tokenizer and an EvalConfig; five sections, each adding rows.

    ab        MTP off vs on over the scenario sets (the quality gate and the performance numbers)
    sweep     the same prompts with many trees (depth, size, candidate width)
    long_run  N tokens in many requests (drift, memory, errors, timeouts, spot checks against serial)
    edge      bad and edge inputs, then a normal request that must still match serial
    compat    a batch of different-length prompts against the single requests

Scenario items are raw text or chat messages (scenarios.py); cfg.scenario_dir None: the set that fits the tokenizer.
The rows of a finished request go to `sink` at once (the CLI appends them to eval.csv), so an interrupted run keeps
every request it completed. `kept` are rows of earlier runs (--resume): a request whose rows are there for the same
configuration and device (`request_key`) is not run again; its rows are reused and the failures they record are
reported again.
"""
import dataclasses
import hashlib
import os
import sys
import time
import uuid

import torch

from mtp_triton.generate import RuntimeConfig, generate
from ..bundle import generate_tree, pick_tree, reproducible_runtime, tree_size
from mtp_triton.mtp_module import MTPModule
from ..records import KeptRows, env_info, row_key
from mtp_triton.tree import PRESETS, Tree
from .scenarios import default_scenario_dir, fit, item_text, prompt_ids
from .eval_metrics import (FLOOR, current_memory, describe_mismatch, failures_in_rows, first_difference,
                           long_run_summary, mean_logprob, num, request_metrics, sampled_quality, section_rows)

# What identifies a request within a section (with the configuration and the device, see request_key).
REQUEST_KEYS = {"ab": ("scenario", "item", "mode"), "quality": ("scenario", "metric"), "sweep": ("sweep_tree", "item"),
                "long_run": ("request", "item"), "long_summary": ("long_run_tokens",), "edge": ("case",),
                "compat": ("case",)}
FULL_CONTEXT_CPU = 2048       # longest context whose "at the limit" edge case runs on a CPU by default (tokens)


def request_key(row):
    """(configuration, device, section, the section's request fields) as strings (records.row_key): equal for a typed
    row and the same row read back from eval.csv."""
    return row_key(row, ("config", "device", "section", *REQUEST_KEYS.get(row.get("section"), ())))


def fingerprint(module):
    """12 hex digits that change when any weight does: a hash of every parameter's name, shape and sum."""
    h = hashlib.sha1()
    with torch.no_grad():
        for name, p in module.named_parameters():
            h.update(f"{name}{tuple(p.shape)}{float(torch.sum(p, dtype=torch.float64)):.12e}".encode())
    return h.hexdigest()[:12]


def config_id(cfg, model, heads):
    """Everything that changes what a request measures, readable: the weights (fingerprints) and the settings."""
    scenarios = os.path.basename(os.path.normpath(cfg.scenario_dir)) if cfg.scenario_dir else "auto"
    return (f"model {fingerprint(model)} heads {fingerprint(heads)} scenarios {scenarios} tree {cfg.tree} "
            f"T {cfg.temperature} top_p {cfg.top_p} seed {cfg.seed} kernels {cfg.kernels} fallback {cfg.fallback} "
            + (f"prune_below {cfg.prune_below} " if cfg.prune_below is not None else "") +
            f"max_new_cap {cfg.max_new_cap} prompt_cap {cfg.prompt_cap} sweep_tokens {cfg.sweep_tokens} "
            f"long_request_tokens {cfg.long_request_tokens} edge_limit_tokens {cfg.edge_limit_tokens} "
            f"edge_full_context {cfg.edge_full_context}")


def sweep_tree_names(num_heads, stored=False):
    """chain-1..chain-min(8, H), the medusa presets that fit, tuned (and stored: the heads' own tree), width-2/4/8."""
    names = [f"chain-{n}" for n in range(1, min(8, num_heads) + 1)]
    names += [f"medusa-{n}" for n in (8, 16, 32, 64) if Tree.from_choices(PRESETS[f"medusa-{n}"]).max_depth <= num_heads]
    return names + ["tuned"] + (["stored"] if stored else []) + [f"width-{k}" for k in (2, 4, 8)]


def _bar(total, desc, cfg, unit="it"):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, disable=not cfg.progress, leave=False, file=sys.stderr)


class Harness:
    """Holds the model, heads, tokenizer and config of one run; each section adds rows (see the module docstring)."""

    def __init__(self, model, heads, tok, cfg, heads_dir=None, sink=None, kept=()):
        if cfg.scenario_dir is None:
            cfg = dataclasses.replace(cfg, scenario_dir=default_scenario_dir(tok))
        self.model, self.heads, self.tok, self.cfg, self.heads_dir = model, heads, tok, cfg, heads_dir
        self.ctx = model.config.max_position_embeddings
        self.eos = getattr(tok, "eos_token_id", None)
        self.tree = pick_tree(cfg.tree, heads, heads_dir, model, cfg.kernels)
        self.runtime = reproducible_runtime(cfg.temperature, cfg.seed, fallback_threshold=cfg.fallback,
                                            prune_below=cfg.prune_below)
        self.env = env_info(model.device)
        self.config = config_id(cfg, model, heads)
        self.base = dict(self.env, run_id=uuid.uuid4().hex[:8], config=self.config, tree=cfg.tree,
                         tree_size=tree_size(heads, self.tree), temperature=cfg.temperature,
                         tree_depth=heads.draft["depth"] if self.tree is None else self.tree.max_depth,
                         drafter="mtp" if self.tree is None else "medusa", top_p=cfg.top_p)
        self.rows, self.failures = [], []
        self.sink, self.warm = sink, False
        self.kept = KeptRows(kept, request_key)       # a later row of the same request wins; .used: rows reused

    # ---- plumbing: prompts, run, compare, record, reuse ----
    def prompt(self, item, max_new, prompt_cap=None):
        """(ids, max_new, truncated) of a scenario item. The cap (cfg.prompt_cap unless given) applies to raw text
        only: a chat prompt is cut only to fit the context, never to drop the start of its template."""
        cap = (prompt_cap or self.cfg.prompt_cap) if "messages" not in item else None
        return fit(prompt_ids(self.tok, item), max_new, self.ctx, cap)

    def run(self, ids, max_new, mtp, tree=None, temperature=None, seed=None, eos=-1, batch=False):
        """One request (or a batch when batch=True) with everything but the MTP switch fixed by the config."""
        t = self.cfg.temperature if temperature is None else temperature
        return generate(self.model, ids if batch else [ids], max_new, heads=self.heads if mtp else None, mtp=mtp,
                        tree=tree or generate_tree(self.cfg.tree, self.heads, self.tree), temperature=t,
                        top_p=self.cfg.top_p, seed=self.cfg.seed if seed is None else seed,
                        eos_token_id=self.eos if eos == -1 else eos, kernels=self.cfg.kernels, runtime=self.runtime)

    def warm_up(self, scenarios):
        """Once per process, before the first measured request: serial and MTP on a short prompt, not recorded."""
        if not self.warm:
            ids, _, _ = self.prompt(next(iter(scenarios.values()))[0], 4)
            self.run(ids, 4, False)
            self.run(ids, 4, True)
            self.warm = True

    def same(self, section, where, serial, mtp, ids):
        """serial == mtp (two sequences of new tokens); a difference is a failure of `section`, described."""
        if serial != mtp:
            self.fail(section, describe_mismatch(self.tok, where, serial, mtp, ids))
        return serial == mtp

    def fail(self, section, message):
        self.failures.append(f"[{section}] {message}")

    def record(self, rows):
        """The rows of one finished request (or check): kept here and handed to the sink now."""
        self.rows += rows
        if self.sink is not None:
            self.sink(rows)

    def reuse(self, section, *requests):
        """--resume: the kept rows of these requests (dicts of their REQUEST_KEYS) if all are there, else None;
        without requests, all the kept rows of a section written in one piece (edge, compat), or None. Kept rows
        join this run's rows, and the failures they record are reported again."""
        if requests:
            rows = self.kept.take(*[request_key(dict(self.base, section=section, **r)) for r in requests])
        else:
            rows = self.kept.matching(lambda k: k[:3] == (self.config, self.env["device"], section))
        if not rows:
            return None
        self.rows += rows
        for s, message in failures_in_rows(rows):
            self.fail(s, message)
        return rows

    # ---- A/B over the scenario sets ----
    def ab(self, scenarios):
        cfg = self.cfg
        bar = _bar(sum(len(v) for v in scenarios.values()), "A/B requests", cfg)
        for name, items in scenarios.items():
            for k, item in enumerate(items):
                if not self.reuse("ab", *[dict(scenario=name, item=item["id"], mode=m) for m in ("off", "on")]):
                    self.warm_up(scenarios)
                    self.record(self._ab_item(name, k, item))
                bar.update(1)
        bar.close()
        for name in scenarios if cfg.temperature > 0 else ():
            if self.reuse("quality", *[dict(scenario=name, metric=m) for m in FLOOR]):
                continue
            rows = [dict(self.base, section="quality", scenario=name, **q) for q in sampled_quality(self.rows, name)]
            for q in rows:
                if q["ok"] is False:
                    self.fail("quality", f"{name}: {q['metric']} differs: on {q['on']:.4f} vs off {q['off']:.4f}"
                                         f" (|diff| {abs(q['diff']):.4f} > tolerance {q['tolerance']:.4f})")
            self.record(rows)

    def _ab_item(self, name, k, item):
        """Serial and MTP on one item, same prompt, max_new_tokens, seed; the order alternates so drift hits both."""
        cfg = self.cfg
        ids, m, trunc = self.prompt(item, min(item["max_new_tokens"], cfg.max_new_cap or item["max_new_tokens"]))
        order = ("off", "on") if k % 2 == 0 else ("on", "off")
        res = {mode: self.run(ids, m, mode == "on", seed=cfg.seed + k) for mode in order}
        off, on = res["off"].tokens[0], res["on"].tokens[0]
        same = self.same("quality", f"{name}/{item['id']}", off, on, ids) if cfg.temperature == 0 else off == on
        rows = []
        for mode in ("off", "on"):
            r = res[mode]
            row = dict(self.base, section="ab", scenario=name, item=item["id"], length=item["length"],
                       mode=mode, tree_size=r.stats.tree_size, prompt_tokens=len(ids),
                       prompt_truncated=trunc, max_new_tokens=m, identical=same, first_diff=first_difference(off, on),
                       **request_metrics(r.stats, r.stats.tree_size))
            if cfg.temperature > 0:
                out = r.tokens[0]
                row.update(mean_logprob=mean_logprob(self.model, ids, out), distinct_ratio=len(set(out)) / len(out))
            rows.append(row)
        return rows

    # ---- parameter sensitivity ----
    def sweep(self, scenarios):
        cfg = self.cfg
        if isinstance(self.heads, MTPModule):           # trees are what the sweep varies; the module draws its own
            print("sweep: skipped for the MTP module (its tree is drawn every step; the sweep varies the trees of "
                  "MTP heads)", file=sys.stderr)
            return
        names = list(cfg.sweep_trees or sweep_tree_names(self.heads.num_heads, self.heads.tree is not None))
        trees = [("serial", Tree.root_only())] + [(n, pick_tree(n, self.heads, self.heads_dir, self.model,
                                                                   cfg.kernels)) for n in names]
        reqs = [(f"{name}/{its[0]['id']}", *self.prompt(its[0], cfg.sweep_tokens)[:2])
                for name, its in list(scenarios.items())[:cfg.sweep_prompts]]
        bar = _bar(len(reqs) * len(trees), "sweep", cfg)
        serial = {}                                                   # label -> serial tokens, the T = 0 reference
        for name, tree in trees:
            for label, ids, m in reqs:
                if not self.reuse("sweep", dict(sweep_tree=name, item=label)):
                    self.warm_up(scenarios)
                    r = self.run(ids, m, False) if tree.size == 1 else self.run(ids, m, True, tree=tree)
                    same = None
                    if tree.size == 1:
                        serial[label] = r.tokens[0]
                    elif cfg.temperature == 0:
                        if label not in serial:                       # its serial row was kept (--resume): rerun
                            serial[label] = self.run(ids, m, False).tokens[0]
                        same = self.same("quality", f"sweep {name}", serial[label], r.tokens[0], ids)
                    self.record([dict(self.base, section="sweep", sweep_tree=name, item=label, sweep_size=tree.size,
                                      sweep_depth=tree.max_depth, sweep_top_k=tree.top_k,
                                      mode="off" if tree.size == 1 else "on", identical=same,
                                      **request_metrics(r.stats, tree.size))])
                bar.update(1)
        bar.close()

    # ---- long-run stability ----
    def long_run(self, scenarios, total_tokens):
        cfg = self.cfg
        reqs = [(f"{name}/{it['id']}", *self.prompt(it, min(it["max_new_tokens"], cfg.long_request_tokens))[:2])
                for name, its in scenarios.items() for it in its]
        bar = _bar(total_tokens, "long run", cfg, unit="tok")
        done, i, mine = 0, 0, []
        while done < total_tokens:
            label, ids, m = reqs[i % len(reqs)]
            kept = self.reuse("long_run", dict(request=i, item=label))
            if kept:
                n = int(num(kept[0].get("new_tokens")) or 0) if not kept[0]["error"] else 0
            else:
                self.warm_up(scenarios)
                row, n = self._long_request(i, label, ids, m)
                self.record([row])
                mine.append(row)
            done, i = done + max(n, 1), i + 1
            bar.update(max(n, 1))
        bar.close()
        if self.reuse("long_summary", dict(long_run_tokens=total_tokens)):
            return
        summary = long_run_summary(section_rows(self.rows, "long_run"), self.model.device, memory_rows=mine)
        self.record([dict(self.base, section="long_summary", long_run_tokens=total_tokens, **summary)])
        if summary["memory_growth_flag"]:
            self.fail("long-run", f"memory grew by {summary['memory_growth_bytes'] / 2**20:.1f} MiB after warm-up")

    def _long_request(self, i, label, ids, m, check_every=10):
        """One long-run request: (row, new tokens). Errors and timeouts are counted and reported; the run goes on."""
        cfg = self.cfg
        t0 = time.perf_counter()
        row = dict(self.base, section="long_run", request=i, item=label, error="", timeout=False, spot_check="")
        try:
            r = self.run(ids, m, True, seed=cfg.seed + i)
            row.update(request_metrics(r.stats, r.stats.tree_size))
            n = r.stats.new_tokens
            if cfg.temperature == 0 and i % check_every == 0:
                ser = self.run(ids, m, False).tokens[0]
                row["spot_check"] = "match" if ser == r.tokens[0] else "MISMATCH"
                self.same("long-run", f"request {i}", ser, r.tokens[0], ids)
        except Exception as e:
            row["error"], n = f"{type(e).__name__}: {e}", 0
            self.fail("long-run", f"request {i}: {row['error']}")
        row.update(request_s=time.perf_counter() - t0 if not row.get("e2e_s") else row["e2e_s"],
                   memory_bytes=current_memory(self.model.device))
        row["timeout"] = row["request_s"] > cfg.timeout_s
        if row["timeout"]:
            self.fail("long-run", f"request {i} took {row['request_s']:.1f}s > timeout {cfg.timeout_s}s")
        return row, n

    # ---- bad and edge inputs (always at temperature 0, so outputs can be checked exactly) ----
    def edge(self, scenarios):
        if self.reuse("edge"):
            return
        self.warm_up(scenarios)
        tok, ctx, V, m, limit_new = self.tok, self.ctx, self.model.config.vocab_size, 8, self.cfg.edge_limit_tokens
        first = next(iter(scenarios.values()))[0]
        normal, _, _ = self.prompt(first, m, self.cfg.prompt_cap or 256)
        before = self.run(normal, m, True, temperature=0.0).tokens
        text_ids = tok(item_text(first))["input_ids"] or [1]
        long_ids = text_ids * (ctx // len(text_ids) + 2)                  # more than ctx + 10 tokens
        odd = "# 🐍 naïve café — ∑ λ 中文 \x00 NUL, RTL: مرحبا بالعالم שלום, e\u0301, tab\t, CRLF\r\n"
        first_tok = self.run(normal, 1, False, temperature=0.0).tokens[0][0]
        full = self.cfg.edge_full_context
        if full is None:                      # a prefill of the whole context: minutes on a CPU for a long context
            full = self.model.device.type == "cuda" or ctx <= FULL_CONTEXT_CPU
        cases = [  # (case, prompt ids or text, max_new, expect 'error', 'output' or 'skipped', extra kwargs)
            ("empty input", "", m, "error", {}),
            ("over-long context (context + 10 tokens)", long_ids[:ctx + 10], m, "error", {}),
            (f"context at the limit (context - {limit_new} tokens)", long_ids[:ctx - limit_new], limit_new,
             "output" if full else "skipped", {}),
            (f"repeated input (one token x {min(200, ctx - 2 * m)})", [text_ids[0]] * min(200, ctx - 2 * m), m,
             "output", {}),
            ("unusual characters (emoji, NUL, RTL, combining)", odd, m, "output", {}),
            ("max_new_tokens = 1", normal, 1, "output", {}),
            ("max_new_tokens = 0", normal, 0, "error", {}),
            ("EOS as the first token (stop id = the model's first choice)", normal, m, "output",
             {"eos": first_tok}),
            ("EOS token as the whole input", [self.eos if self.eos is not None else 0], m, "output", {}),
            ("token id out of range (= vocab size)", [1, 2, V], m, "error", {}),
        ]
        rows = []
        for case, prompt, mx, expect, kw in cases:
            row = dict(self.base, section="edge", case=case, expect=expect, outcome="", detail="", ok=False)
            if expect == "skipped":
                rows.append(dict(row, ok=True, outcome="not run", detail=f"a {len(prompt)}-token prefill on CPU "
                                 f"(context {ctx} > {FULL_CONTEXT_CPU}); EvalConfig(edge_full_context=True) or "
                                 "--edge-full-context runs it"))
                continue
            ids = tok(prompt)["input_ids"] if isinstance(prompt, str) else prompt
            back = tok.decode(ids) if isinstance(prompt, str) and prompt else prompt
            if back != prompt:
                row["detail"] = f"tokenizer round trip changed the text: {back!r}"
            try:
                ser = self.run(ids, mx, False, temperature=0.0, **kw).tokens[0]
                mtp = self.run(ids, mx, True, temperature=0.0, **kw).tokens[0]
                row["outcome"] = f"{len(mtp)} tokens, MTP {'==' if ser == mtp else '!='} serial"
                ok = ser == mtp and 1 <= len(mtp) <= mx and ("eos" not in kw or mtp == [kw["eos"]])
                if ser != mtp:
                    row["detail"] += describe_mismatch(tok, case, ser, mtp, ids)
                tok.decode(mtp)                                              # decoding the output must not fail
                row["ok"] = expect == "output" and ok and not row["detail"]
            except ValueError as e:
                row["outcome"], row["detail"], row["ok"] = "ValueError", str(e)[:200], expect == "error"
            except Exception as e:                                           # anything else is a failure
                row["outcome"], row["detail"] = type(e).__name__, str(e)[:200]
            if not row["ok"]:
                self.fail("edge", f"{case}: expected {expect}, got {row['outcome']} {row['detail']}")
            rows.append(row)
        after = self.run(normal, m, True, temperature=0.0).tokens
        ok = after == before == self.run(normal, m, False, temperature=0.0).tokens
        rows.append(dict(self.base, section="edge", case="normal request after the bad inputs", expect="output",
                         outcome=f"{len(after[0])} tokens, {'same as before and as serial' if ok else 'CHANGED'}",
                         detail="", ok=ok))
        if not ok:
            self.fail("edge", "a normal request after the edge cases no longer matches its earlier output / serial")
        self.record(rows)

    # ---- compatibility: batch vs single requests ----
    def compat(self, scenarios):
        if self.reuse("compat"):
            return
        self.warm_up(scenarios)
        items = [it for its in scenarios.values() for it in its][:4]
        m = min(16, self.cfg.max_new_cap or 16)
        reqs = [self.prompt(it, m, self.cfg.prompt_cap or 256)[0] for it in items]
        reqs = [r[: max(8, len(r) - 7 * k)] for k, r in enumerate(reqs)]           # different lengths on purpose
        single = [self.run(r, m, False, temperature=0.0).tokens[0] for r in reqs]
        batch = self.run(reqs, m, True, temperature=0.0, batch=True).tokens
        ok = batch == single
        self.record([dict(self.base, section="compat", case=f"batch of {len(reqs)} (MTP) vs single requests (serial)",
                          batch=len(reqs), ok=ok, detail="" if ok else "outputs differ")])
        if not ok:
            b = next(i for i in range(len(reqs)) if batch[i] != single[i])
            self.same("compat", f"batch row {b}", single[b], batch[b], reqs[b])
