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
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_lab.bench.ab import Config, run_prompt, summarise, warm_up  # noqa: E402
from mtp_lab.bench.common import append_rows, env_info  # noqa: E402
from mtp_lab.cli import add_common, command_parser  # noqa: E402
from mtp_lab.records import md_table  # noqa: E402
from mtp_lab.bench.hf_baseline import hf_twin  # noqa: E402
from mtp_lab.bundle import SMOLLM2, encode, load_bundle, pick_prompts, read_prompts  # noqa: E402

CONFIGS = ("transformers generate", "serial", "mtp: heads", "mtp: module")


def summary_lines(rows):
    """Markdown table of drafters.csv rows, per prompt set and configuration (`bench.ab.summarise`: decode tokens /
    decode seconds, acceptance and nodes weighted by steps)."""
    header = ["prompts", "configuration", "decode tok/s", "vs our serial", "vs transformers", "τ",
              "acceptance d1 / d2 / d3 / d4 / d5 / d6", "verified nodes/step", "drafting share of step",
              "identical to our serial"]
    body = []
    for ps in dict.fromkeys(r["prompt_set"] for r in rows):
        table = summarise([r for r in rows if r["prompt_set"] == ps])
        for c in (c for c in CONFIGS if c in table):
            s = table[c]
            mtp = c.startswith("mtp")
            body.append((ps, c, f"{s['tok_s']:.1f}", f"{s['vs_serial']:.2f}×", f"{s['vs_peer']:.2f}×",
                         f"{s['tau']:.2f}", " / ".join(f"{x:.0%}" for x in s["accept"][:6]) if mtp else "–",
                         f"{s['nodes']:.1f}" if mtp else "–", f"{s['draft_share']:.0%}" if mtp else "–",
                         f"{s['identical']}/{s['prompts']}"))
    return md_table(header, body).split("\n")


def main(argv=None):
    ap = command_parser("python scripts/drafters_ab.py", __doc__)
    ap.add_argument("--prompts", required=True, help="a chat prompts JSONL (id, category, text)")
    add_common(ap, "per-category", "max-new-tokens", "out", max_new_tokens=128, out=os.path.join("out", "drafters"))
    a = ap.parse_args(argv)
    model, heads, tok = load_bundle(SMOLLM2, drafter="medusa")
    module = load_bundle(SMOLLM2, drafter="mtp")[1]
    hf = hf_twin(model)
    rows_in = pick_prompts(read_prompts(a.prompts), a.per_category)
    ids = [encode(tok, r["text"]) for r in rows_in]
    eos, N = tok.eos_token_id, a.max_new_tokens
    name = os.path.basename(a.prompts).rsplit(".", 1)[0]
    cmd = "python scripts/drafters_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    configs = [Config("serial", dict(mtp=False)), Config("mtp: heads", dict(heads=heads)),
               Config("mtp: module", dict(heads=module)), Config("transformers generate", peer=True)]
    warm_up(model, ids[0], configs, hf=hf, eos=eos)                              # c(T): not timed
    env = dict(env_info(model.device), dtype=str(model.dtype).replace("torch.", ""),
               threads=torch.get_num_threads(), prompt_set=name, max_new_tokens=N, command=cmd)
    rows = []
    for i, (r, p) in enumerate(zip(rows_in, ids)):
        got = run_prompt(model, p, N, configs, hf=hf, eos=eos,
                         base=dict(env, category=r.get("category"), prompt_id=r.get("id")))[0]
        rows += got
        print(f"[{i + 1}/{len(ids)} {r.get('category')}] " + "  ".join(
            f"{x['config']}: {x['decode_tokens_per_s']:.1f} tok/s τ {x['tokens_per_step']:.2f}" for x in got),
            flush=True)
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "drafters.csv"), rows)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {a.out}/drafters.csv")
    return 0 if all(str(r["identical_to_serial"]) == "True" for r in rows if r["config"].startswith("mtp")) else 1


if __name__ == "__main__":
    sys.exit(main())
