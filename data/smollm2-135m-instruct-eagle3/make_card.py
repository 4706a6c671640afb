"""Render README.md (the EAGLE-3 drafter's card) from config.json, records/ and the drafters A/B rows — no number
typed by hand.

    python data/smollm2-135m-instruct-eagle3/make_card.py
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from mtp_lab.bench.ab import PROMPT_SETS as SETS, decoding_section, goals_section, latest_runs, summarise  # noqa: E402
from mtp_lab.records import command_today, md_table, read_json, read_rows, write_text  # noqa: E402

AB = os.path.join(ROOT, "results", "cpu", "drafters-eagle3", "drafters.csv")
CURVE = os.path.join(HERE, "records", "train_eagle3_curve.csv")
OURS = "mtp: eagle-3"


def curve_table(rows, every=4):
    """Held-back accuracy by depth at the logged points that measured it (every `every`-th of them, and the last)."""
    pts = [r for r in rows if r.get("val_acc0") not in (None, "")]
    pts = [r for i, r in enumerate(pts) if i % every == 0 or i == len(pts) - 1]
    depths = sorted(int(k[len("val_acc"):]) for k in pts[0] if k.startswith("val_acc")) if pts else []
    return md_table(["step", "training minutes", "soft CE, depth 1 (nats)",
                     *(f"top-1 depth {d + 1}" for d in depths)],
                    [[r["step"], f"{float(r['elapsed_s']) / 60:.0f}", f"{float(r['val_ce0']):.2f}",
                      *(f"{100 * float(r[f'val_acc{d}']):.1f} %" for d in depths)] for r in pts])


def decoding(rows):
    """The A/B section: per prompt set and configuration, and per category for EAGLE-3; the goals."""
    lines, table = decoding_section(rows, SETS)
    cats, body = {}, []
    for ps in table:
        mine = [r for r in rows if r["prompt_set"] == ps]
        for cat in dict.fromkeys(r["category"] for r in mine):
            s = summarise([r for r in mine if r["category"] == cat])
            if OURS in s:
                cats.setdefault(ps, []).append((cat, s[OURS]))
                body.append((ps, cat, f"{s[OURS]['tau']:.2f}", f"{s[OURS]['vs_serial']:.2f}×"))
    if body:
        lines += ["Per category (EAGLE-3's drafter):", "",
                  md_table(["prompts", "category", "τ", "vs our serial"], body), ""]
    goal = [(ps, t[OURS]) for ps, t in table.items() if OURS in t]
    if goal:
        checks = [("τ ≥ 3.0 (≤ 32 nodes)", lambda ps, s: (f"{s['tau']:.2f}", s["tau"] >= 3.0)),
                  ("depth-1 acceptance ≥ 80 %",
                   lambda ps, s: (f"{100 * s['accept'][0]:.0f} %", s["accept"][0] >= 0.8)),
                  ("≥ 2.0× our serial, identical output", lambda ps, s: (
                      f"{s['vs_serial']:.2f}×, {s['identical']}/{s['prompts']}",
                      s["vs_serial"] >= 2.0 and s["identical"] == s["prompts"])),
                  ("every category ≥ 1.3× our serial", lambda ps, s: (
                      f"worst {min(c['vs_serial'] for _, c in cats[ps]):.2f}×",
                      min(c["vs_serial"] for _, c in cats[ps]) >= 1.3))]
        lines += goals_section("drafter", goal, checks)
    return lines


def _weights_line():
    """Whether the weights are in the repository (this folder's .gitignore keeps a run's weights out until shipped)."""
    ignore = os.path.join(HERE, ".gitignore")
    if os.path.exists(ignore) and "model.safetensors" in open(ignore).read().split():
        return ["- **Weights**: not committed (the folder's .gitignore): this drafter is not shipped, its held-back "
                "accuracy being far below the shipped MTP module's; they stay with the resumable checkpoint in "
                "`runs/eagle3/` on the machine that trained them, and the command above continues the run there."]
    return []


def main():
    cfg = json.load(open(os.path.join(HERE, "config.json")))
    info = read_json(os.path.join(HERE, "records", "train_eagle3.json"))
    c, d = info["config"], cfg["mtp_triton"]["draft"]
    lines = [
        "# EAGLE-3 drafter for SmolLM2-135M-Instruct", "",
        f"EAGLE-3's draft model (https://arxiv.org/abs/2503.01840): fc over the target's residual streams entering "
        f"layers {', '.join(map(str, info['taps']))} (a low, a middle and a high layer of its 30), one decoder block "
        f"of SmolLM2's family whose attention reads [RMSNorm(E x); RMSNorm(u)] ({cfg['num_attention_heads']} query "
        f"and {cfg['num_key_value_heads']} key/value heads, SwiGLU {cfg['intermediate_size']}), and its own LM head "
        f"over a draft vocabulary of {cfg['draft_vocab_size']} tokens (d2t/t2d); {info['params'] / 1e6:.2f} M "
        "parameters. Files in EAGLE-3's published format (config.json naming LlamaForCausalLMEagle3, "
        "model.safetensors with fc, midlayer.*, norm, lm_head, d2t, t2d), as vLLM and SGLang load it. Decoding draws "
        f"a dynamic tree every step: depth {d['depth']}, top-{d['top_k']} per expanded node, {d['beam']} nodes "
        f"expanded per depth, {d['nodes'] - 1} drafted nodes kept. Code: `mtp_triton/eagle3.py`, "
        "`mtp_triton/drafters_mtp.py`; training `mtp_lab/training/eagle3.py`.", "",
        "Every number below comes from `records/` (written by the training command), `config.json` and "
        "`results/cpu/drafters-eagle3/drafters.csv` (written by `scripts/drafters_ab.py`), rendered by "
        "`make_card.py`.", "",
        "## How it was made", "", "```", command_today(info["command"]), "```", "",
        f"- **Machine**: {info['device']}, {info['threads']} threads, torch {info['torch']}, commit {info['commit']}, "
        f"{info['timestamp']}; the target in {info['target_dtype'].replace('torch.', '')}.",
        f"- **Data** (self-distillation): the model's own answers in `data/smollm2-135m-instruct-answers` (its card "
        f"gives the prompts and the command): {info['train_answers']} answers ({info['answer_tokens']} answer "
        f"tokens) to train on when the run last started, {info['val_answers']} held-back greedy answers (by prompt "
        f"id); the curve and the accuracy below measure {info['val_measured']} of them.",
        f"- **Training**: frozen target; {info['steps']} steps of {c['batch']} sequences (≤ {c['max_len']} tokens), "
        f"AdamW lr {c['lr']}, warm-up then cosine over a {c['minutes']:.0f}-minute budget; training-time test "
        f"unrolled {c['unroll']} steps, weights 0.8^k; loss = soft cross-entropy against the target's next-token "
        "distribution over the draft vocabulary, at answer positions whose target choice is a draft token "
        "(EAGLE-3's mask); no feature-regression term.",
        f"- **Time**: {info['train_minutes']} min of training on this CPU (summed over resumed runs; held-back "
        "measurements included).", *_weights_line(), "",
        "## Learning curve (held-back greedy answers, teacher-forced)", "",
        "Top-1 of unroll step k = the answer's token given the k drafts before it were the answer's own: the chance "
        "that depth k + 1 of a chain is accepted once the depths above it were.", "",
        "![training curve](records/train_eagle3_curve.png)", ""]
    if os.path.exists(CURVE):
        lines += [curve_table(read_rows(CURVE)), ""]
    lines += ["Final, on the held-back answers measured:", "",
              md_table(["depth", *(str(k + 1) for k in range(len(info["val_accuracy_by_depth"])))],
                       [["top-1", *(f"{100 * a:.1f} %" for a in info["val_accuracy_by_depth"])]]), ""]
    rows = latest_runs(read_rows(AB)) if os.path.exists(AB) else []
    if rows:
        lines += decoding(rows)
    write_text(os.path.join(HERE, "README.md"), "\n".join(lines))
    print(f"wrote {os.path.join(HERE, 'README.md')}")


if __name__ == "__main__":
    main()
