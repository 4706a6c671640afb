"""The evaluation harness: MTP on vs off, everything else identical, over five scenario sets (the kinds of an
evaluation framework for MTP on local quantised models: short Q&A, multi-turn dialogue, code completion, structured
output, long-form; each with short, medium and long outputs).

    python -m mtp_lab eval --out out/eval                       # SmolLM2-135M-Instruct + its heads, chat set
    python -m mtp_lab eval --max-prompts 3 --out out/eval-3     # one item per output length: minutes on a CPU
    python -m mtp_lab eval --quick --out out/eval-quick         # tiny sizes (<= 16 new tokens)
    python -m mtp_lab eval --model data/tiny-stdlib-llama --quick --out out/eval-tiny    # the embedded model
    python -m mtp_lab eval --sweep --long-run 10000 --out out/eval-full
    python -m mtp_lab eval --sweep --long-run 10000 --out out/eval-full --resume    # after a Ctrl-C
    python -m mtp_lab.bench.evaluate ...                         # the same

Each item runs serial (MTP off) and MTP (on) back to back, same prompt, max_new_tokens, EOS, temperature, seed and
kernels; the order alternates from item to item so that drift on a busy machine hits both modes.

The model, heads, dtype and tree are picked as by the demo (`bundle.load_bundle`, `bundle.pick_tree`: --tree
stored is the tree saved with the heads). The scenario set fits the tokenizer: a chat template ->
data/scenarios_chat (chat messages rendered with the template), none -> data/scenarios (raw code to continue);
--scenario-dir overrides. Without --full, 3 items of each set (one short, one medium, one long: about 5 minutes on a
2-core CPU); the run says up front how many requests it makes and about how long they take.

What it measures (the framework's dimensions -> what is recorded; every number comes from `generate`'s stats):
    quality gate   T = 0: MTP output must equal serial output token for token (any mismatch: first differing
                   position + decoded context, exit status 1). T > 0: paired comparison of distribution summaries
                   (mean log-prob under the model, distinct-token ratio, length) within a stated tolerance.
    performance    decode tokens/s, TTFT, end-to-end latency (mean, P95, P99 over requests), inter-token P50/P95/P99,
                   tokens per step (tau), acceptance per depth, rejected steps, wasted drafts, fallbacks, time per
                   phase (draft / verify / accept / append), verification overhead (verify time per step, on / off)
    resources      peak memory (GPU: max_memory_allocated per request; CPU: process RSS high-water, monotone),
                   KV-cache bytes, heads bytes, energy (GPU with NVML, else None)
    sensitivity    --sweep: tree depth (chain-1..chain-H), tree size (medusa-8..64, tuned), candidate width (width-k)
    stability      --long-run N: N tokens in many requests; throughput drift (first vs last quarter), memory growth,
                   errors, timeouts (requests slower than --timeout, measured after the fact: a hung request is not
                   interrupted), spot checks against serial (every 10th request at T = 0)
    edge inputs    empty, over-long, at the context limit (on a CPU only for contexts <= 2048 tokens unless
                   --edge-full-context), repeated token, unusual characters, max_new_tokens 1 / 0, EOS first,
                   out-of-range id — then a normal request must still match serial
    compatibility  a batch of different-length prompts must give the single-request outputs
Outputs in --out: eval.csv (raw rows, each stamped with env_info(); the rows of every request are appended as soon
as it finishes, so Ctrl-C or a full disk loses only the request in flight), report.md (tables), *.png (plots) — the
report and the plots are computed from the rows. --resume skips the requests whose rows eval.csv already holds for
the same configuration (weights, tree, temperature, top-p, seed, kernels, caps) on the same device. On CPU the
numbers are CPU numbers and are labelled so.

The pieces: scenarios.py (the sets, prompt ids), eval_harness.py (the sections), eval_metrics.py (numbers from
rows), eval_report.py (report.md and the plots).
"""
import contextlib
import dataclasses
import os
import sys
import time
from dataclasses import dataclass, field

import torch

from ..bundle import ROOT, SMOLLM2, cli_drafter, command_dtype, heads_dir_for, load_bundle, pick_tree
from ..cli import Resumable, add_common, command_parser, error, int_at_least, run
from mtp_triton.generate import RuntimeConfig, generate
from mtp_triton.loading import SHORT_NAMES
from ..records import append_rows, ensure_writable_dir, output_lock, resume_rows
from mtp_triton.sampling import check_temperature
# The names below that this module does not use are here for `from mtp_lab.bench import evaluate as ev`
# (tests and notebooks).
from .eval_harness import Harness, sweep_tree_names  # noqa: F401
from .scenarios import (CHAT_SCENARIO_DIR, CHAT_SCENARIOS, SCENARIO_DIR, SCENARIOS, default_scenario_dir,  # noqa: F401
                        has_chat_template, load_scenarios, prompt_ids)
from .eval_metrics import (ALPHA, FLOOR, MEM_GROWTH_LIMIT, MIN_ITEMS, ab_table, aggregate,  # noqa: F401
                           describe_mismatch, first_difference, long_run_summary, mean_logprob, sampled_quality,
                           t_critical)
from .eval_report import md_table, performance_tables, plot_all, sweep_table, write_report  # noqa: F401

DEFAULT_PROMPTS = 3                       # items per set without --full: short, medium, long (the files' order)


@dataclass
class EvalConfig:
    """Everything a run varies; `EvalConfig.quick()` is the CI size."""
    tree: str = "stored"                  # 'stored' | 'auto' | 'tuned' | preset | 'chain-N' | 'width-K'
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    kernels: str = "auto"
    scenarios: tuple = None               # set names (None: every set of scenario_dir)
    max_prompts: int = None               # per scenario set (items come short, medium, long in turn)
    max_new_cap: int = None               # cap on each item's max_new_tokens
    prompt_cap: int = None                # keep only the last N prompt tokens
    fallback: float = None                # RuntimeConfig.fallback_threshold (None: off)
    prune_below: float = None             # RuntimeConfig.prune_below: confidence pruning (None: off)
    sweep: bool = False
    sweep_trees: tuple = None             # default: see sweep_tree_names()
    sweep_prompts: int = 5
    sweep_tokens: int = 128
    long_run: int = 0                     # tokens
    long_request_tokens: int = 128
    timeout_s: float = 300.0
    edge: bool = True
    edge_limit_tokens: int = 16           # new tokens of the "context at the limit" edge case
    edge_full_context: bool = None        # run that case (None: on a GPU, or a context <= 2048 tokens on a CPU)
    compat: bool = True
    progress: bool = True
    scenario_dir: str = None              # None: the chat set for a chat tokenizer, else the code set

    def __post_init__(self):
        for name in ("max_prompts", "max_new_cap", "prompt_cap"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1 (or None: no limit), got {v}")
        for name in ("sweep_prompts", "sweep_tokens", "long_request_tokens", "edge_limit_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"EvalConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_run < 0 or not self.timeout_s > 0:
            raise ValueError(f"EvalConfig: long_run must be >= 0 and timeout_s > 0, got {self.long_run}, "
                             f"{self.timeout_s}")
        check_temperature(self.temperature, self.top_p)      # here, so that --top-p 0 fails before the model loads
        RuntimeConfig(fallback_threshold=self.fallback, prune_below=self.prune_below)      # refuses bad values

    @classmethod
    def quick(cls, **kw):
        base = dict(max_prompts=2, max_new_cap=16, prompt_cap=96, sweep_prompts=1, sweep_tokens=12,
                    sweep_trees=("chain-1", "chain-2", "medusa-8", "width-2", "tuned"), long_request_tokens=16,
                    edge_limit_tokens=4)
        base.update(kw)
        return cls(**base)


@dataclass
class EvalResult:
    rows: list
    failures: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    csv_path: str = None                  # where the rows were appended as they finished (None: not yet written)


def evaluate(model, heads, tok, cfg=None, heads_dir=None, csv_path=None, command="", resume=False, label=None):
    """Run every requested section; returns EvalResult(rows, failures, info). Rows carry env_info().

    cfg.scenario_dir None: the chat set when `tok` has a chat template, else the code set. label: the model's name
    for the report (e.g. the --model argument). csv_path: the rows of each request are appended to it (with
    `command`) as soon as it finishes. resume: requests whose rows csv_path already holds are reused, not run (see
    eval_harness); torn rows (a run killed mid-row) are left out, and said so on stderr: their requests run again."""
    cfg = cfg or EvalConfig()
    kept = resume_rows(csv_path, log=lambda line: print(line, file=sys.stderr)) if resume and csv_path else []
    sink = (lambda rows: append_rows(csv_path, [dict(r, command=command) for r in rows])) if csv_path else None
    h = Harness(model, heads, tok, cfg, heads_dir, sink=sink, kept=kept)
    cfg = h.cfg                                               # with the scenario folder resolved
    scenarios = load_scenarios(cfg.scenarios, cfg.max_prompts, cfg.scenario_dir)
    h.ab(scenarios)
    if cfg.sweep:
        h.sweep(scenarios)
    if cfg.long_run:
        h.long_run(scenarios, cfg.long_run)
    if cfg.edge:
        h.edge(scenarios)
    if cfg.compat:
        h.compat(scenarios)
    info = dict(device=h.env["device"], interpreter=h.env["interpreter"], tree=cfg.tree,
                tree_size=h.base["tree_size"], tree_depth=h.base["tree_depth"], drafter=h.base["drafter"],
                num_heads=getattr(heads, "num_heads", None), dtype=str(model.dtype).replace("torch.", ""),
                heads_bytes=sum(p.numel() * p.element_size() for p in heads.parameters()),
                model_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
                context=h.ctx, temperature=cfg.temperature, top_p=cfg.top_p, kernels=cfg.kernels,
                cpu=model.device.type != "cuda", run_id=h.base["run_id"], kept_rows=h.kept.used, model_name=label,
                scenario_dir=os.path.relpath(cfg.scenario_dir, ROOT), scenarios=list(scenarios),
                chat_template=any("messages" in it for its in scenarios.values() for it in its))
    return EvalResult(h.rows, h.failures, info, csv_path=csv_path)


def write_outputs(result, out, command=""):
    """eval.csv (appended, unless the run already streamed its rows there), report.md and the PNGs in `out`;
    returns the report path."""
    ensure_writable_dir(out)
    csv_path = os.path.join(out, "eval.csv")
    if result.csv_path is None or os.path.abspath(result.csv_path) != os.path.abspath(csv_path):
        append_rows(csv_path, [dict(r, command=command) for r in result.rows])
    label = "(CPU)" if result.info["cpu"] else f"({result.info['device']})"
    result.info["plots"] = plot_all(result.rows, out, label)
    return write_report(result, os.path.join(out, "report.md"), command)


# ---- command line -------------------------------------------------------------------------------------------
def build_parser():
    ap = command_parser("python -m mtp_lab eval", __doc__, "model", "drafter", "heads", "tree", "temperature", "top-p",
                        "seed", "kernels", "dtype", "device", "out", model=SMOLLM2, out=os.path.join("out", "eval"))
    add_common(ap, "resume", resume=dict(help="skip requests whose rows <out>/eval.csv already holds (same "
                                             "configuration and device)"))
    ap.add_argument("--scenarios", nargs="+", default=None, help=f"subset of the chat set ({', '.join(CHAT_SCENARIOS)})"
                    f" or of the code set ({', '.join(SCENARIOS)})")
    ap.add_argument("--scenario-dir", default=None, help="default: data/scenarios_chat for a tokenizer with a chat "
                    "template, else data/scenarios")
    ap.add_argument("--max-prompts", type=int_at_least(1), default=None, help="items per scenario set (>= 1; default "
                    f"{DEFAULT_PROMPTS}: one short, one medium and one long item of each set, about 5 minutes on a "
                    "2-core CPU; --full: every item)")
    ap.add_argument("--full", action="store_true", help="every item of every scenario set (on a 2-core CPU about 15 "
                    "minutes or more)")
    ap.add_argument("--max-new-cap", type=int_at_least(1), default=None, help="cap on every item's max_new_tokens")
    ap.add_argument("--sweep", action="store_true", help="parameter sensitivity: tree depth, size and width")
    ap.add_argument("--long-run", type=int_at_least(0), default=0, metavar="N",
                    help="long-run stability over N generated tokens")
    ap.add_argument("--timeout", dest="timeout_s", metavar="TIMEOUT", type=float, default=300.0,
                    help="seconds per request before it counts as a timeout")
    ap.add_argument("--fallback", type=float, default=None, help="RuntimeConfig.fallback_threshold (off by default)")
    add_common(ap, "prune-below")
    ap.add_argument("--no-edge", dest="edge", action="store_false", help="skip the bad / edge input section")
    ap.add_argument("--edge-full-context", action="store_const", const=True, help="run the 'context at the limit' "
                    "edge case on a CPU even for a context over 2048 tokens (a prefill of the whole context)")
    add_common(ap, "quick", quick=dict(help="tiny sizes (CI): 2 items per set, <= 16 new tokens"))
    ap.add_argument("--no-progress", dest="progress", action="store_false")
    return ap


def plan_line(model, tok, cfg, calibrate_tokens=16):
    """What the run will do and about how long it takes, said before it starts: the A/B requests and their new-token
    budget (an upper bound: answers may end earlier), timed from a short serial calibration on this machine (MTP
    counted at 0.7 of serial time, the edge and compatibility checks at two 64-token requests per set; the sweep and
    the long run are extra, and the line says so)."""
    sets = load_scenarios(cfg.scenarios, cfg.max_prompts, cfg.scenario_dir)
    items = [it for v in sets.values() for it in v]
    budget = sum(min(it["max_new_tokens"], cfg.max_new_cap or it["max_new_tokens"]) for it in items)
    room = min(cfg.prompt_cap or 10 ** 9, model.config.max_position_embeddings - calibrate_tokens - 1)
    ids = prompt_ids(tok, items[0])[-room:]
    per_token = 1 / generate(model, [ids], calibrate_tokens, mtp=False, kernels=cfg.kernels).stats.decode_tokens_per_s
    minutes = (budget * 1.7 + 2 * len(sets) * 64) * per_token / 60
    extra = [w for w, on in (("--sweep", cfg.sweep), (f"--long-run {cfg.long_run}", cfg.long_run)) if on]
    return (f"eval plan: {len(items)} requests ({', '.join(f'{n} {len(v)}' for n, v in sets.items())}), up to {budget} "
            f"new tokens, each serial and with MTP, plus edge and compatibility checks; "
            f"{'under a minute' if minutes < 1 else f'about {minutes:.0f} min'} here (serial decoding {per_token * 1e3:.0f} ms/token in a {calibrate_tokens}-token calibration)"
            + (f"; {' and '.join(extra)} not counted" if extra else "")
            + ("" if cfg.max_prompts is None else "; --full runs every item"))


def _model_missing(model):
    """A message when `model` is neither a short name, a .gguf file nor a checkpoint folder, else None."""
    known = model.lower() in SHORT_NAMES or (os.path.isfile(model) and model.endswith(".gguf"))
    if not known and not os.path.exists(os.path.join(model, "config.json")):
        return (f"no model at {model!r} (config.json missing). Pass --model <checkpoint folder>, a .gguf file or a "
                f"short name ({', '.join(SHORT_NAMES)}).")
    return None


def _check_names(names, folder):
    """Set names that exist in `folder`, or (folder None: not known before the tokenizer) in either shipped set."""
    unknown = [n for n in names or () if n not in SCENARIOS + CHAT_SCENARIOS]
    if folder is not None:
        load_scenarios(names, 1, folder)
    elif unknown:
        raise ValueError(f"unknown scenario set {unknown[0]!r}; known: chat set {list(CHAT_SCENARIOS)}, code set "
                         f"{list(SCENARIOS)}")


def main(argv=None):
    """`python -m mtp_lab eval`: the exit status (0 all gates passed, 1 a gate failed, 2 bad input, 130 Ctrl-C).
    One run at a time per --out: a second one is refused (records.output_lock)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    with contextlib.ExitStack() as held:
        try:
            ensure_writable_dir(a.out)                       # before any compute: a bad --out fails now
            held.enter_context(output_lock(a.out, "an eval run"))
        except (OSError, RuntimeError) as e:                # a bad --out, or another run writing to it
            return error(e)
        return _main(a, argv)


def _main(a, argv):
    from safetensors import SafetensorError
    missing = _model_missing(a.model)
    if missing:
        return error(missing)
    a.drafter = cli_drafter(a.model, a.drafter, a.heads)
    heads_dir = a.heads or heads_dir_for(a.model, a.drafter)
    if not os.path.exists(heads_dir):
        recipe = "mtp" if a.drafter == "mtp" else "distill"
        return error(f"no {'MTP module' if a.drafter == 'mtp' else 'MTP heads'} at {heads_dir!r}. Train one (python -m "
                     f"mtp_triton train_heads {recipe} ... for a chat model) or pass --heads <folder>.")
    if a.full and a.max_prompts is not None:
        return error("--full runs every item; --max-prompts limits them: pass one of the two")
    if not (a.full or a.quick or a.max_prompts):
        a.max_prompts = DEFAULT_PROMPTS
    fields = {f.name for f in dataclasses.fields(EvalConfig)}          # the options named as the config's fields
    kw = {k: v for k, v in vars(a).items() if k in fields and v is not None}   # None: the default (or --quick's)
    try:
        cfg = EvalConfig.quick(**kw) if a.quick else EvalConfig(**kw)
        _check_names(cfg.scenarios, cfg.scenario_dir)        # typos fail now, not after loading the model
    except ValueError as e:
        return error(e)
    try:
        dtype = command_dtype(a.dtype, a.model, a.device)[0]
        model, heads, tok = load_bundle(a.model, heads_dir, a.device, dtype, a.drafter)
    except (ValueError, OSError, KeyError, RuntimeError, SafetensorError) as e:
        return error(f"could not load the model or heads from {a.model!r}: {type(e).__name__}: {e}")
    try:
        cfg = dataclasses.replace(cfg, scenario_dir=cfg.scenario_dir or default_scenario_dir(tok))
        first = load_scenarios(cfg.scenarios, 1, cfg.scenario_dir)
        for items in first.values():
            prompt_ids(tok, items[0])                        # a chat set needs a chat template: say so now
        if a.tree != "auto":                                 # 'auto' measures step costs: the harness does it once
            pick_tree(a.tree, heads, heads_dir)
    except ValueError as e:
        return error(e)
    where = "CPU (numbers are CPU numbers)" if model.device.type != "cuda" else torch.cuda.get_device_name()
    print(f"eval: {a.model} ({str(model.dtype).replace('torch.', '')}) on {where}; drafter {heads_dir}: "
          f"{'the MTP module' if a.drafter == 'mtp' else f'{heads.num_heads} heads'}"
          f"; tree {a.tree}; T={a.temperature}; scenarios "
          f"{os.path.relpath(cfg.scenario_dir, ROOT)}: {', '.join(first)}"
          + (" (chat template)" if has_chat_template(tok) else "")
          + ("; --quick (tiny sizes)" if a.quick else "") + ("; --resume" if a.resume else ""), file=sys.stderr)
    print(plan_line(model, tok, cfg), file=sys.stderr)
    t0 = time.perf_counter()
    command = "python -m mtp_lab eval " + " ".join(argv)
    csv_path = os.path.join(a.out, "eval.csv")
    with Resumable(csv_path, "request") as stop:
        result = evaluate(model, heads, tok, cfg, heads_dir, csv_path=csv_path, command=command, resume=a.resume,
                          label=a.model)
        report = write_outputs(result, a.out, command)
    if stop.rc is not None:
        return stop.rc
    for k, off, on, sp in ab_table(result.rows, "scenario"):
        print(f"{k:18s} tok/s off {off['decode_tokens_per_s']:8.1f}  on {on['decode_tokens_per_s']:8.1f}  "
              f"speedup {sp:5.2f}x  tau {on['tokens_per_step']:.2f}  TTFT ms {off['ttft_ms']:.1f} -> {on['ttft_ms']:.1f}")
    kept = f" ({result.info['kept_rows']} rows kept from earlier runs)" if result.info["kept_rows"] else ""
    print(f"wrote {report}, {csv_path}{kept} and {len(result.info['plots'])} plots in {time.perf_counter() - t0:.0f}s")
    if result.failures:
        print(f"\nFAILED: {len(result.failures)} problem(s)", file=sys.stderr)
        for f in result.failures:
            print(f, file=sys.stderr)
        return 1
    print("all gates passed")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
