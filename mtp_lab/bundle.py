"""What a run needs, in one place: the repository's paths, the shipped models' drafters, loading a (model,
drafter, tokenizer) bundle, prompt files, prompt ids, and the tree a drafter verifies (`pick_tree`).

The demo, `generate`, `eval`, `prune`, the tables and the scripts all take these from here.
"""
import json
import os
import sys

import torch

from mtp_triton.loading import load_model, load_tokenizer, resolve
from mtp_triton.ops import native_bf16
from mtp_triton.mtp_module import MTPModule, is_module_folder, load_drafter
from mtp_triton.policy import RuntimeConfig
from mtp_triton.tree import PRESETS, Tree, get_tree, is_tree_name
from .training.measure import best_tree
from .records import read_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))                      # the repository
EMBEDDED = os.path.join(ROOT, "data", "tiny-stdlib-llama")                               # the embedded model
PROMPTS = os.path.join(ROOT, "data", "prompts", "thirdparty_code.jsonl")                 # held-out code prompts
SMOLLM2 = "smollm2-135m-instruct"
HEADS = {SMOLLM2: os.path.join(ROOT, "data", "smollm2-135m-instruct-heads")}
MODULES = {SMOLLM2: os.path.join(ROOT, "data", "smollm2-135m-instruct-mtp")}
DRAFTERS = ("medusa", "mtp")                               # --drafter: MTP heads, or the MTP module
# the command lines' default where a model has both: the one measured faster on the tuning split (dev_chat; the
# MTP module's card and the README's drafter table); a model with heads only gets its heads
DEFAULT_DRAFTER = "mtp"
CHAT_PROMPTS = os.path.join(ROOT, "data", "chat", "heldout_chat.jsonl")
TREE_NAMES = ("stored", "auto")          # besides every name mtp_triton.tree.get_tree knows


def cli_drafter(model, arg, heads=None):
    """--drafter as given; else the kind of the --heads folder given; else DEFAULT_DRAFTER where this model has one
    of that kind, else its heads. A --drafter that contradicts the kind of the --heads folder given (an MTP module
    folder with --drafter medusa, a heads folder with --drafter mtp) is a ValueError naming both flags."""
    if arg is not None:
        if heads is not None and os.path.isdir(heads):
            kind = ("mtp" if is_module_folder(heads)
                    else "medusa" if os.path.exists(os.path.join(heads, "heads.json")) else None)
            if kind is not None and kind != arg:
                what = "an MTP module" if kind == "mtp" else "MTP heads (medusa)"
                raise ValueError(f"--heads {heads} holds {what}, but --drafter {arg} was given; drop --drafter, or "
                                 f"give a --heads folder of that kind")
        return arg
    if heads is not None:
        return "mtp" if is_module_folder(heads) else "medusa"
    return DEFAULT_DRAFTER if is_module_folder(heads_dir_for(model, DEFAULT_DRAFTER)) else "medusa"


def heads_dir_for(model, drafter="medusa"):
    """Where a model's drafter lives: the registry for short names (heads, or the MTP module for drafter 'mtp'),
    else <model folder>/heads or <model folder>/mtp."""
    if drafter not in DRAFTERS:
        raise ValueError(f"unknown drafter {drafter!r}; choose one of {', '.join(DRAFTERS)}")
    table, sub = (MODULES, "mtp") if drafter == "mtp" else (HEADS, "heads")
    return table.get(model, os.path.join(model, sub))


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def command_dtype(arg, model, device=None):
    """The commands' dtype: --dtype's if given; else for SmolLM2 on a CPU bf16 where the CPU multiplies bf16 natively
    (AVX512-BF16 or AMX: half the bytes per step, and the engine's exact mode keeps MTP identical to serial) and fp32
    where it does not (emulated bf16 makes every step several times slower there); else the checkpoint's (None).
    -> (dtype or None, why: a few words for the first line a command prints)."""
    if arg is not None:
        return DTYPES[arg], f"--dtype {arg}"
    if model != SMOLLM2 or (device or "cpu") != "cpu" or torch.cuda.is_available():
        return None, "the checkpoint's"
    if native_bf16():
        return torch.bfloat16, "this CPU multiplies bf16 natively"
    return torch.float32, "this CPU has no native bf16 (AVX512-BF16/AMX): fp32 is faster here; --dtype bf16 to override"


def load_bundle(model=SMOLLM2, heads=None, device=None, dtype=None, drafter="medusa"):
    """(model, drafter: MTP heads or an MTP module, tokenizer). heads: the drafter's folder (default: the model's
    shipped one of kind `drafter`); drafter=None: no drafter (None in its place: serial decoding). dtype None: bf16 on CPU for the GGUF model (the engine's exact mode keeps MTP
    identical to serial there), the checkpoint's dtype otherwise."""
    if dtype is None and model == SMOLLM2 and (device or "cpu") == "cpu" and not torch.cuda.is_available():
        dtype = torch.bfloat16
    if drafter is None:
        m = load_model(model, device=device, dtype=dtype)
        return m, None, load_tokenizer(model)
    heads_path = heads or heads_dir_for(model, drafter)
    if heads is None and not os.path.exists(heads_path):
        kind = "MTP module (--drafter mtp)" if drafter == "mtp" else "MTP heads (--drafter medusa)"
        raise ValueError(f"{model} ships no {kind}: {heads_path} does not exist; choose the other --drafter, or give "
                         "a drafter folder with --heads")
    m = load_model(model, device=device, dtype=dtype)
    h = load_drafter(heads_path, device=m.device, dtype=torch.float32)
    check_heads_fit(h, m, heads_path)
    return m, h, load_tokenizer(model)


def check_heads_fit(heads, model, where):
    """ValueError (naming `where`) unless the drafter reads this model's hidden state and drafts ids in its
    vocabulary."""
    D, V = model.config.hidden_size, model.config.vocab_size
    if isinstance(heads, MTPModule):
        if heads.hidden_size != D or heads.config.vocab_size != V:
            raise ValueError(f"the MTP module in {where!r} is for hidden size {heads.hidden_size} and vocabulary "
                             f"{heads.config.vocab_size}, the model has {D} and {V}: it was trained for another "
                             f"model. Pass --heads <the folder of this model's drafter>.")
        return
    if heads.hidden_size != D:
        raise ValueError(f"the heads in {where!r} read a hidden state of size {heads.hidden_size}, but the model's is "
                         f"{D}: they were trained for another model. Pass --heads <the folder of this model's heads>.")
    head_vocab = heads.lm_head.shape[1] if heads.lm_head is not None else None
    if head_vocab is not None and heads.token_map is None and head_vocab != V:
        raise ValueError(f"the heads in {where!r} draft over {head_vocab} ids, but the model's vocabulary has {V}")
    if heads.token_map is not None and int(heads.token_map.max()) >= V:
        raise ValueError(f"the heads in {where!r} have a draft vocabulary with id {int(heads.token_map.max())}, "
                         f"outside the model's vocabulary of {V}")


def load_embedded(path=EMBEDDED, device=None, dtype=None):
    """(model, heads, tokenizer) of a model folder that has a heads/ subfolder (the tiny model's layout)."""
    return load_bundle(path, os.path.join(path, "heads"), device, dtype)


def read_prompts(path=PROMPTS, n=None):
    """The first n rows (all: None) of a prompts JSONL file: one JSON object per line with a non-empty string
    'text' (and optionally 'category', 'id'). Anything else is a ValueError naming the file and line
    (records.read_jsonl)."""
    rows = read_jsonl(path, "prompts file", ("text",), blank_text=False)
    if not rows:
        raise ValueError(f"prompts file {path!r} holds no prompts")
    return rows[:n] if n else rows


def read_accuracy(heads_dir, num_heads):
    """(acc [H, K] float64, tree budget) from heads_dir/accuracy.json; (None, None) without one."""
    path = os.path.join(heads_dir, "accuracy.json")
    if not os.path.exists(path):
        return None, None
    with open(path) as fh:
        info = json.load(fh)
    return torch.tensor(info["acc"], dtype=torch.float64)[:num_heads], int(info.get("tree_budget", 16))


def pick_tree(arg, heads, heads_dir=None, model=None, kernels="auto", log=sys.stderr):
    """The tree a drafter verifies, by name (the one resolver of every command line and harness):

        'stored'   the tree saved with the heads; without one, 'tuned'
        'auto'     tuned now to the heads' accuracies and this machine's measured step costs
                   (`training.measure.best_tree`; needs `model`); without accuracies or a model, 'tuned'
        any other  `mtp_triton.tree.get_tree`'s names ('tuned': to heads_dir/accuracy.json with the budget stored
                   there, 'tuned-N', a preset, 'chain-N', 'width-K')
    The MTP module draws its own dynamic tree every step: None ('stored' only)."""
    if isinstance(heads, MTPModule):
        if arg != "stored":
            raise ValueError(f"--tree {arg!r}: the MTP module draws its own (dynamic) tree every step; --tree picks "
                             "a tree for MTP heads (--drafter medusa)")
        return None
    if arg == "stored" and heads.tree is not None:
        return Tree.from_choices(heads.tree)
    acc, budget = read_accuracy(heads_dir, heads.num_heads) if heads_dir else (None, None)
    if arg == "auto" and model is not None and acc is not None:
        tree, table = best_tree(model, acc, kernels=kernels)
        print("tree size for this machine (expected tokens/step / measured step-cost ratio):", file=log)
        for r in table:
            print(f"  budget {r['budget']:3d}: {r['nodes']:3d} nodes, E[tokens/step] {r['expected_tokens_per_step']:.2f}"
                  f", cost x{r['cost_ratio']:.2f} -> predicted speedup {r['expected_speedup']:.2f}", file=log)
        return tree
    return get_tree("tuned" if arg in TREE_NAMES else arg, heads.num_heads, accuracy=acc, budget=budget)


def check_tree_name(name):
    """ValueError unless `name` is one pick_tree knows (checked before a model loads, so a typo fails in a second)."""
    if name not in TREE_NAMES and not is_tree_name(name):
        raise ValueError(f"unknown --tree {name!r}; use one of {list(TREE_NAMES)}, 'tuned', 'tuned-N', 'chain-N', "
                         f"'width-K' or a preset: {sorted(PRESETS)}")


def encode(tok, text):
    """Prompt ids: the chat template (one user turn) when the tokenizer has one, else the raw text."""
    if getattr(tok, "chat_template", None):
        return chat_ids(tok, text)
    return tok(text)["input_ids"]


def chat_ids(tok, text, system=None):
    """Token ids of one user turn in the model's chat template, ending where the assistant's answer starts
    (a tokenizer without a chat template: the text itself)."""
    if not getattr(tok, "chat_template", None):
        return list(tok(text)["input_ids"])
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    out = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def pick_prompts(rows, per_category):
    """The first `per_category` rows of every category, in file order (rows without one count as 'all')."""
    seen, out = {}, []
    for r in rows:
        c = r.get("category", "all")
        if seen.get(c, 0) < per_category:
            out.append(r)
            seen[c] = seen.get(c, 0) + 1
    return out


def generate_tree(arg, heads, tree):
    """What the demo hands generate(): None for 'stored' when the heads carry their tree (generate's default, sized
    per step by cost on a CPU), else the picked tree itself (verified whole)."""
    return None if tree is None or (arg == "stored" and heads.tree is not None) else tree


def describe_drafter(heads, tree):
    """One line: what drafts and over which tree."""
    vocab = f", draft vocabulary {len(heads.token_map)}" if heads.token_map is not None else ""
    if isinstance(heads, MTPModule):
        d = heads.draft
        return (f"the MTP module (1 block, {sum(p.numel() for p in heads.parameters()) / 1e6:.1f} M params{vocab}); "
                f"a dynamic tree each step: depth {d['depth']}, top-{d['top_k']}, {d['beam']} nodes expanded per "
                f"depth, at most {d['nodes']} nodes")
    return f"{heads.num_heads} heads{vocab}; tree of {tree.size} nodes (depth {tree.max_depth})"


def tree_size(heads, tree):
    """The most nodes a step verifies: the tree's size, or the MTP module's node budget."""
    return heads.draft["nodes"] if tree is None else tree.size


def reproducible_runtime(temperature, seed, **settings):
    """The RuntimeConfig of a command (None where every setting is None). Sampling with a seed verifies fixed trees
    (size_by_cost=False): the CPU default sizes each step's tree by measured step costs, and the random numbers
    follow the verified trees, so without this the same --seed could sample other text on a busier moment."""
    settings = {k: v for k, v in settings.items() if v is not None}
    if temperature > 0 and seed is not None:
        settings["size_by_cost"] = False
    return RuntimeConfig(**settings) if settings else None


def transformers_model(name_or_path, dtype=torch.float32, device="cpu"):
    """The same checkpoint as transformers' own *ForCausalLM (the external baseline; also a fast batch decoder for
    training data on a CPU)."""
    from transformers import AutoModelForCausalLM

    kind, where = resolve(name_or_path)
    if kind == "gguf":
        folder, name = os.path.split(os.path.abspath(where))
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(where, dtype=dtype)
    return hf.to(device).eval()
