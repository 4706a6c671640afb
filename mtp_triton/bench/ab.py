"""The one A/B core: named configurations over the same prompts, into one kind of row, and the one summary of them.

    configs = [Config("transformers generate", peer=True), Config("serial", dict(mtp=False)),
               Config("mtp", dict(heads=heads))]
    hf = hf_twin(model)                                          # transformers, holding the same weights
    warm_up(model, ids[0], configs, hf=hf, eos=eos)              # compiles, c(T) and caches: not timed
    rows = [r for p in ids for r in run_prompt(model, p, 64, configs, hf=hf, eos=eos)[0]]
    table = summarise(rows)                                      # {config: dict(tok_s, vs_serial, vs_peer, tau, ...)}

A configuration is our `generate` with keyword arguments (`kw`), or the peer (`peer=True`): transformers' greedy
`generate` on a twin holding the same weights, with `kw` for `hf_baseline.time_hf` (`prompt_lookup=n`: its
prompt-lookup decoding, the zero-training alternative; `compiled=True`: static cache and `torch.compile`).
`run_prompt` runs every configuration on one prompt, one after the other, so a slow spell of a noisy machine hits all
of them alike, and returns one row per configuration: the tokens' count, the steps, the decode seconds (the total
minus the time to the first token: prefill excluded for every configuration alike), acceptance per depth, the nodes
verified per step, the drafting and verify seconds, the kernels, the cost model, the roofline fields
(`roofline.roofline_fields`), and `identical_to_serial`: whether its tokens equal its reference configuration's
(`Config.reference`, default "serial"). The demo, `prune`, `scripts/defaults_ab.py` and `scripts/drafters_ab.py` are
each a list of configurations, a loop over their prompts and a report of `summarise`.

Summary per configuration, over its rows (prompts):
    tok_s  = sum(decode tokens) / sum(decode seconds)                decode tokens = new tokens - 1 (the prefill's)
    tau    = sum(decode tokens) / sum(steps)                         (None where steps are not reported: prompt-lookup)
    nodes  = sum(verified nodes per step * steps) / sum(steps)
    accept[d] = sum(acceptance at depth d * steps) / sum(steps)
    vs_serial, vs_peer = tok_s / the reference's and / the peer's tok_s; worst = min over prompts of the per-prompt
    ratio to the reference; draft_share = sum(draft seconds) / sum(decode seconds).
"""
import json
from dataclasses import dataclass, field

from ..generate import generate
from .hf_baseline import time_hf
from .roofline import roofline_fields

SERIAL, PEER = "serial", "transformers generate"      # the default reference and peer configurations' names


@dataclass(frozen=True)
class Config:
    """One configuration: our generate(**kw), or (peer=True) transformers' greedy generate through
    time_hf(**kw). reference: the configuration whose tokens `identical_to_serial` compares with (None: the run's
    default). fields: extra row fields of this configuration."""
    name: str
    kw: dict = field(default_factory=dict)
    peer: bool = False
    reference: str = None
    fields: dict = field(default_factory=dict)


def _peer_row(hf, ids, max_new, eos, cfg):
    h = time_hf(hf, [ids], max_new, eos, warmup="none", **cfg.kw)
    one, nan = h["per_prompt"][0], float("nan")
    lookup = bool(cfg.kw.get("prompt_lookup"))              # prompt-lookup: its steps are not reported
    return h["tokens"][0], dict(new_tokens=one["new_tokens"], steps=nan if lookup else one["new_tokens"] - 1,
                                tokens_per_step=nan if lookup else 1.0, accept_rate_per_depth="[]",
                                verified_nodes_per_step=nan if lookup else 1, decode_s=one["decode_s"],
                                ttft_s=one["ttft_s"], decode_tokens_per_s=h["decode_tokens_per_s"], draft_s=0.0,
                                verify_s=nan, kernels=h["kernels"], cost_model=None)


def _our_row(model, ids, max_new, eos, cfg):
    res = generate(model, [ids], max_new, eos_token_id=eos, **cfg.kw)
    s = res.stats
    return res.tokens[0], dict(new_tokens=s.new_tokens, steps=s.steps, tokens_per_step=s.tokens_per_step,
                               accept_rate_per_depth=json.dumps([round(x, 4) for x in s.accept_rate_per_depth]),
                               verified_nodes_per_step=s.verified_nodes_per_step, decode_s=s.total_s - s.ttft_s,
                               ttft_s=s.ttft_s, decode_tokens_per_s=s.decode_tokens_per_s, draft_s=s.time_draft_s,
                               verify_s=s.time_verify_s, kernels=s.kernels, cost_model=s.cost_model)


def run_prompt(model, ids, max_new, configs, *, hf=None, eos=None, reference=SERIAL, base=None):
    """Every configuration on one prompt (ids: token ids), in the given order. -> (rows, tokens): one row per
    configuration (dict(base, config=..., the fields of the module docstring)) and {config: tokens}. hf: the
    transformers twin (`hf_baseline.hf_twin`), needed by peer configurations."""
    rows, tokens = [], {}
    for cfg in configs:
        if cfg.peer and hf is None:
            raise ValueError(f"configuration {cfg.name!r} runs transformers: pass hf=hf_twin(model)")
        tokens[cfg.name], row = (_peer_row(hf, ids, max_new, eos, cfg) if cfg.peer
                                 else _our_row(model, ids, max_new, eos, cfg))
        rows.append(dict(base or {}, config=cfg.name, **cfg.fields, **row,
                         **roofline_fields(model, row["decode_tokens_per_s"], row["tokens_per_step"])))
    for cfg, row in zip(configs, rows):
        row["identical_to_serial"] = tokens[cfg.name] == tokens[cfg.reference or reference]
    return rows, tokens


def warm_up(model, ids, configs, hf=None, eos=None, max_new=8):
    """Each configuration once on a short run, not recorded: compiles, the step-cost calibration, caches."""
    for cfg in configs:
        if cfg.peer:
            time_hf(hf, [ids], max_new, eos, warmup="none", **cfg.kw)
        else:
            generate(model, [ids], max_new, eos_token_id=eos, **cfg.kw)


def summarise(rows, reference=SERIAL, peer=PEER):
    """{config: dict(prompts, tok_s, vs_serial, vs_peer, worst, tau, nodes, accept, draft_share, identical)} over
    rows (typed, or strings read back from a CSV), configurations in the rows' order; the formulas are in the module
    docstring. vs_serial / worst are None without the reference's rows, vs_peer without the peer's."""
    num = lambda r, k: float(r[k]) if r.get(k) not in (None, "") else float("nan")   # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)

    def rate(sel):
        return sum(num(r, "new_tokens") - 1 for r in sel) / max(sum(num(r, "decode_s") for r in sel), 1e-12)
    ref = by.get(reference)
    ref_by_prompt = {r.get("prompt_id"): [r] for r in ref or []}
    table = {}
    for name, sel in by.items():
        steps = sum(num(r, "steps") for r in sel)
        counted = steps == steps and steps > 0                       # nan: steps not reported (prompt-lookup)
        w = [num(r, "steps") for r in sel]
        rates = [json.loads(r.get("accept_rate_per_depth") or "[]") for r in sel]
        accept = [sum(wi * (x[d] if d < len(x) else 0) for wi, x in zip(w, rates)) / steps
                  for d in range(max(map(len, rates), default=0))] if counted else []
        table[name] = dict(
            prompts=len(sel), tok_s=rate(sel),
            vs_serial=rate(sel) / rate(ref) if ref else None, vs_peer=rate(sel) / rate(by[peer]) if peer in by else
            None,
            worst=min((rate([r]) / rate(ref_by_prompt[r.get("prompt_id")]) for r in sel
                       if r.get("prompt_id") in ref_by_prompt), default=None) if ref else None,
            tau=sum(num(r, "new_tokens") - 1 for r in sel) / steps if counted else None,
            nodes=sum(num(r, "verified_nodes_per_step") * num(r, "steps") for r in sel) / steps if counted else None,
            accept=accept, identical=sum(str(r["identical_to_serial"]) == "True" for r in sel),
            draft_share=(sum(num(r, "draft_s") for r in sel) / sum(num(r, "decode_s") for r in sel)
                         if all(r.get("draft_s") not in (None, "") for r in sel) else None))
    return table
