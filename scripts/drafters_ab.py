"""The drafters, A/B: Medusa-style heads, the MTP module and EAGLE-3's drafter, against our serial and transformers.

    python scripts/drafters_ab.py --prompts data/chat/dev_chat.jsonl --per-category 2 --out results/cpu/drafters
    python scripts/drafters_ab.py --prompts data/chat/heldout_chat.jsonl --per-category 2 --out results/cpu/drafters

SmolLM2-135M-Instruct in the demo's dtype (bf16 where the CPU multiplies it natively, else fp32; --dtype to choose),
greedy, batch 1. Every prompt runs every configuration in turn (a slow spell of the machine hits all alike):
transformers' greedy `generate` on the same weights, our serial loop, MTP with the shipped heads, the shipped module
and an EAGLE-3 drafter folder (--eagle3, when it exists), each with its defaults (`generate(..., drafter=...)`).
Per configuration: decode tokens/s (decode tokens / decode seconds over the prompts), the ratios to
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
from mtp_lab.bundle import (DTYPES, SMOLLM2, command_dtype, encode, heads_dir_for, load_bundle,  # noqa: E402
                            pick_prompts, read_prompts)
from mtp_triton import load_drafter  # noqa: E402

CONFIGS = ("transformers generate", "serial", "mtp: heads", "mtp: module", "mtp: eagle-3")
EAGLE3 = os.path.join("data", "smollm2-135m-instruct-eagle3")


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
    ap.add_argument("--eagle3", default=EAGLE3,
                    help="an EAGLE-3 drafter folder ('' or a folder without weights: left out)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="default: bf16 where this CPU multiplies it natively, else fp32")
    add_common(ap, "per-category", "max-new-tokens", "out", max_new_tokens=128, out=os.path.join("out", "drafters"))
    a = ap.parse_args(argv)
    dtype, why = command_dtype(a.dtype, SMOLLM2)
    print(f"dtype: {dtype} ({why})", flush=True)
    model, heads, tok = load_bundle(SMOLLM2, drafter="medusa", dtype=dtype)
    module = load_drafter(heads_dir_for(SMOLLM2, "mtp"), model.device, model.dtype)
    has_eagle3 = a.eagle3 and os.path.exists(os.path.join(a.eagle3, "config.json")) and any(
        os.path.exists(os.path.join(a.eagle3, f)) for f in ("model.safetensors", "pytorch_model.bin"))
    eagle3 = load_drafter(a.eagle3, model.device, model.dtype) if has_eagle3 else None
    hf = hf_twin(model)
    rows_in = pick_prompts(read_prompts(a.prompts), a.per_category)
    ids = [encode(tok, r["text"]) for r in rows_in]
    eos, N = tok.eos_token_id, a.max_new_tokens
    name = os.path.basename(a.prompts).rsplit(".", 1)[0]
    cmd = "python scripts/drafters_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    configs = [Config("serial", dict(mtp=False)), Config("mtp: heads", dict(drafter=heads)),
               Config("mtp: module", dict(drafter=module))]
    configs += [Config("mtp: eagle-3", dict(drafter=eagle3))] if eagle3 is not None else []
    configs += [Config("transformers generate", peer=True)]
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
