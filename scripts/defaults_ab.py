"""The library's defaults, A/B: serial vs MTP vs transformers in fp32 and bf16, one interleaved run.

    python scripts/defaults_ab.py --out results/cpu/defaults [--prompts 6] [--max-new-tokens 64]

What a user gets with every default: `load_model("smollm2-135m-instruct")` (the checkpoint's dtype: fp32 from the
GGUF) or with dtype=bfloat16, `load_heads(<shipped heads>)`, then `generate(model, [ids], N, heads=heads)` (MTP,
the heads' stored tree, each step sized by this machine's measured step costs), against `mtp=False` (our serial),
against the same call with `RuntimeConfig(size_by_cost=False)` (the whole tree every step: the behaviour before the
cost model), and against transformers' greedy `generate` on the same weights and dtype, plain and with prompt-lookup
decoding (`prompt_lookup_num_tokens=10`: the zero-training alternative; its steps are not reported, so no τ), and
against serial and MTP with the opt-in compiled step (`kernels="compiled"`; compiling happens in the warm-up, before
the timed runs; its MTP rows count outputs identical to the compiled serial's). Each prompt runs every
configuration in turn (so a slow spell of the machine hits all alike). Held-out chat prompts, the first of each
category. Writes <out>/defaults.csv (one row per prompt, dtype and configuration, with the roofline fields) and
prints the summary table (decode tokens / decode seconds over the prompts).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_triton as mt  # noqa: E402
from mtp_triton.bench.common import append_rows, env_info  # noqa: E402
from mtp_triton.records import md_table  # noqa: E402
from mtp_triton.bench.hf_baseline import PROMPT_LOOKUP, hf_twin, time_hf  # noqa: E402
from mtp_triton.bench.roofline import roofline_fields  # noqa: E402
from mtp_triton.bundle import CHAT_PROMPTS, HEADS, SMOLLM2, encode, pick_prompts, read_prompts  # noqa: E402


CONFIGS = ("transformers generate", "transformers prompt-lookup", "serial", "mtp (defaults)", "mtp, whole tree",
           "serial, compiled", "mtp (defaults), compiled")


def _serial_of(config):
    """The serial configuration an MTP configuration's output is compared with (the same kind of kernels)."""
    return "serial, compiled" if config.startswith("mtp") and config.endswith(", compiled") else "serial"


def summary_lines(rows):
    """The markdown table of defaults.csv rows (dicts; CSV strings or numbers): per dtype and configuration, decode
    tokens / decode seconds over the prompts, the ratios to our serial and to transformers, tau, nodes per step, how
    many outputs equal our serial's, and the worst single prompt against our serial."""
    num = lambda r, k: float(r[k])                                          # noqa: E731

    def rate(sel):
        return sum(num(r, "new_tokens") - 1 for r in sel) / sum(num(r, "decode_s") for r in sel)
    header = ["dtype", "configuration", "decode tok/s", "vs our serial", "vs transformers", "τ", "verified nodes/step",
              "identical to our serial", "worst prompt vs our serial"]
    body = []
    for name in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == name]
        by = {c: [r for r in mine if r["config"] == c] for c in CONFIGS}
        pids = list(dict.fromkeys(r["prompt_id"] for r in by["serial"]))
        for c in (c for c in CONFIGS if by[c]):                     # older runs lack prompt-lookup and compiled
            sel = by[c]
            worst = min(rate([r for r in sel if r["prompt_id"] == p]) /
                        rate([r for r in by["serial"] if r["prompt_id"] == p]) for p in pids)
            steps = sum(num(r, "steps") for r in sel)                     # nan: not counted (prompt-lookup)
            tau = f"{sum(num(r, 'new_tokens') - 1 for r in sel) / steps:.2f}" if steps == steps else "–"
            nodes = sum(num(r, "verified_nodes_per_step") for r in sel) / len(sel)
            nodes = f"{nodes:.1f}" if nodes == nodes else "–"
            same = sum(str(r["identical_to_serial"]) == "True" for r in sel)
            body.append((name, c, f"{rate(sel):.1f}", f"{rate(sel) / rate(by['serial']):.2f}×",
                         f"{rate(sel) / rate(by['transformers generate']):.2f}×", tau, nodes, f"{same}/{len(sel)}",
                         f"{worst:.2f}×"))
    return md_table(header, body).split("\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join("out", "defaults"))
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    a = ap.parse_args(argv)
    tok = mt.load_tokenizer(SMOLLM2)
    rows_in = pick_prompts(read_prompts(CHAT_PROMPTS), 1)[: a.prompts]
    ids = [encode(tok, r["text"]) for r in rows_in]
    eos, N = tok.eos_token_id, a.max_new_tokens
    cmd = "python scripts/defaults_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows, summary = [], {}
    for dtype in (None, torch.bfloat16):
        model = mt.load_model(SMOLLM2, dtype=dtype)
        heads = mt.load_heads(HEADS[SMOLLM2])
        hf = hf_twin(model)
        name = str(model.dtype).replace("torch.", "")
        configs = {"serial": dict(mtp=False), "mtp (defaults)": dict(heads=heads),
                   "mtp, whole tree": dict(heads=heads, runtime=mt.RuntimeConfig(size_by_cost=False)),
                   "serial, compiled": dict(mtp=False, kernels="compiled"),
                   "mtp (defaults), compiled": dict(heads=heads, kernels="compiled")}
        for kernels in ("auto", "compiled"):                        # warm-up (c(T); compiling), not timed
            mt.generate(model, [ids[0]], 8, heads=heads, kernels=kernels)
            mt.generate(model, [ids[0]], 8, mtp=False, kernels=kernels)
        time_hf(hf, [ids[0]], 8, eos)
        for r, p in zip(rows_in, ids):
            got = {}
            for cfg, kw in configs.items():
                res = mt.generate(model, [p], N, eos_token_id=eos, **kw)
                s = res.stats
                got[cfg] = res.tokens[0]
                rows.append(dict(env_info(model.device), dtype=name, threads=torch.get_num_threads(), config=cfg,
                                 category=r.get("category"), prompt_id=r.get("id"), new_tokens=s.new_tokens,
                                 steps=s.steps, tau=s.tokens_per_step, verified_nodes_per_step=s.verified_nodes_per_step,
                                 decode_s=s.total_s - s.ttft_s, decode_tokens_per_s=s.decode_tokens_per_s,
                                 draft_s=s.time_draft_s, verify_s=s.time_verify_s,
                                 cost_model=s.cost_model, kernels=s.kernels,
                                 identical_to_serial=res.tokens[0] == got[_serial_of(cfg)],
                                 command=cmd, **roofline_fields(model, s.decode_tokens_per_s, s.tokens_per_step)))
            for cfg, lookup in (("transformers generate", None), ("transformers prompt-lookup", PROMPT_LOOKUP)):
                h = time_hf(hf, [p], N, eos, warmup="none", prompt_lookup=lookup)
                one = h["per_prompt"][0]
                steps = one["new_tokens"] - 1 if lookup is None else float("nan")   # prompt-lookup: not reported
                rows.append(dict(env_info(model.device), dtype=name, threads=torch.get_num_threads(),
                                 config=cfg, category=r.get("category"), prompt_id=r.get("id"),
                                 new_tokens=one["new_tokens"], steps=steps, tau=1.0 if lookup is None else steps,
                                 verified_nodes_per_step=1 if lookup is None else float("nan"),
                                 decode_s=one["decode_s"], decode_tokens_per_s=h["decode_tokens_per_s"],
                                 cost_model=None, identical_to_serial=h["tokens"][0] == got["serial"], command=cmd,
                                 **roofline_fields(model, h["decode_tokens_per_s"])))
        del model, hf
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "defaults.csv"), rows)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {a.out}/defaults.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
