"""Decode tokens/s of the engine's serial and MTP paths for one or more checkouts, interleaved in one run.

    python scripts/engine_overhead.py --checkout /path/to/old --checkout . --rounds 5

Each round runs every checkout once, in a fresh subprocess (so imports do not mix), on the same prompts of the tiny
embedded model (CPU, torch path, batch 1): serial, then MTP with the heads' medusa-16 tree. Interleaving rounds
spreads machine noise evenly; the best (least disturbed) and median round per checkout are printed as a markdown
table. Used to check that a refactor of the decoding loop does not add per-step overhead.
"""
import json
import os
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mtp_lab.cli import command_parser, int_at_least  # noqa: E402

CHILD = r"""
import json, os, sys, time
import torch
torch.set_num_threads(int(os.environ.get("THREADS", "1")))
import mtp_triton as mt
root = sys.argv[1]
model = mt.load_model(os.path.join(root, "data", "tiny-stdlib-llama"), device="cpu")
heads = mt.load_heads(os.path.join(root, "data", "tiny-stdlib-llama", "heads"))
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(os.path.join(root, "data", "tiny-stdlib-llama"))
texts = [json.loads(l)["text"] for l in open(os.path.join(root, "data", "prompts", "thirdparty_code.jsonl"))][:3]
prompts = [tok(t)["input_ids"][-200:] for t in texts]
N = int(os.environ.get("NEW_TOKENS", "96"))
def stat(res, name):
    s = res.stats
    return s[name] if isinstance(s, dict) else getattr(s, name)
mt.generate(model, prompts[:1], 8, heads=heads, tree="medusa-16")          # warm-up
out = {}
for mode, kw in (("serial", dict(mtp=False)), ("mtp", dict(heads=heads, tree="medusa-16"))):
    rates, steps = [], 0
    for p in prompts:
        res = mt.generate(model, [p], N, **kw)
        rates.append(stat(res, "decode_tokens_per_s"))
        steps += stat(res, "steps")
    out[mode] = dict(tok_s=sum(rates) / len(rates), steps=steps)
print("RESULT " + json.dumps(out))
"""


def run(checkout, env):
    r = subprocess.run([sys.executable, "-c", CHILD, os.path.abspath(checkout)], cwd=checkout, env=env,
                       capture_output=True, text=True, timeout=1800)
    line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
    if r.returncode != 0 or not line:
        raise RuntimeError(f"{checkout}: {r.stderr[-2000:]}")
    return json.loads(line[-1][len("RESULT "):])


def main(argv=None):
    ap = command_parser("python scripts/engine_overhead.py", __doc__, "threads", threads=1)
    ap.add_argument("--checkout", action="append", required=True, help="a checkout of this repository (repeat)")
    ap.add_argument("--rounds", type=int_at_least(1), default=5)
    ap.add_argument("--new-tokens", type=int_at_least(1), default=96)
    a = ap.parse_args(argv)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(THREADS=str(a.threads), NEW_TOKENS=str(a.new_tokens), OMP_NUM_THREADS=str(a.threads))
    rows = {c: [] for c in a.checkout}
    for i in range(a.rounds):
        for c in a.checkout:
            rows[c].append(run(c, dict(env, PYTHONPATH=os.path.abspath(c))))
            print(f"round {i + 1}: {c}: {rows[c][-1]}", file=sys.stderr)
    print(f"{a.rounds} rounds, {a.threads} thread(s), {a.new_tokens} new tokens x 3 prompts, batch 1")
    print("| checkout | serial decode tok/s: best / median | MTP medusa-16 decode tok/s: best / median | steps serial / MTP |")
    print("|---|---|---|---|")
    for c, rs in rows.items():
        ser = [r["serial"]["tok_s"] for r in rs]
        mtp = [r["mtp"]["tok_s"] for r in rs]
        print(f"| {c} | {max(ser):.1f} / {statistics.median(ser):.1f} | {max(mtp):.1f} / {statistics.median(mtp):.1f} | "
              f"{rs[0]['serial']['steps']} / {rs[0]['mtp']['steps']} |")


if __name__ == "__main__":
    main()
