"""The evaluation's scenario sets and how an item becomes prompt ids.

Two sets of the same five kinds (short Q&A, multi-turn dialogue, code completion, structured output, long-form),
9 items each (3 short, 3 medium, 3 long outputs, in turn):
    data/scenarios/        raw text to continue (Python code and docs from third-party packages): for models
                           without a chat template, such as the embedded tiny model
    data/scenarios_chat/   hand-written chat requests (`messages`), rendered with the model's chat template: for
                           chat models such as SmolLM2-135M-Instruct
`default_scenario_dir(tok)` picks the chat set when the tokenizer has a chat template, the code set otherwise.
"""
import json
import os

from ..bundle import ROOT
from ..records import read_utf8

SCENARIO_DIR = os.path.join(ROOT, "data", "scenarios")
CHAT_SCENARIO_DIR = os.path.join(ROOT, "data", "scenarios_chat")
SCENARIOS = ("short_completion", "repl_dialogue", "code_completion", "structured_output", "long_form")
CHAT_SCENARIOS = ("short_qa", "multi_turn", "code_completion", "structured_output", "long_form")


def has_chat_template(tok):
    return bool(getattr(tok, "chat_template", None))


def default_scenario_dir(tok):
    """The chat set for a tokenizer with a chat template, else the code set."""
    return CHAT_SCENARIO_DIR if has_chat_template(tok) else SCENARIO_DIR


def scenario_names(folder):
    """The set names of a folder in their reading order: the two shipped sets in the order of their kinds, any
    other folder's *.jsonl sorted by name."""
    here = os.path.normpath(os.path.abspath(folder))
    for names, d in ((SCENARIOS, SCENARIO_DIR), (CHAT_SCENARIOS, CHAT_SCENARIO_DIR)):
        if here == os.path.normpath(d):
            return names
    if not os.path.isdir(folder):
        raise ValueError(f"no scenario folder {folder!r}")
    return tuple(sorted(f[:-6] for f in os.listdir(folder) if f.endswith(".jsonl")))


def load_scenarios(names=SCENARIOS, max_prompts=None, folder=SCENARIO_DIR):
    """{name: [item, ...]} from folder/<name>.jsonl (names None: every set of the folder); items have id, length,
    max_new_tokens, source and either text (raw) or messages (chat)."""
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1 (or None: every item), got {max_prompts}")
    out = {}
    names = names or scenario_names(folder)
    if not names:
        raise ValueError(f"scenario folder {folder}: no <set>.jsonl files in it")
    for name in names:
        path = os.path.join(folder, f"{name}.jsonl")
        if not os.path.exists(path):
            raise ValueError(f"unknown scenario set {name!r} (no {path}); known: {list(scenario_names(folder))}")
        items = read_scenario_items(path)
        out[name] = items[:max_prompts]
    return out


def read_scenario_items(path):
    """The items of one scenario set, each checked: a JSON object with `length`, `max_new_tokens` (an integer >= 1)
    and either `text` (a string) or `messages` (a list). Anything else, or a set without items, is a ValueError
    naming path:line and the field."""
    text = read_utf8(path, "scenario set")
    items = []
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        where = f"scenario set {path}:{n}"
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
        if not isinstance(item, dict):
            raise ValueError(f"{where}: not a JSON object")
        missing = [k for k in ("length", "max_new_tokens") if k not in item]
        if "text" not in item and "messages" not in item:
            missing.append("text (or messages)")
        if missing:
            raise ValueError(f"{where}: no {', '.join(repr(k) for k in missing)} field")
        m = item["max_new_tokens"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {m!r}")
        if "text" in item and not isinstance(item["text"], str):
            raise ValueError(f"{where}: 'text' is {type(item['text']).__name__}, not a string")
        if "text" not in item and not isinstance(item["messages"], list):
            raise ValueError(f"{where}: 'messages' is {type(item['messages']).__name__}, not a list")
        items.append(item)
    if not items:
        raise ValueError(f"scenario set {path}: no items")
    return items


def prompt_ids(tok, item):
    """Token ids of a scenario item: `messages` through the chat template with the assistant's turn opened (for one
    user turn the same ids as `bundle.encode`), else the raw `text` (a continuation)."""
    if "messages" in item:
        if not has_chat_template(tok):
            raise ValueError(f"scenario item {item.get('id')!r} is a chat (messages) but the tokenizer has no chat "
                             "template: use the raw-text sets (data/scenarios) for this model")
        out = tok.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)
    return tok(item["text"])["input_ids"]


def item_text(item):
    """An item's words as plain text (a chat item's turns joined): the material of the edge-input cases."""
    return item["text"] if "text" in item else "\n".join(m["content"] for m in item["messages"])


def fit(ids, max_new, ctx, prompt_cap=None):
    """Prompt ids cut from the left so that prompt + max_new fits the context: (ids, max_new, truncated)."""
    max_new = max(1, min(max_new, ctx - 32))
    keep = ctx - max_new if prompt_cap is None else min(prompt_cap, ctx - max_new)
    return ids[-keep:], max_new, len(ids) > keep
