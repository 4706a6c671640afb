"""The two drafter families, A/B: Medusa-style heads vs the MTP module, against our serial and transformers.

    python scripts/drafters_ab.py --prompts data/chat/dev_chat.jsonl --per-category 2 --out results/cpu/drafters
    python scripts/drafters_ab.py --prompts data/chat/heldout_chat.jsonl --per-category 2 --out results/cpu/drafters

SmolLM2-135M-Instruct as the demo loads it (bf16 on a CPU), greedy, batch 1. Every prompt runs every configuration
in turn (a slow spell of the machine hits all alike): transformers' greedy `generate` on the same weights, our
serial loop, MTP with the shipped heads and MTP with the shipped module, each with its defaults (`generate(...,
heads=...)`). Per configuration: decode tokens/s (decode tokens / decode seconds over the prompts), the ratios to
our serial and to transformers, τ, acceptance per depth (P(a step accepts >= d drafts)), verified nodes per step,
the share of a step's time spent drafting, and how many outputs equal our serial's. Writes <out>/drafters.csv (one
row per prompt and configuration) and prints the table.
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_triton.bench.common import append_rows, env_info  # noqa: E402
from mtp_triton.records import md_table  # noqa: E402
from mtp_triton.bench.hf_baseline import hf_twin, time_hf  # noqa: E402
from mtp_triton.bundle import SMOLLM2, encode, load_bundle, pick_prompts, read_prompts  # noqa: E402
from mtp_triton.generate import generate  # noqa: E402

CONFIGS = ("transformers generate", "serial", "mtp: heads", "mtp: module")


def summary_lines(rows):
    """Markdown table of drafters.csv rows, per prompt set and configuration (decode tokens / decode seconds)."""
    num = lambda r, k: float(r[k])                                          # noqa: E731
    rate = lambda sel: sum(num(r, "new_tokens") - 1 for r in sel) / sum(num(r, "decode_s") for r in sel)  # noqa
    header = ["prompts", "configuration", "decode tok/s", "vs our serial", "vs transformers", "τ",
              "acceptance d1 / d2 / d3 / d4 / d5 / d6", "verified nodes/step", "drafting share of step",
              "identical to our serial"]
    body = []
    for ps in dict.fromkeys(r["prompt_set"] for r in rows):
        mine = [r for r in rows if r["prompt_set"] == ps]
        by = {c: [r for r in mine if r["config"] == c] for c in CONFIGS}
        for c in (c for c in CONFIGS if by[c]):
            sel = by[c]
            steps = sum(num(r, "steps") for r in sel)
            tau = sum(num(r, "new_tokens") - 1 for r in sel) / steps
            acc, share, nodes = "–", "–", "–"
            if c.startswith("mtp"):
                rates = [json.loads(r["accept_rate_per_depth"]) for r in sel]
                w = [num(r, "steps") for r in sel]
                depth = max(len(x) for x in rates)
                acc = " / ".join(f"{sum(wi * (x[d] if d < len(x) else 0) for wi, x in zip(w, rates)) / sum(w):.0%}"
                                 for d in range(min(depth, 6)))
                share = f"{sum(num(r, 'draft_s') for r in sel) / sum(num(r, 'decode_s') for r in sel):.0%}"
                nodes = f"{sum(num(r, 'verified_nodes_per_step') * num(r, 'steps') for r in sel) / steps:.1f}"
            same = sum(str(r["identical_to_serial"]) == "True" for r in sel)
            body.append((ps, c, f"{rate(sel):.1f}", f"{rate(sel) / rate(by['serial']):.2f}×",
                         f"{rate(sel) / rate(by['transformers generate']):.2f}×", f"{tau:.2f}", acc, nodes, share,
                         f"{same}/{len(sel)}"))
    return md_table(header, body).split("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", required=True, help="a chat prompts JSONL (id, category, text)")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default=os.path.join("out", "drafters"))
    a = ap.parse_args(argv)
    model, heads, tok = load_bundle(SMOLLM2, drafter="medusa")
    module = load_bundle(SMOLLM2, drafter="mtp")[1]
    hf = hf_twin(model)
    rows_in = pick_prompts(read_prompts(a.prompts), a.per_category)
    ids = [encode(tok, r["text"]) for r in rows_in]
    eos, N = tok.eos_token_id, a.max_new_tokens
    name = os.path.basename(a.prompts).rsplit(".", 1)[0]
    cmd = "python scripts/drafters_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    configs = {"serial": dict(mtp=False), "mtp: heads": dict(heads=heads), "mtp: module": dict(heads=module)}
    for kw in configs.values():                                                  # warm-up (and c(T)), not timed
        generate(model, [ids[0]], 8, eos_token_id=eos, **kw)
    time_hf(hf, [ids[0]], 8, eos)
    env = dict(env_info(model.device), dtype=str(model.dtype).replace("torch.", ""),
               threads=torch.get_num_threads(), prompt_set=name, max_new_tokens=N, command=cmd)
    rows = []
    for i, (r, p) in enumerate(zip(rows_in, ids)):
        got = {}
        for cfg, kw in configs.items():
            res = generate(model, [p], N, eos_token_id=eos, **kw)
            s = res.stats
            got[cfg] = res.tokens[0]
            rows.append(dict(env, config=cfg, category=r.get("category"), prompt_id=r.get("id"),
                             new_tokens=s.new_tokens, steps=s.steps, tau=s.tokens_per_step,
                             accept_rate_per_depth=json.dumps([round(x, 4) for x in s.accept_rate_per_depth]),
                             verified_nodes_per_step=s.verified_nodes_per_step, decode_s=s.total_s - s.ttft_s,
                             decode_tokens_per_s=s.decode_tokens_per_s, draft_s=s.time_draft_s,
                             verify_s=s.time_verify_s, identical_to_serial=res.tokens[0] == got["serial"]))
        h = time_hf(hf, [p], N, eos, warmup="none")
        one = h["per_prompt"][0]
        rows.append(dict(env, config="transformers generate", category=r.get("category"), prompt_id=r.get("id"),
                         new_tokens=one["new_tokens"], steps=one["new_tokens"] - 1, tau=1.0,
                         accept_rate_per_depth="[]", verified_nodes_per_step=1, decode_s=one["decode_s"],
                         decode_tokens_per_s=h["decode_tokens_per_s"], draft_s=0.0, verify_s=float("nan"),
                         identical_to_serial=h["tokens"][0] == got["serial"]))
        print(f"[{i + 1}/{len(ids)} {r.get('category')}] " + "  ".join(
            f"{c}: {x['decode_tokens_per_s']:.1f} tok/s τ {x['tau']:.2f}" for c in CONFIGS
            for x in rows[-4:] if x["config"] == c), flush=True)
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "drafters.csv"), rows)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {a.out}/drafters.csv")
    return 0 if all(str(r["identical_to_serial"]) == "True" for r in rows if r["config"].startswith("mtp")) else 1


if __name__ == "__main__":
    sys.exit(main())
