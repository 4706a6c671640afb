"""python -m mtp_lab demo | generate | eval | tables | prune | train_heads | aot  [--help]"""
import importlib
import sys

from .cli import run

COMMANDS = {
    "demo": ("mtp_lab.demo", "demo", "transformers vs our serial loop vs MTP on SmolLM2 (the main job)"),
    "generate": ("mtp_lab.demo", "text_generate", "generate text from a prompt"),
    "eval": ("mtp_lab.bench.evaluate", "main", "the A/B evaluation harness (MTP on vs off)"),
    "tables": ("mtp_lab.bench.tables", "main", "reproduce the published speedup tables"),
    "prune": ("mtp_lab.bench.pruning", "main", "MTP with confidence pruning of the tree, by threshold, vs serial"),
    "train_heads": ("mtp_lab.train_heads", "main", "train MTP heads (frozen base or joint)"),
    "aot": ("mtp_lab.aot", "main", "compile every kernel for sm_80/sm_90/... without a GPU: resources, roofline"),
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        for name, (_, _, text) in COMMANDS.items():
            print(f"  {name:12s} {text}")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    module, func, _ = COMMANDS[argv[0]]
    return run(getattr(importlib.import_module(module), func), argv[1:])


if __name__ == "__main__":
    sys.exit(main())
