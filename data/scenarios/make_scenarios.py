"""Build the evaluation scenario sets (data/scenarios/*.jsonl) from third-party packages.

    .venv/bin/python data/scenarios/make_scenarios.py            # rewrites the five JSONL files

The embedded model was trained on the standard library (and its bundled docs), so the prompts come from the
third-party packages installed next to it in site-packages — never from the stdlib — and every item records the
file and lines it was cut from. Packages that vendor or back-port stdlib modules (pip, setuptools, typing_extensions,
six, ...) are left out, and a candidate is dropped when more than MAX_OVERLAP of its long lines also occur verbatim
in the stdlib; the fraction that does is stored in each item (`stdlib_line_overlap`).

The five scenario kinds of an evaluation framework for MTP, in the model's domain (Python code and Python docs):
    short_completion    short Q&A       -> finish one line (`return ...`, `x = ...`)
    repl_dialogue       multi-turn      -> doctest transcripts: earlier `>>>` turns and their outputs, then a new `>>>`
    code_completion     code completion -> a function's signature + docstring, the body to write
    structured_output   structured      -> dict literals, argparse blocks, INI/JSON/rc tables
    long_form           long-form       -> module openings and package docs, continued for >= 512 tokens
Each set has 9 items: 3 short, 3 medium and 3 long outputs (`max_new_tokens` per item, see TIERS).
The selection is deterministic for a given set of installed package versions (sorted files, seeded choice).
"""
import ast
import json
import os
import random
import re
import sysconfig
from importlib import metadata

from mtp_lab.cli import command_parser
from mtp_lab.records import write_text

HERE = os.path.dirname(os.path.abspath(__file__))

# Pure-Python third-party packages to draw from (none is a copy or back-port of a stdlib module).
PACKAGES = ["click", "jinja2", "packaging", "pygments", "rich", "markdown_it", "mistune", "lark", "dateutil", "attr",
            "idna", "tqdm", "fsspec", "filelock", "httpx", "anyio", "networkx", "sympy", "jsonschema", "traitlets",
            "nbformat", "yaml", "arrow", "babel", "bleach", "tornado", "jedi", "parso", "prompt_toolkit",
            "referencing", "requests", "urllib3", "h11", "soupsieve", "bs4", "webcolors", "nbconvert",
            "jupyter_client", "pydantic", "matplotlib", "IPython", "psutil", "charset_normalizer", "huggingface_hub"]
SKIP_PARTS = {"tests", "test", "testing", "_vendor", "vendor", "externals", "__pycache__"}

TIERS = {  # scenario -> max_new_tokens for the short / medium / long outputs
    "short_completion": (8, 24, 64),
    "repl_dialogue": (32, 96, 192),
    "code_completion": (48, 128, 256),
    "structured_output": (32, 128, 256),
    "long_form": (512, 768, 1024),
}
KIND = {
    "short_completion": "short Q&A -> one-line completion",
    "repl_dialogue": "multi-turn dialogue -> doctest / REPL transcript",
    "code_completion": "code completion -> function body",
    "structured_output": "structured output -> dict / argparse / config table",
    "long_form": "long-form -> module or package docs continued",
}
PER_TIER = 3
MAX_PROMPT_CHARS = 1500
MAX_OVERLAP = 0.3


def site_packages():
    return sysconfig.get_paths()["purelib"]


def stdlib_lines():
    """Stripped lines (>= 25 chars) of every stdlib .py file: the hold-out check's haystack."""
    root = sysconfig.get_paths()["stdlib"]
    lines = set()
    for dirpath, dirnames, files in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in ("site-packages", "__pycache__")]
        for f in files:
            if f.endswith(".py"):
                try:
                    with open(os.path.join(dirpath, f), encoding="utf-8") as fh:
                        lines.update(s for s in (l.strip() for l in fh) if len(s) >= 25)
                except (UnicodeDecodeError, OSError):
                    pass
    return lines


def overlap(text, haystack):
    long = [s for s in (l.strip() for l in text.splitlines()) if len(s) >= 25]
    return sum(s in haystack for s in long) / len(long) if long else 0.0


_DISTS = None


def version_of(top):
    """'click 8.5.1' for a top-level module name (via the installed distributions)."""
    global _DISTS
    if _DISTS is None:
        _DISTS = metadata.packages_distributions()
    dist = (_DISTS.get(top) or [top])[0]
    try:
        return f"{dist} {metadata.version(dist)}"
    except metadata.PackageNotFoundError:
        return top


def py_files(sp):
    """(package, relative path, lines) of every .py file of PACKAGES, sorted."""
    out = []
    for pkg in PACKAGES:
        root = os.path.join(sp, pkg)
        for dirpath, dirnames, files in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d not in SKIP_PARTS and not d.startswith("test"))
            for f in sorted(files):
                if f.endswith(".py") and not f.startswith("test"):
                    path = os.path.join(dirpath, f)
                    try:
                        with open(path, encoding="utf-8") as fh:
                            lines = fh.read().splitlines(keepends=True)
                    except (UnicodeDecodeError, OSError):
                        continue
                    out.append((pkg, os.path.relpath(path, sp), lines))
    return out


def context_before(lines, end, max_lines=40):
    """Text of up to max_lines lines before line index `end`, trimmed from the top to MAX_PROMPT_CHARS."""
    start = max(0, end - max_lines)
    chunk = lines[start:end]
    while chunk and sum(map(len, chunk)) > MAX_PROMPT_CHARS - 200:
        chunk, start = chunk[1:], start + 1
    return start, "".join(chunk)


# ------------------------------------------------------------------------------ candidate extractors
# Each yields (package, source "path:first-last", prompt text).

def short_completions(files):
    pat = re.compile(r"^(\s+)(return |[a-z_][\w.]* = )(\S.{15,70})\n$")
    for pkg, rel, lines in files:
        for i, line in enumerate(lines):
            m = pat.match(line)
            if m and i >= 15:
                start, ctx = context_before(lines, i)
                yield pkg, f"{rel}:{start + 1}-{i + 1}", ctx + m.group(1) + m.group(2)


def repl_dialogues(files):
    for pkg, rel, lines in files:
        turns = [i for i, l in enumerate(lines) if l.lstrip().startswith(">>> ")]
        # the 3rd '>>>' of a transcript whose first two turns are within 25 lines (earlier turns + outputs)
        for a, b, c in zip(turns, turns[1:], turns[2:]):
            if c - a <= 25 and any(not lines[j].lstrip().startswith((">>>", "...")) and lines[j].strip()
                                   for j in range(a + 1, c)):
                doc = max((j for j in range(max(0, a - 30), a) if '"""' in lines[j]), default=max(0, a - 12))
                start, ctx = context_before(lines, c + 1, max_lines=c + 1 - doc)
                yield pkg, f"{rel}:{start + 1}-{c + 1}", ctx
                break


def code_completions(files):
    for pkg, rel, lines in files:
        try:
            tree = ast.parse("".join(lines))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(node) \
                    and len(node.body) >= 3 and node.end_lineno - node.lineno >= 8:
                doc_end = node.body[0].end_lineno                       # 1-based last line of the docstring
                first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
                start, ctx = context_before(lines, first, max_lines=15)
                body = "".join(lines[first:doc_end])
                if len(ctx) + len(body) <= MAX_PROMPT_CHARS:
                    yield pkg, f"{rel}:{start + 1}-{doc_end}", ctx + body


def dict_literals(files):
    opener = re.compile(r"^\s*[\w.\[\]'\"]+(\s*:\s*[\w\[\], .]+)? = \{\n$")
    entry = re.compile(r"^\s+['\"\w].*:.*,\n$")
    for pkg, rel, lines in files:
        for i, line in enumerate(lines):
            if opener.match(line) and all(entry.match(l) for l in lines[i + 1:i + 7]):
                start, ctx = context_before(lines, i, max_lines=12)
                yield pkg, f"{rel}:{start + 1}-{i + 3}", ctx + "".join(lines[i:i + 3])


def argparse_blocks(files):
    for pkg, rel, lines in files:
        calls = [i for i, l in enumerate(lines) if ".add_argument(" in l]
        if len(calls) >= 4:
            end = calls[1]
            while end < len(lines) and not lines[end].rstrip().endswith(")"):
                end += 1
            start, ctx = context_before(lines, end + 1, max_lines=end + 1 - max(0, calls[0] - 12))
            yield pkg, f"{rel}:{start + 1}-{end + 1}", ctx


def config_tables(sp):
    """INI-like entry_points.txt, matplotlibrc, JSON settings schemas: the first lines of each."""
    cands = []
    for d in sorted(os.listdir(sp)):
        f = os.path.join(sp, d, "entry_points.txt")
        if d.endswith(".dist-info") and os.path.exists(f) and not d.startswith(("pip-", "setuptools-")):
            cands.append(f)
    cands.append(os.path.join(sp, "matplotlib", "mpl-data", "matplotlibrc"))
    schemas = os.path.join(sp, "jupyterlab", "schemas", "@jupyterlab")
    if os.path.isdir(schemas):
        for dirpath, _, files in sorted(os.walk(schemas)):
            cands += [os.path.join(dirpath, f) for f in sorted(files) if f.endswith(".json")]
    for f in cands:
        with open(f, encoding="utf-8") as fh:
            lines = fh.read().splitlines(keepends=True)
        if len(lines) < 12:
            continue
        rel = os.path.relpath(f, sp)
        if f.endswith("matplotlibrc"):                                   # skip the licence-like header
            i0 = next((i for i, l in enumerate(lines) if l.startswith("## ***")), 0)
        else:
            i0 = 0
        n = 8 if f.endswith(".txt") else 20
        text = "".join(lines[i0:i0 + n])[:MAX_PROMPT_CHARS]
        pkg = rel.split(os.sep)[0].split("-")[0]
        yield pkg, f"{rel}:{i0 + 1}-{i0 + n}", text


def long_forms(files, sp):
    # (a) module openings with a long docstring
    for pkg, rel, lines in files:
        head = "".join(lines[:60])
        if head.lstrip().startswith(('"""', 'r"""', "#")) and len(head) > 1200 and head.count('"""') >= 2:
            n = 0
            while n < len(lines) and sum(map(len, lines[:n + 1])) <= 1200:
                n += 1
            yield "module", pkg, f"{rel}:1-{n}", "".join(lines[:n])
    # (b) package docs: the long description in a wheel's METADATA (markdown / rst about the package)
    for d in sorted(os.listdir(sp)):
        f = os.path.join(sp, d, "METADATA")
        if not (d.endswith(".dist-info") and os.path.exists(f)) or d.startswith(("pip-", "setuptools-")):
            continue
        with open(f, encoding="utf-8") as fh:
            text = fh.read()
        body_at = text.find("\n\n")
        body = text[body_at + 2:] if body_at > 0 else ""
        if len(body) > 3000:
            line0 = text[:body_at + 2].count("\n") + 1
            cut = body[:1200].rsplit("\n", 1)[0] + "\n"
            yield "docs", d.split("-")[0], f"{os.path.relpath(f, sp)}:{line0}-{line0 + cut.count(chr(10))}", cut


def pick(cands, n, rng, haystack, used_pkgs=None):
    """n candidates, at most one per package (as long as possible), overlap with the stdlib <= MAX_OVERLAP."""
    cands = list(cands)
    rng.shuffle(cands)
    chosen, seen = [], set(used_pkgs or ())
    for rounds in range(2):
        for c in cands:
            pkg, src, text = c[-3:]
            if len(chosen) == n:
                return chosen
            if (rounds == 0 and pkg in seen) or any(src == s for _, s, _, _ in chosen) or len(text) < 200:
                continue
            ov = overlap(text, haystack)
            if ov <= MAX_OVERLAP:
                chosen.append((pkg, src, text, ov))
                seen.add(pkg)
    return chosen


def build(seed=0):
    sp = site_packages()
    rng = random.Random(seed)
    files = py_files(sp)
    haystack = stdlib_lines()
    n = 3 * PER_TIER
    sets = {
        "short_completion": pick(short_completions(files), n, rng, haystack),
        "repl_dialogue": pick(repl_dialogues(files), n, rng, haystack),
        "code_completion": pick(code_completions(files), n, rng, haystack),
        "structured_output": (pick(dict_literals(files), PER_TIER, rng, haystack)
                              + pick(argparse_blocks(files), PER_TIER, rng, haystack)
                              + pick(config_tables(sp), PER_TIER, rng, haystack)),
    }
    longs = list(long_forms(files, sp))
    sets["long_form"] = (pick([c[1:] for c in longs if c[0] == "module"], 2 * PER_TIER, rng, haystack)
                         + pick([c[1:] for c in longs if c[0] == "docs"], PER_TIER, rng, haystack))
    out = {}
    for name, items in sets.items():
        rows = []
        for i, (pkg, src, text, ov) in enumerate(items):
            tier = i % 3                                                   # short, medium, long in turn
            top = src.split(os.sep)[0].split("-")[0].split(":")[0]
            rows.append(dict(id=f"{name}-{i:02d}", scenario=name, kind=KIND[name],
                             length=("short", "medium", "long")[tier], max_new_tokens=TIERS[name][tier],
                             source=f"{version_of(top if top in PACKAGES else pkg)}: {src}",
                             stdlib_line_overlap=round(ov, 3), text=text))
        out[name] = rows
    return out


def main(argv=None):
    ap = command_parser("python data/scenarios/make_scenarios.py", __doc__, "out", "seed", out=HERE)
    a = ap.parse_args(argv)
    sets = build(a.seed)
    for name, rows in sets.items():
        write_text(os.path.join(a.out, f"{name}.jsonl"), "".join(json.dumps(r, ensure_ascii=False) + "\n"
                                                                 for r in rows))
        print(f"{name}: {len(rows)} items, max_new_tokens {sorted({r['max_new_tokens'] for r in rows})}, "
              f"max stdlib overlap {max(r['stdlib_line_overlap'] for r in rows):.2f}")


if __name__ == "__main__":
    main()
