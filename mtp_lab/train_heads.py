"""Training MTP heads: two recipes, one command.

    python -m mtp_lab.train_heads joint  --tokenizer TOK --out MODEL_DIR ...   # base + heads from scratch
    python -m mtp_lab.train_heads frozen --model MODEL_DIR --out HEADS_DIR ...  # heads for a frozen base
    python -m mtp_lab.train_heads eval   --model MODEL_DIR --heads HEADS_DIR --prompts P.jsonl --out tau.json
    python -m mtp_lab.train_heads retree --heads HEADS_DIR --tune A.jsonl,B.jsonl   # the tree, for this machine

For your own Llama checkpoint on a GPU (bf16 base, fp32 heads, hidden states cached once):
    python -m mtp_lab.train_heads frozen --model /ckpt/llama-7b --out /ckpt/llama-7b/heads --device cuda \\
        --dtype bf16 --num-heads 4 --real-windows 512 --self-generated 512 --seq-len 1024 --prompt-len 128 \\
        --data my_text.jsonl --steps 2000 --batch 8 --max-minutes 60 --checkpoint /ckpt/heads.ckpt

Heads (see `mtp_triton.heads`): head h reads the final-norm hidden state x_t and predicts the token at
t + h + 2 through the model's own LM head, z_h = x + silu(W_h x + b_h), logits_h = lm_head(z_h).

1. `joint` (mtp_lab.training.joint) — multi-token-prediction pre-training: a fresh `LlamaForCausalLM` and
   its heads are trained together on L = CE(next token) + lambda * mean_h CE_h(token t + h + 2).
2. `frozen` (mtp_lab.training.frozen) — Medusa-1 self-distillation for an existing checkpoint: the base is
   frozen and only the heads learn, towards the base's own predictions (soft: KL, hard: CE to its argmax), on
   hidden states cached once; `--self-generated N` adds the base's own greedy continuations.
3. `eval` (mtp_lab.training.evaluate) — tau of the real decoder per tree, checked token for token against
   the serial output.

Both recipes run on one loop (mtp_lab.training.loop.Loop: AdamW, warm-up + cosine, step and time budgets,
logged rows, resumable `--checkpoint`). Outputs (in --out): the model / heads folder, `train_<recipe>.json`
(config, held-out loss, per-head top-1 / top-5 accuracy, timing), `train_<recipe>_curve.csv` and `.png` (loss
curve from the logged rows); `frozen` also writes `accuracy.json` next to the heads (input of
`Tree.from_accuracies`).
"""
import argparse
import importlib
import sys

from mtp_lab.cli import command_parser, run

# The pieces, importable from here as before (mtp_lab.training.* is where they live).
from mtp_lab.training.data import load_text_files, prompt_ids, random_windows, token_streams  # noqa: F401
from mtp_lab.training.evaluate import (distinct_ratio, head_topk_accuracy, measure_tau,  # noqa: F401
                                          prompts_tau, simulate_tau, standard_trees, tau_report)
from mtp_lab.training.frozen import frozen_head_losses, train_frozen  # noqa: F401
from mtp_lab.training.hidden import (autocast, base_argmax, cache_hidden, final_hidden,  # noqa: F401
                                        greedy_continue, head_z, init_from)
from mtp_lab.training.joint import build_llama, train_joint  # noqa: F401
from mtp_lab.training.loop import Recorder, lr_at, plot_curve, plot_curve_csv  # noqa: F401

# subcommand: (module with add_arguments(parser), the function it runs, help). One line per subcommand.
SUBCOMMANDS = {
    "joint": ("mtp_lab.training.joint", "train_joint", "train a small Llama and its heads together (MTP loss)"),
    "frozen": ("mtp_lab.training.frozen", "train_frozen", "self-distil heads for a frozen base (Medusa-1)"),
    "distill": ("mtp_lab.training.distill", "run", "heads for a frozen chat model from its own answers (SmolLM2)"),
    "mtp": ("mtp_lab.training.module", "run", "an MTP module (one block, DeepSeek-V3 / EAGLE style) for a frozen "
            "chat model from its own answers"),
    "eagle3": ("mtp_lab.training.eagle3", "run", "EAGLE-3's drafter (three feature layers, training-time test) for a "
               "frozen chat model from its answer shards (resumable)"),
    "answers": ("mtp_lab.training.answers", "run", "the model's own answers to the training prompts, into gzip'ed "
                "shards (resumable, time budget)"),
    "retree": ("mtp_lab.training.retree", "run", "choose trained heads' tree again for this machine (no training)"),
    "eval": ("mtp_lab.training.evaluate", "measure_tau",
             "measure tau with mtp_triton.generate (greedy) per tree on a prompt file"),
}


def build_parser():
    p = command_parser("python -m mtp_lab.train_heads", __doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="recipe", required=True)
    for name, (module, func, text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        sp = sub.add_parser(name, help=text, description=mod.__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(sp)
        sp.set_defaults(func=getattr(mod, func))
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(run(main))
