"""The cost of a verify step on the running machine, c(T): measured once as a starting point, then learned from the
steps the loop runs (`LiveCosts`), read by the cost pruner.

A step that verifies T nodes costs c(T) seconds (one forward of T nodes through the target, plus their logits) and
emits 1 + (accepted drafts) tokens. On a GPU at batch 1, c(T) is nearly flat up to large T: the weights are read
once either way. On a CPU it is not, and not always monotone: oneDNN picks its matmul kernels by row count, and
the exact path's one-node step differs from a tree step (packed.py, invariant.py). So the tree worth verifying
depends on the machine, the dtype and the model — the "candidate count adjusted to the chip's load" of an
MTP-on-NPU engineering report (BM1684), made concrete.

`step_costs` times c(T) at a few sizes with `step_cost` (the one verify-step timer) and interpolates
linearly in between; the table is cached in $MTP_TRITON_CACHE (default ~/.cache/mtp-triton)/step_costs.json, one
entry per (CPU or GPU, threads, torch, dtype, model shape, kernels, batch, and the package code: a changed engine
costs otherwise), so only a machine's first run with a given version of the code pays the few seconds of measuring
(announced on stderr).
Delete the file (or an entry) to measure again. An entry that no measurement could have produced (sizes that are not
increasing ints from 1 up to MAX_SIZE, times that are not finite and positive, or c(T) / c(1) outside
[MIN_RATIO, MAX_RATIO T] = [0.25, 1.5 T]: one forward of T nodes costs no more than T forwards of one, give or
take noise, and not much less than one) is
measured again and replaced, so one damaged file cannot switch speculation off for good. Where the cache cannot be
written, the table is kept for the process (measured once, with a warning), not measured again at every call.

A table measured once is one moment of the machine: measured while another process is busy it is wrong for good, and
a busy spell later makes it wrong for as long as the spell lasts. So the loop corrects it with every step it runs
(`live_costs`: one `LiveCosts` per machine key and process, fed each verify step's seconds by `generate`):
    log c(T) = log table(T) + a + b log T
fitted by exponentially weighted least squares (half-life HALF_LIFE steps) on r = log(seconds / table(T)) against
[1, log T], with a ridge on b. The level a (how much slower or faster the machine runs now than when the table was
measured) cancels in c(T) / c(1), which is all the pruner reads; the tilt b changes the ratios, and only on evidence
from steps of several sizes (the ridge keeps the table's shape until there is). Old steps fade, so a busy spell's
tilt fades with it. Greedy output never depends on any of this: the pruner only chooses which drafts to verify.
"""
import functools
import json
import math
import os
import statistics
import sys
import time
import warnings

import torch

from .ops import cpu_model_and_flags, device_name, get_ops
from .packed import packs
from .files import write_json
from .tree import Tree
from .version import package_hash

SIZES = (1, 2, 4, 8, 16, 32, 64)          # T measured (plus the candidate tree's own size); others interpolated
MAX_SIZE, MIN_RATIO, MAX_RATIO = 4096, 0.25, 1.5    # what a stored table may hold (module docstring)
_UNCACHED = {}                            # (path, key) -> StepCosts measured where the cache cannot be written
HALF_LIFE, RIDGE, MAX_TILT = 32, 2.0, 1.0  # LiveCosts: steps until a step's weight halves; the ridge on b; |b| cap
_LIVE = {}                                # (path, key) -> this process's LiveCosts


def cache_file():
    """Where the measured tables live: $MTP_TRITON_CACHE/step_costs.json (default ~/.cache/mtp-triton)."""
    root = os.environ.get("MTP_TRITON_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "mtp-triton")
    return os.path.join(root, "step_costs.json")


def machine_key(model, kernels, batch):
    """What c(T) depends on, as one string: the processor, threads, torch, dtype, the model's shape, kernels (and
    whether the weights are prepacked, `packed.py`), batch, and the package's code (`version.package_hash`, once per
    process: any change to it measures again, rather than size trees by a step that no longer exists)."""
    c = model.config
    cpu = cpu_model_and_flags()[0] if model.device.type == "cpu" else ""
    shape = (f"L{c.num_hidden_layers} D{c.hidden_size} F{c.intermediate_size} Hq{c.num_attention_heads} "
             f"Hkv{c.num_key_value_heads} Dh{c.head_dim} V{c.vocab_size}")
    kind = f"kernels {kernels}" + (" packed" if packs(model) else "")
    return " | ".join([device_name(model.device), cpu, f"threads {torch.get_num_threads()}",
                       f"torch {torch.__version__}", str(model.dtype).replace("torch.", ""), shape, kind,
                       f"batch {batch}", f"code {_code()}"])


@functools.lru_cache(maxsize=None)
def _code():
    return package_hash()


class StepCosts:
    """c(T) at measured sizes: `seconds(T)` (linear in between) and `ratios(T)` = c(1 .. T) / c(1)."""

    def __init__(self, sizes, seconds, source="measured"):
        sizes, seconds = list(sizes), list(seconds)
        if (not sizes or any(isinstance(n, bool) or not isinstance(n, int) for n in sizes)
                or sizes != sorted(set(sizes)) or sizes[0] != 1 or sizes[-1] > MAX_SIZE or len(sizes) != len(seconds)):
            raise ValueError(f"StepCosts: sizes must be ints from 1 up to {MAX_SIZE}, increasing, one time each; got "
                             f"{sizes}, {seconds}")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
               for x in seconds):
            raise ValueError(f"StepCosts: times must be finite positive seconds, got {seconds}")
        self.sizes, self.times, self.source = list(sizes), list(seconds), source

    def seconds(self, T):
        """c(T) in seconds: measured, or linear between the two measured sizes around T (clamped at the ends)."""
        s, t = self.sizes, self.times
        if T <= s[0]:
            return t[0]
        for i in range(1, len(s)):
            if T <= s[i]:
                w = (T - s[i - 1]) / (s[i] - s[i - 1])
                return t[i - 1] + w * (t[i] - t[i - 1])
        return t[-1]

    def ratios(self, T):
        """[c(1), ..., c(T)] / c(1) as a float64 tensor [T]."""
        return torch.tensor([self.seconds(n) / self.seconds(1) for n in range(1, T + 1)], dtype=torch.float64)

    def serial_steps(self, T, seconds, draft_seconds):
        """A step of T verified nodes, measured as `seconds` of which `draft_seconds` drafting, in serial steps:
            c(T) / c(1) x seconds / (seconds - draft_seconds)
        The table's relative cost of verifying, scaled up by the measured share of drafting. Relative, so a slow
        spell of the machine, or a longer context than the table was measured at, slows both sides alike."""
        rest = seconds - draft_seconds
        return self.seconds(T) / self.seconds(1) * (seconds / rest if rest > 0 else 1.0)

    def describe(self):
        """One line for stats and logs: c(T)/c(1) at the measured sizes, and where the table came from."""
        return "c(T)/c(1) " + ", ".join(f"{n}:{x / self.times[0]:.2f}" for n, x in zip(self.sizes, self.times)) \
            + f" ({self.source})"

    def as_dict(self):
        return dict(sizes=self.sizes, seconds=self.times)


def _read(path):
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}             # no file yet, or a damaged one: measure again (and rewrite it whole)


def step_costs(model, max_nodes, kernels="auto", batch=1, path=None):
    """The StepCosts of this machine for `model` at batch `batch`, up to `max_nodes` nodes: from the cache file when
    it holds this machine's entry up to that size, else measured now (a few seconds) and stored atomically."""
    kind = get_ops(kernels, model.device).kind
    path = path or cache_file()
    key = machine_key(model, kind, batch)
    entry = _read(path).get(key)
    try:
        if entry and entry["sizes"][-1] >= max_nodes:
            stored = StepCosts(entry["sizes"], entry["seconds"], f"cached in {path}")
            if all(MIN_RATIO <= x / stored.times[0] <= MAX_RATIO * n for n, x in zip(stored.sizes, stored.times)):
                return stored
    except (KeyError, TypeError, ValueError, IndexError):
        pass                  # a malformed or implausible entry: measured again below, and replaced
    kept = _UNCACHED.get((path, key))
    if kept is not None and kept.sizes[-1] >= max_nodes:
        return kept
    sizes = sorted({n for n in SIZES if n < max_nodes} | {max_nodes})
    print(f"mtp_triton: measuring this machine's verify-step costs c(T) for T in {sizes} once (a few seconds; cached "
          f"in {path}, then corrected by every step)", file=sys.stderr)
    seconds = step_cost(model, [Tree.chain(n - 1) for n in sizes], batch=batch, kernels=kernels)
    costs = StepCosts(sizes, seconds, f"measured now, cached in {path}")
    table = _read(path)
    table[key] = costs.as_dict()
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        write_json(path, table)
    except OSError as e:
        costs.source = f"measured once in this process (not cached: cannot write {path})"
        _UNCACHED[(path, key)] = costs
        warnings.warn(f"step costs: cannot write {path} ({e.strerror or e}); the measured table is kept for this "
                      "process only. Set MTP_TRITON_CACHE to a writable folder to keep it.", stacklevel=2)
    return costs


class LiveCosts(StepCosts):
    """A stored or measured table (the prior) corrected online by the verify steps the loop runs (module docstring):
        c(T) = table(T) exp(a + b log T),   (a, b) = argmin  sum_s w_s (r_s - a - b log T_s)^2 + RIDGE b^2
    with r_s = log(seconds_s / table(T_s)) and w_s = 2^(-age_s / HALF_LIFE)."""

    def __init__(self, prior):
        super().__init__(prior.sizes, prior.times, prior.source)
        self.prior = prior
        self.sums = [0.0] * 5               # sum w, w l, w l^2, w r, w l r   (l = log T)
        self.a = self.b = 0.0
        self.steps = 0

    def observe(self, T, seconds):
        """One verify step of T nodes took `seconds` (drafting excluded)."""
        if not (seconds > 0 and math.isfinite(seconds)) or T < 1:
            return
        l, r = math.log(T), math.log(seconds / self.prior.seconds(T))
        decay = 0.5 ** (1.0 / HALF_LIFE)
        self.sums = [decay * x + y for x, y in zip(self.sums, (1.0, l, l * l, r, l * r))]
        w, wl, wll, wr, wlr = self.sums
        det = w * (wll + RIDGE) - wl * wl
        self.b = max(-MAX_TILT, min(MAX_TILT, (w * wlr - wl * wr) / det))
        self.a = (wr - self.b * wl) / w
        self.steps += 1

    def seconds(self, T):
        return self.prior.seconds(T) * math.exp(self.a + self.b * math.log(max(T, 1)))

    def describe(self):
        return (self.prior.describe() + f"; live over {self.steps} steps: x{math.exp(self.a):.2f} the table's level, "
                f"c(T) tilted by T^{self.b:+.3f}")


def live_costs(model, max_nodes, kernels="auto", batch=1, path=None):
    """This process's `LiveCosts` for the machine key of (model, kernels, batch): the learning goes on across
    `generate` calls; its prior is `step_costs(...)` (re-read, or measured up to a bigger max_nodes, when needed)."""
    prior = step_costs(model, max_nodes, kernels, batch, path)
    key = (path or cache_file(), machine_key(model, get_ops(kernels, model.device).kind, batch))
    live = _LIVE.get(key)
    if live is None or live.prior.sizes[-1] < max_nodes:
        fresh = LiveCosts(prior)
        if live is not None:                # a bigger table: the fit so far carries over
            fresh.sums, fresh.a, fresh.b, fresh.steps = live.sums, live.a, live.b, live.steps
        live = _LIVE[key] = fresh
    return live


@torch.no_grad()
def step_cost(model, trees, batch=1, context=256, kernels="auto", reps=5):
    """Median seconds of one verify step (forward over T nodes + logits) for each tree, on random tokens.

    The trees are timed in interleaved rounds (each round runs every tree once), so a slow spell of a shared
    machine slows every tree's samples alike instead of one tree's; each tree's median is over its `reps` rounds."""
    dev = model.device
    ops = get_ops(kernels, dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    context = min(context, model.config.max_position_embeddings - max(t.size for t in trees) - 1)
    cache = model.new_cache([context + max(t.size for t in trees)] * batch)
    cache.cache_lens.fill_(context)
    rows = torch.arange(batch, device=dev)
    runs = []
    for tree in trees:
        tree = tree.to(dev)
        tokens = torch.randint(0, model.config.vocab_size, (batch, tree.size), generator=g).to(dev)
        positions = context + tree.depth[None, :].expand(batch, -1)

        def run(tokens=tokens, positions=positions, mask=tree.mask):
            h, _, _ = model.forward_tree(tokens, positions, mask, cache, rows, ops, check_values=False)
            model.logits(h, model.exact_mode(ops))                    # as step.verify
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        runs.append(run)
    return interleaved_medians(runs, reps)


def interleaved_medians(runs, reps):
    """Median seconds of each function of `runs` after one warm-up call (kernel compiles), timed in interleaved
    rounds: each round calls every function once, so a slow spell of a shared machine slows every one's samples
    alike instead of one's; each median is over its `reps` rounds."""
    for run in runs:
        run()
    times = [[] for _ in runs]
    for _ in range(reps):
        for run, ts in zip(runs, times):
            t0 = time.perf_counter()
            run()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]
