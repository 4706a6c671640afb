"""Render README.md (the MTP module's card) from module.json, records/ and the drafters A/B rows — no number typed
by hand.

    python data/smollm2-135m-instruct-mtp/make_card.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, ROOT)

from mtp_lab.bench.ab import PROMPT_SETS, decoding_section, goals_section, latest_runs as latest  # noqa: E402
from mtp_lab.records import command_today, md_table, read_json, read_rows, write_text  # noqa: E402

AB = os.path.join(ROOT, "results", "cpu", "drafters", "drafters.csv")
SETS = dict(PROMPT_SETS, outside_chat=PROMPT_SETS["outside_chat"] + " (12 written, the first of each category run)")


def load(path):
    return read_json(os.path.join(HERE, path))


def ab_rows():
    return read_rows(AB) if os.path.exists(AB) else []


def main():
    meta, info = load("module.json"), load(os.path.join("records", "train_mtp.json"))
    cfg, d = meta["config"], meta["draft"]
    sec = info["seconds"]
    lines = [
        "# MTP module for SmolLM2-135M-Instruct", "",
        f"One decoder block of SmolLM2's own family (RMSNorm, RoPE attention with {cfg['num_attention_heads']} query "
        f"and {cfg['num_key_value_heads']} key/value heads, SwiGLU {cfg['intermediate_size']}) over "
        "fc([RMSNorm(E x_{m+1}); RMSNorm(h_m)]), the target's hidden state and the embedding of the next token, as "
        "DeepSeek-V3's MTP module (https://arxiv.org/abs/2412.19437, §2.2) and EAGLE's draft model "
        "(https://arxiv.org/abs/2401.15077); it shares the target's embedding and LM head (scored over a draft "
        f"vocabulary of {info['draft_vocab']} tokens, the shipped heads' own) and is applied recurrently on its own "
        f"output and drafted token. {info['params'] / 1e6:.2f} M parameters (the base has 135 M). Decoding draws a "
        f"dynamic tree every step (EAGLE-2, https://arxiv.org/abs/2406.16858): depth {d['depth']}, the "
        f"top-{d['top_k']} tokens of each expanded node, the {d['beam']} most probable nodes of each depth expanded, "
        f"then the {d['nodes'] - 1} most probable drafted nodes (plus the root) kept; on a CPU each step verifies "
        "the part of them that pays on the machine's measured step costs. Code: `mtp_triton/mtp_module.py`, "
        "`mtp_triton/drafters_mtp.py`, training `mtp_lab/training/module.py`."
        + (f" The stored tree settings were chosen on the tuning split only: {meta['draft_choice']}."
           if meta.get("draft_choice") else ""), "",
        "Every number below comes from `records/` (written by the training command), `module.json` and "
        "`results/cpu/drafters/drafters.csv` (written by `scripts/drafters_ab.py`), rendered by `make_card.py`.", "",
        "## How it was made", "", "```", command_today(info["command"]), "```", "",
        f"- **Machine**: {info['device']}, {info['threads']} threads, torch {info['torch']}, commit {info['commit']}, "
        f"{info['timestamp']}.",
        f"- **Data** (self-distillation): the model's own greedy answers to {info['rows']} of the training prompts "
        f"(the heads' prompt set: templated chat prompts and prompts the model wrote itself; {info['answer_tokens']} "
        f"answer tokens; written by " + ", ".join(f"{k}: {v}" for k, v in info["answers_by"].items()) +
        f"). The last {info['val_rows']} answers are held back from training for the accuracy below.",
        f"- **Training**: frozen base; {info['steps']} steps of {info['config']['batch']} sequences, AdamW lr "
        f"{info['config']['lr']}, the recurrence unrolled {info['config']['unroll']} steps (EAGLE-3's training-time "
        f"test, weights 0.8^k), loss = soft cross-entropy against the target's own next-token distribution over the "
        f"draft vocabulary + {info['config']['feature_weight']} × SmoothL1 to the target's hidden state (EAGLE-1).",
        f"- **Time** (wall clock): hidden-state cache {sec['cache'] / 60:.1f} min, training {sec['train'] / 60:.1f} "
        f"min, accuracy {sec['measure'] / 60:.1f} min; the answers were written before, by "
        "`mtp_lab/training/answers.py`, while this module's code was written (not counted).", "",
        "![training curve](records/train_mtp_curve.png)", "",
        "## Accuracy by depth (teacher-forced, held-back answers)", "",
        "Top-1 of unroll step k = the answer's token, given the k drafts before it were the answer's own: the "
        "chance that depth k + 1 of a chain is accepted once the depths above it were.", "",
        md_table(["depth", *(str(d + 1) for d in range(len(info["val_accuracy_by_depth"])))],
                 [["top-1", *(f"{100 * a:.1f} %" for a in info["val_accuracy_by_depth"])]]), ""]
    rows = latest(ab_rows())
    if rows:
        more, table = decoding_section(rows, SETS)
        lines += more
        goal_rows = [(ps, t["mtp: module"]) for ps, t in table.items() if "mtp: module" in t]
        if goal_rows:
            vs = lambda ps, s: s["tok_s"] / table[ps]["serial"]["tok_s"]
            checks = [("τ ≥ 3.0 (≤ 32 nodes verified)", lambda ps, s: (f"{s['tau']:.2f}", s["tau"] >= 3.0)),
                      ("depth-1 acceptance ≥ 80 %",
                       lambda ps, s: (f"{100 * s['accept'][0]:.0f} %", s["accept"][0] >= 0.8)),
                      ("drafting ≤ 25 % of a step",
                       lambda ps, s: (f"{100 * s['draft_share']:.0f} %", s["draft_share"] <= 0.25)),
                      ("≥ 1.8× our serial, identical output", lambda ps, s: (
                          f"{vs(ps, s):.2f}×, {s['identical']}/{s['prompts']}",
                          vs(ps, s) >= 1.8 and s["identical"] == s["prompts"]))]
            lines += goals_section("module", goal_rows, checks)
    write_text(os.path.join(HERE, "README.md"), "\n".join(lines))
    print(f"wrote {os.path.join(HERE, 'README.md')}")


if __name__ == "__main__":
    main()
