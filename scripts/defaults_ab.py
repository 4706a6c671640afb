"""The library's defaults, A/B: serial vs MTP vs transformers in fp32 and bf16, one interleaved run.

    python scripts/defaults_ab.py --out results/cpu/defaults [--prompts 6] [--max-new-tokens 64]

What a user gets with every default: `load_model("smollm2-135m-instruct")` (the checkpoint's dtype: fp32 from the
GGUF) or with dtype=bfloat16, `load_heads(<shipped heads>)`, then `generate(model, [ids], N, heads=heads)` (MTP,
the heads' stored tree, each step sized by this machine's measured step costs), against `mtp=False` (our serial),
against the same call with `RuntimeConfig(size_by_cost=False)` (the whole tree every step: the behaviour before the
cost model), against serial and MTP with the opt-in compiled step (`kernels="compiled"`; its MTP rows count outputs
identical to the compiled serial's), and against transformers' greedy `generate` on the same weights and dtype:
plain, with prompt-lookup decoding (`prompt_lookup_num_tokens=10`: the zero-training alternative; its steps are not
reported, so no τ) and compiled (a static cache and `torch.compile` with inductor's freezing and cpp_wrapper:
`hf_baseline.compiled_kwargs`, the strongest peer on a CPU). Everything that compiles does so in the warm-up, before
the timed runs. Each prompt runs every configuration in turn (so a slow spell of the machine hits all alike).
Held-out chat prompts, the first of each category. Writes <out>/defaults.csv (one row per prompt, dtype and
configuration: the rows of `bench.ab`, with the roofline fields) and prints the summary table (decode tokens /
decode seconds over the prompts).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import mtp_triton as mt  # noqa: E402
from mtp_lab.bench.ab import Config, run_prompt, summarise, warm_up  # noqa: E402
from mtp_lab.bench.common import append_rows, env_info  # noqa: E402
from mtp_lab.cli import command_parser, int_at_least  # noqa: E402
from mtp_lab.records import md_table  # noqa: E402
from mtp_lab.bench.hf_baseline import PROMPT_LOOKUP, hf_twin  # noqa: E402
from mtp_lab.bundle import CHAT_PROMPTS, HEADS, SMOLLM2, encode, pick_prompts, read_prompts  # noqa: E402


CONFIGS = ("transformers generate", "transformers prompt-lookup", "transformers compiled", "serial", "mtp (defaults)",
           "mtp, whole tree", "serial, compiled", "mtp (defaults), compiled")


def summary_lines(rows):
    """The markdown table of defaults.csv rows (dicts; CSV strings or numbers): per dtype and configuration, from
    `bench.ab.summarise`: decode tokens / decode seconds over the prompts, the ratios to our serial, to transformers
    and (where the run has it) to compiled transformers, tau, nodes per step, how many outputs equal their
    reference's (our serial, or the compiled serial for the compiled MTP row), and the worst single prompt against
    our serial."""
    hfc = "transformers compiled"
    peers = any(r["config"] == hfc for r in rows)                   # older runs lack it
    header = ["dtype", "configuration", "decode tok/s", "vs our serial", "vs transformers",
              *(["vs transformers compiled"] if peers else []), "τ", "verified nodes/step", "identical to our serial",
              "worst prompt vs our serial"]
    body = []
    for name in dict.fromkeys(r["dtype"] for r in rows):
        table = summarise([r for r in rows if r["dtype"] == name])
        for c in (c for c in CONFIGS if c in table):                # older runs lack prompt-lookup and compiled
            s = table[c]
            vs_hfc = [f"{s['tok_s'] / table[hfc]['tok_s']:.2f}×" if hfc in table else "–"] if peers else []
            body.append((name, c, f"{s['tok_s']:.1f}", f"{s['vs_serial']:.2f}×", f"{s['vs_peer']:.2f}×", *vs_hfc,
                         "–" if s["tau"] is None else f"{s['tau']:.2f}",
                         "–" if s["nodes"] is None else f"{s['nodes']:.1f}", f"{s['identical']}/{s['prompts']}",
                         f"{s['worst']:.2f}×"))
    return md_table(header, body).split("\n")


def main(argv=None):
    ap = command_parser("python scripts/defaults_ab.py", __doc__, "out", "max-new-tokens",
                        out=os.path.join("out", "defaults"), max_new_tokens=64)
    ap.add_argument("--prompts", type=int_at_least(1), default=6, help="prompts (the first of each category)")
    a = ap.parse_args(argv)
    tok = mt.load_tokenizer(SMOLLM2)
    rows_in = pick_prompts(read_prompts(CHAT_PROMPTS), 1)[: a.prompts]
    ids = [encode(tok, r["text"]) for r in rows_in]
    eos, N = tok.eos_token_id, a.max_new_tokens
    cmd = "python scripts/defaults_ab.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = []
    for dtype in (None, torch.bfloat16):
        model = mt.load_model(SMOLLM2, dtype=dtype)
        heads = mt.load_heads(HEADS[SMOLLM2])
        hf = hf_twin(model)
        compiled = "serial, compiled"
        configs = [Config("serial", dict(mtp=False)), Config("mtp (defaults)", dict(heads=heads)),
                   Config("mtp, whole tree", dict(heads=heads, runtime=mt.RuntimeConfig(size_by_cost=False))),
                   Config(compiled, dict(mtp=False, kernels="compiled")),
                   Config("mtp (defaults), compiled", dict(heads=heads, kernels="compiled"), reference=compiled),
                   Config("transformers generate", peer=True),
                   Config("transformers prompt-lookup", dict(prompt_lookup=PROMPT_LOOKUP), peer=True),
                   Config("transformers compiled", dict(compiled=True), peer=True)]
        warm_up(model, ids[0], configs, hf=hf, eos=eos)             # c(T), compiling: not timed
        base = dict(env_info(model.device), dtype=str(model.dtype).replace("torch.", ""),
                    threads=torch.get_num_threads(), command=cmd)
        for r, p in zip(rows_in, ids):
            rows += run_prompt(model, p, N, configs, hf=hf, eos=eos,
                               base=dict(base, category=r.get("category"), prompt_id=r.get("id")))[0]
        del model, hf
    os.makedirs(a.out, exist_ok=True)
    append_rows(os.path.join(a.out, "defaults.csv"), rows)
    print("\n".join(summary_lines(rows)))
    print(f"wrote {a.out}/defaults.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
