"""Training MTP heads. The command line is `python -m mtp_lab train_heads` (mtp_lab/train_heads.py).

    loop.py      the one training loop both recipes run on (AdamW, schedule, budgets, rows, checkpoints)
    data.py      text files -> token streams -> random windows; prompt files
    hidden.py    what the heads read: the base's hidden states, greedy tokens and continuations; z_h
    joint.py     recipe 1: a small Llama and its heads trained together (MTP loss)
    frozen.py    recipe 2: heads self-distilled on a frozen base's cached hidden states (soft / hard)
    replay.py    the held-out replay of distillation: answer cache, head ranks, accuracies, exact greedy tau
    evaluate.py  head top-k accuracy, simulated and measured tau (the `eval` subcommand)
    answers.py   self-distillation data: the base's own answers to chat prompts
"""
