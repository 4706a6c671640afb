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
`run_prompt` runs every configuration on one prompt (or one batch of prompts), one after the other, so a slow spell
of a noisy machine hits all of them alike, and returns one row per configuration: the sequences, the tokens' count,
the sequence-steps (steps × live sequences; the steps at batch 1), the decode seconds (the total minus the time to
the first token: prefill excluded for every configuration alike), acceptance per depth, the nodes verified per step,
the drafting and verify seconds, the kernels, the candidate tree's nodes (`tree_nodes`, 1 for serial; the demo's and
prune's base fields name their drafter's `tree_size`), the peak memory, the energy (GPU), the cost model, the roofline
fields (`roofline.roofline_fields`), and `identical_to_serial`: whether its tokens equal its reference
configuration's (`Config.reference`, default "serial"). `run_prompts` does that over a list of prompts in groups of
`batch`. The demo, `prune`, `e2e`, `tables`, `scripts/defaults_ab.py` and `scripts/drafters_ab.py` are each a list
of configurations, a loop over their prompts and a report of `summarise`.

Summary per configuration, over its rows (prompts, or groups of prompts):
    tok_s  = sum(decode tokens) / sum(decode seconds)                decode tokens = new tokens - 1 per sequence
    tau    = sum(decode tokens) / sum(steps)                         (None where steps are not reported: prompt-lookup)
    nodes  = sum(verified nodes per step * steps) / sum(steps)
    accept[d] = sum(acceptance at depth d * steps) / sum(steps)
    vs_serial, vs_peer = tok_s / the reference's and / the peer's tok_s; worst = min over prompts of the per-prompt
    ratio to the reference; draft_share = sum(draft seconds) / sum(decode seconds); ttft_s = mean time to the
    first token; tree_size = the first row's tree_nodes; peak_memory_bytes = max; energy_j = sum (None unless every
    row has it), tokens_per_j = sum(new tokens) / energy_j.
"""
import dataclasses
import json
from dataclasses import dataclass, field

from mtp_triton.generate import generate
from ..records import command_today, md_table
from .hf_baseline import time_hf
from .roofline import roofline_fields

SERIAL, PEER = "serial", "transformers generate"      # the default reference and peer configurations' names


@dataclass(frozen=True)
class Config:
    """One configuration: our generate(**kw), or (peer=True) transformers' greedy generate through
    time_hf(**kw). kw may also be a function (lo, hi) -> that dict for the prompts [lo, hi) of a `run_prompts` call
    (an oracle drafter proposing from those prompts' serial continuations). reference: the configuration whose
    tokens `identical_to_serial` compares with (None: the run's default). fields: extra row fields of this
    configuration."""
    name: str
    kw: object = field(default_factory=dict)
    peer: bool = False
    reference: str = None
    fields: dict = field(default_factory=dict)


def _peer_row(hf, batch, max_new, eos, cfg):
    if len(batch) != 1:
        raise ValueError(f"configuration {cfg.name!r} runs transformers one prompt at a time: use batch 1")
    h = time_hf(hf, batch, max_new, eos, warmup="none", **cfg.kw)
    one, nan = h["per_prompt"][0], float("nan")
    lookup = bool(cfg.kw.get("prompt_lookup"))              # prompt-lookup: its steps are not reported
    return h["tokens"], dict(sequences=1, new_tokens=one["new_tokens"], steps=nan if lookup else one["new_tokens"] - 1,
                             tokens_per_step=nan if lookup else 1.0, accept_rate_per_depth="[]",
                             verified_nodes_per_step=nan if lookup else 1, decode_s=one["decode_s"],
                             ttft_s=one["ttft_s"], decode_tokens_per_s=h["decode_tokens_per_s"], draft_s=0.0,
                             verify_s=nan, kernels=h["kernels"], tree_nodes=1, peak_memory_bytes=None,
                             energy_j=h["energy_j"], cost_model=None)


def _our_row(model, batch, max_new, eos, cfg):
    res = generate(model, batch, max_new, eos_token_id=eos, **cfg.kw)
    s, B = res.stats, len(batch)
    tau = s.tokens_per_step
    return res.tokens, dict(sequences=B, new_tokens=s.new_tokens,
                            steps=round((s.new_tokens - B) / tau) if B > 1 and tau == tau and tau > 0 else s.steps,
                            tokens_per_step=tau,
                            accept_rate_per_depth=json.dumps([round(x, 4) for x in s.accept_rate_per_depth]),
                            verified_nodes_per_step=s.verified_nodes_per_step, decode_s=s.total_s - s.ttft_s,
                            ttft_s=s.ttft_s, decode_tokens_per_s=s.decode_tokens_per_s, draft_s=s.time_draft_s,
                            verify_s=s.time_verify_s, kernels=s.kernels, tree_nodes=s.tree_size,
                            peak_memory_bytes=s.peak_memory_bytes, energy_j=s.energy_j, cost_model=s.cost_model)


def _batch(ids):
    """(prompts, one): a batch of prompts (a list of token-id lists) or one prompt, as a list of prompts."""
    one = not (ids and isinstance(ids[0], (list, tuple)))
    return ([list(ids)] if one else [list(p) for p in ids]), one


def resolved(configs, lo, hi):
    """The configurations with every function-valued kw called for the prompts [lo, hi)."""
    return [dataclasses.replace(c, kw=c.kw(lo, hi)) if callable(c.kw) else c for c in configs]


def run_prompt(model, ids, max_new, configs, *, hf=None, eos=None, reference=SERIAL, base=None):
    """Every configuration on one prompt (ids: token ids) or one batch (a list of them), in the given order.
    -> (rows, tokens): one row per configuration (dict(base, config=..., the fields of the module docstring)) and
    {config: its tokens} (a list of sequences for a batch). hf: the transformers twin (`hf_baseline.hf_twin`), needed
    by peer configurations."""
    batch, one = _batch(ids)
    rows, tokens = [], {}
    for cfg in resolved(configs, 0, len(batch)):
        if cfg.peer and hf is None:
            raise ValueError(f"configuration {cfg.name!r} runs transformers: pass hf=hf_twin(model)")
        got, row = (_peer_row(hf, batch, max_new, eos, cfg) if cfg.peer else _our_row(model, batch, max_new, eos, cfg))
        tokens[cfg.name] = got[0] if one else got
        rows.append(dict(base or {}, config=cfg.name, **cfg.fields, **row,
                         **roofline_fields(model, row["decode_tokens_per_s"], row["tokens_per_step"])))
    for cfg, row in zip(configs, rows):
        row["identical_to_serial"] = tokens[cfg.name] == tokens[cfg.reference or reference]
    return rows, tokens


def run_prompts(model, prompts, max_new, configs, *, batch=1, hf=None, eos=None, reference=SERIAL, base=None):
    """`run_prompt` over the prompts in groups of `batch` (prompt_id: the group's first prompt's index; a function
    kw is called with the group's [lo, hi)). -> (rows, {config: tokens of every prompt, in order})."""
    rows, tokens = [], {}
    for lo in range(0, len(prompts), batch):
        group = prompts[lo: lo + batch]
        got, tok = run_prompt(model, group, max_new, resolved(configs, lo, lo + len(group)), hf=hf, eos=eos,
                              reference=reference, base=dict(base or {}, prompt_id=lo))
        rows += got
        for name, seqs in tok.items():
            tokens.setdefault(name, []).extend(seqs)
    return rows, tokens


def warm_up(model, ids, configs, hf=None, eos=None, max_new=8):
    """Each configuration once on a short run of one prompt or batch, not recorded: compiles, the step-cost
    calibration, caches."""
    batch, _ = _batch(ids)
    for cfg in resolved(configs, 0, len(batch)):
        if cfg.peer:
            time_hf(hf, batch, max_new, eos, warmup="none", **cfg.kw)
        else:
            generate(model, batch, max_new, eos_token_id=eos, **cfg.kw)


def summarise(rows, reference=SERIAL, peer=PEER):
    """{config: dict(prompts, tok_s, vs_serial, vs_peer, worst, tau, nodes, accept, draft_share, identical, ttft_s,
    peak_memory_bytes, energy_j, tokens_per_j, tree_size, kernels)} over rows (typed, or strings read back from a
    CSV), configurations in the rows' order; the formulas are in the module docstring ("prompts" counts rows: groups
    of prompts at batch > 1). vs_serial / worst are None without the reference's rows, vs_peer without the peer's."""
    num = lambda r, k: float(r[k]) if r.get(k) not in (None, "") else float("nan")   # noqa: E731
    by = {}
    for r in rows:
        by.setdefault(r["config"], []).append(r)

    def decoded(sel):
        return sum(num(r, "new_tokens") - (num(r, "sequences") if r.get("sequences") not in (None, "") else 1)
                   for r in sel)

    def rate(sel):
        return decoded(sel) / max(sum(num(r, "decode_s") for r in sel), 1e-12)
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
        energy = (sum(num(r, "energy_j") for r in sel)
                  if all(r.get("energy_j") not in (None, "") for r in sel) else None)
        table[name] = dict(
            prompts=len(sel), tok_s=rate(sel),
            vs_serial=rate(sel) / rate(ref) if ref else None, vs_peer=rate(sel) / rate(by[peer]) if peer in by else
            None,
            worst=min((rate([r]) / rate(ref_by_prompt[r.get("prompt_id")]) for r in sel
                       if r.get("prompt_id") in ref_by_prompt), default=None) if ref else None,
            tau=decoded(sel) / steps if counted else None,
            nodes=sum(num(r, "verified_nodes_per_step") * num(r, "steps") for r in sel) / steps if counted else None,
            accept=accept, identical=sum(str(r["identical_to_serial"]) == "True" for r in sel),
            draft_share=(sum(num(r, "draft_s") for r in sel) / sum(num(r, "decode_s") for r in sel)
                         if all(r.get("draft_s") not in (None, "") for r in sel) else None),
            ttft_s=sum(num(r, "ttft_s") for r in sel) / len(sel),
            peak_memory_bytes=max((num(r, "peak_memory_bytes") for r in sel if r.get("peak_memory_bytes") not in
                                   (None, "")), default=None),
            energy_j=energy, tokens_per_j=sum(num(r, "new_tokens") for r in sel) / energy if energy else None,
            tree_size=sel[0].get("tree_nodes"), kernels=sel[0].get("kernels"))
    return table


def latest_runs(rows):
    """Per prompt set, the rows of its latest run (the commit of the set's last row), sets in their first order."""
    out = []
    for ps in dict.fromkeys(r["prompt_set"] for r in rows):
        mine = [r for r in rows if r["prompt_set"] == ps]
        out += [r for r in mine if r["commit"] == mine[-1]["commit"]]
    return out


def by_prompt_set(rows):
    """{prompt set: {configuration: summary}} of A/B rows (`summarise` per prompt set)."""
    return {ps: summarise([r for r in rows if r["prompt_set"] == ps])
            for ps in dict.fromkeys(r["prompt_set"] for r in rows)}


# the chat prompt sets the drafter A/B measures, by the name its rows carry (prompt_set)
PROMPT_SETS = {"dev_chat": "the tuning split (hand-written chat prompts, data/chat/dev_chat.jsonl)",
               "heldout_chat": "the held-out chat prompts (data/chat/heldout_chat.jsonl; never used for a choice)",
               "outside_chat": "chat prompts kept outside the repository, written before any result was seen"}


def decoding_section(rows, sets):
    """A drafter card's A/B section from its rows: the machine and commands, one table row per (prompt set,
    configuration), the prompt sets named by `sets`. -> (lines, {prompt set: {configuration: summary}})."""
    s0 = rows[0]
    cmds = {r["prompt_set"]: (command_today(r["command"]), r["commit"]) for r in rows}
    lines = [f"## Decoding, measured (greedy, batch 1, {s0['dtype']})", "",
             f"On {s0['device']}, {s0['threads']} threads, torch {s0['torch']}, {s0['max_new_tokens']} new tokens; "
             "every prompt runs every configuration in turn. Acceptance at depth d: the share of steps that accept at "
             "least d drafts. Commands (commit):", ""]
    lines += [f"- `{c}` ({k})" for c, k in cmds.values()] + [""]
    table, body = by_prompt_set(rows), []
    for ps, t in table.items():
        for c, s in t.items():
            mtp = c.startswith("mtp")
            body.append((f"{ps} ({s['prompts']})", c, f"{s['tok_s']:.1f}", f"{s['vs_serial']:.2f}×",
                         f"{s['vs_peer']:.2f}×", f"{s['tau']:.2f}",
                         " / ".join(f"{100 * a:.0f}" for a in s["accept"][:7]) + " %" if mtp else "–",
                         f"{s['nodes']:.1f}" if mtp else "–", f"{100 * s['draft_share']:.0f} %" if mtp else "–",
                         f"{s['identical']}/{s['prompts']}"))
    lines += [md_table(["prompts", "configuration", "decode tok/s", "vs our serial", "vs transformers", "τ",
                        "acceptance by depth", "nodes verified / step", "drafting share", "identical to serial"],
                       body), ""]
    return lines + [f"- {ps}: {sets.get(ps, ps)}" for ps in table] + [""], table


def goals_section(what, columns, checks):
    """A drafter card's goal table: columns [(prompt set, summary)], checks [(goal, fn(prompt set, summary) ->
    (text, met))]."""
    return [f"## Goals (the issue that asked for this {what})", "",
            md_table(["goal", *(ps for ps, _ in columns)],
                     [[name, *(f"{text} ({'met' if ok else 'not met'})" for text, ok in
                               (fn(ps, s) for ps, s in columns))] for name, fn in checks]), ""]
