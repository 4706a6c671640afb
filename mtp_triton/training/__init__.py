"""Training MTP heads: self-distillation data (`answers`), the frozen-base recipe on cached hidden states
(`frozen`), and the shared loop (`loop`). The command line is `python -m mtp_triton train_heads`."""
