"""The runtime policy: how deep each sequence drafts this step, and what it learns from the result.

Speculation pays only while drafts are accepted often enough to cover the cost of verifying them. The policy
switches it down where it does not pay, per sequence, with five rules (the first on by default on a CPU, the
others off by default):

- fallback by cost: each speculative step costs some serial steps' time (c(T) / c(1) measured, drafting included:
  `costs.StepCosts.serial_steps`) and emits some tokens; a serial step would have emitted one per serial step.
  A sequence's deficit, D <- max(0, D + cost - tokens) (a CUSUM test: it forgets what speculation gained and adds
  up what it lost since), reaching `fallback_deficit` serial steps means speculation has stopped paying: the
  sequence decodes serially for `fallback_steps` steps, twice as many after each fallback in a row (up to 8x),
  then speculates again. On wherever the tree is sized by cost (`size_by_cost`): a prompt whose drafts are rarely
  right then costs a little more than serial decoding (each try loses up to `fallback_deficit` serial steps),
  instead of paying for drafting and verifying every step. Depends on timing, so not reproducible run to run.
  With it, a sequence drafts at most one level deeper than the deepest node the pruner kept at its last step
  (drafting the levels nobody verifies is wasted: SmolLM2's heads draft 7 levels and the pruner keeps 2-3);
- cold start: the first `cold_start_tokens` new tokens of a sequence are decoded serially (depth 0), so a
  request starts exactly like the baseline and speculation begins once there is some context;
- fallback: when a sequence's acceptance rate over its last `fallback_window` speculative steps drops below
  `fallback_threshold`, it decodes serially for `fallback_steps` steps, then speculates again;
- dynamic depth, "acceptance" rule (deterministic): every `depth_window` speculative steps of a sequence, depth + 1
  if at least `accept_up` of them accepted the full depth, depth - 1 if fewer than `accept_down` did;
- dynamic depth, "throughput" rule: every `depth_window` steps, all depths + 1 when emitted tokens per second rose
  by more than `rise` since the previous window, - 1 when they fell by more than `fall` (depends on timing, so
  not reproducible run to run).

Depth d means: nodes of the candidate tree deeper than d are switched off for that sequence (their parent is set to
-1, so they cannot be accepted). Depth 0 is a serial step. Whatever the policy decides, the output is the same:
it changes only how many tokens each step can emit.

A sixth setting works inside each step rather than across steps: confidence pruning (`prune_below`, see
`step.Pruner`) verifies only the drafted nodes whose path probability under the heads is at least that value, so a
step whose drafts look unlikely verifies a smaller tree, and costs less. Its generalisation is on by default on a
CPU (`size_by_cost`, see `step.CostPruner`): each step verifies the n most probable drafted nodes, with n chosen by
their expected tokens against their measured cost (`costs.StepCosts`, this machine's c(T)). The policy feeds it
each sequence's recent record (`calibration`): how right the drafter's probabilities were, and the rate reached.
"""
import math
from collections import deque
from dataclasses import dataclass


@dataclass
class RuntimeConfig:
    """Settings of the runtime policy (see the module docstring); the rules are off by default, sizing the verified
    tree by its measured cost is on by default on a CPU (size_by_cost=None)."""
    cold_start_tokens: int = 0            # the first N new tokens of a sequence are decoded serially
    dynamic_depth: str = None             # None | "throughput" | "acceptance"
    depth_window: int = 8                 # steps per adjustment window
    start_depth: int = None               # initial per-sequence depth (default: the tree's depth)
    min_depth: int = 1
    rise: float = 0.05                    # throughput rule: depth + 1 when throughput rose by more than 5 %
    fall: float = 0.03                    # ... and - 1 when it fell by more than 3 %
    accept_up: float = 0.5                # acceptance rule: + 1 when >= 50 % of the window accepted the full depth
    accept_down: float = 0.15             # ... - 1 when < 15 % did
    fallback_threshold: float = None      # rolling acceptance rate below which a sequence decodes serially
    fallback_window: int = 8              # speculative steps in the rolling window
    fallback_steps: int = 16              # serial steps before speculation is tried again
    fallback_deficit: float = 2.0         # fallback by cost: serial steps of time lost before it decodes serially
    prune_below: float = None             # confidence pruning: verify nodes with path probability >= this only
    size_by_cost: bool = None             # verify the nodes that pay on this machine (step.CostPruner); None: on a
                                          #   CPU with a drafter that reports probabilities, when generate() got
                                          #   tree=None and prune_below is not set
    fallback_by_cost: bool = None         # serial steps while speculating is slower than serial decoding, measured;
                                          #   None: wherever size_by_cost is on (True needs size_by_cost)

    def __post_init__(self):
        if self.dynamic_depth not in (None, "throughput", "acceptance"):
            raise ValueError(f"dynamic_depth must be None, 'throughput' or 'acceptance', got {self.dynamic_depth!r}")
        for name, low in (("cold_start_tokens", 0), ("depth_window", 1), ("min_depth", 1), ("fallback_window", 1),
                          ("fallback_steps", 0), ("start_depth", 0)):
            value = getattr(self, name)
            if value is None and name == "start_depth":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RuntimeConfig: {name} must be an int >= {low}, got {value!r}")
        for name, high in (("fallback_deficit", math.inf), ("rise", math.inf), ("fall", math.inf), ("accept_up", 1.0), ("accept_down", 1.0),
                           ("fallback_threshold", 1.0)):
            value = getattr(self, name)
            if value is None and name == "fallback_threshold":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= high \
                    or math.isnan(value) or math.isinf(value):
                span = "a finite number >= 0" if high == math.inf else "a number in [0, 1]"
                raise ValueError(f"RuntimeConfig: {name} must be {span}, got {value!r}")
        if self.prune_below is not None and (isinstance(self.prune_below, bool) or not (
                isinstance(self.prune_below, (int, float)) and 0.0 < self.prune_below <= 1.0)):
            raise ValueError(f"RuntimeConfig: prune_below must be a probability in (0, 1], got {self.prune_below!r}")

        if self.size_by_cost not in (None, True, False):
            raise ValueError(f"RuntimeConfig: size_by_cost must be None (auto), True or False, got "
                             f"{self.size_by_cost!r}")
        if self.fallback_by_cost not in (None, True, False):
            raise ValueError(f"RuntimeConfig: fallback_by_cost must be None (auto), True or False, got "
                             f"{self.fallback_by_cost!r}")
        if self.size_by_cost and self.prune_below is not None:
            raise ValueError("RuntimeConfig: size_by_cost and prune_below are two ways to prune the tree; set one")

    @classmethod
    def of(cls, runtime):
        """None, a RuntimeConfig, or a dict of its fields (unknown keys refused by name) -> RuntimeConfig or None."""
        if runtime is None or isinstance(runtime, cls):
            return runtime
        if isinstance(runtime, dict):
            known = set(cls.__dataclass_fields__)
            unknown = sorted(set(map(str, runtime)) - known)
            if unknown:
                raise ValueError(f"runtime: unknown RuntimeConfig field(s) {unknown}; known: {sorted(known)}")
            return cls(**runtime)
        raise ValueError(f"runtime must be None, a RuntimeConfig or a dict of its fields, got {type(runtime).__name__}")


class RuntimePolicy:
    """Per-sequence draft depth: `depths(...)` before a step, `update(...)` after it; `calibration(rows)` for the
    cost pruner. by_cost: the fallback by cost is on (update() then gets each step's cost in serial steps)."""

    BACKOFF = 8                                               # fallback by cost: at most 8x fallback_steps serial

    def __init__(self, config, batch, max_depth, by_cost=False):
        self.cfg = config or RuntimeConfig()
        self.by_cost = by_cost
        self.recent = [deque(maxlen=self.cfg.fallback_window) for _ in range(batch)]  # (tokens, cost, acc, predicted)
        self.deficit = [0.0] * batch                          # fallback by cost: serial steps lost (CUSUM)
        self.reach = [max_depth] * batch                      # ... and the deepest node kept at the last step
        self.backoff = [1] * batch                            # the next cost fallback's multiple of fallback_steps
        self.max_depth = max_depth
        start = self.cfg.start_depth if self.cfg.start_depth is not None else max_depth
        self.depth = [min(start, max_depth)] * batch          # the depth each sequence would draft at
        self.serial_until = [0] * batch                       # fallback: serial while step < serial_until[b]
        self.window = [deque(maxlen=self.cfg.fallback_window) for _ in range(batch)]  # (accepted, depth) per step
        self.full = [deque(maxlen=self.cfg.depth_window) for _ in range(batch)]       # accepted the full depth?
        self.steps = 0
        self.tput = [0, 0.0]                                  # throughput rule: tokens, seconds in this window
        self.tput_prev = None

    def depths(self, rows, emitted, done=None):
        """Depth per row this step; rows are batch indices, emitted[b] the tokens sequence b has emitted so far."""
        out = []
        for b in rows:
            serial = (len(emitted[b]) < self.cfg.cold_start_tokens or self.steps < self.serial_until[b]
                      or (done is not None and done[b]))
            out.append(0 if serial else min(self.depth[b], self.reach[b] + 1))   # reach: max_depth unless by_cost
        return out

    def calibration(self, rows):
        """(alpha, rho) per row, from its recent speculative steps, for `step.CostPruner.weigh`:
            alpha = (accepted drafts + 1) / (predicted drafts + 1)    how right the drafter's probabilities were
            rho   = max(1, tokens / cost in serial steps)             the rate reached, in tokens per serial step
        (1, 1) without history."""
        alpha, rho = [], []
        for b in rows:
            r = self.recent[b]
            tokens, cost = sum(x[0] for x in r), sum(x[1] for x in r)
            alpha.append((sum(x[2] for x in r) + 1.0) / (sum(x[3] for x in r) + 1.0))
            rho.append(max(1.0, tokens / cost) if r and cost > 0 else 1.0)
        return alpha, rho

    def update(self, rows, depths, accepted, emitted, seconds, predicted=None, cost=None, kept_depth=None):
        """Learn from a step: per row its depth, accepted drafts and emitted tokens; the step's seconds; with by_cost
        also per row the drafts the cost pruner expected accepted and the depth of the deepest node it kept, and the
        step's cost in serial steps.
        Returns the fallbacks it began."""
        cfg = self.cfg
        self.steps += 1
        fallbacks = 0
        predicted = predicted or [0.0] * len(rows)
        kept_depth = kept_depth or [self.max_depth] * len(rows)
        for b, d, a, e, p, k in zip(rows, depths, accepted, emitted, predicted, kept_depth):
            if d == 0:
                continue
            if self.by_cost:
                self.reach[b] = k
                self.recent[b].append((e, cost, a, p))
                self.deficit[b] = max(0.0, self.deficit[b] + cost - e)
                if self.deficit[b] == 0.0:                                          # speculation pays again
                    self.backoff[b] = 1
                elif self.deficit[b] >= cfg.fallback_deficit:                       # stopped paying: serial
                    self.serial_until[b] = self.steps + cfg.fallback_steps * self.backoff[b]
                    self.backoff[b] = min(2 * self.backoff[b], self.BACKOFF)
                    self.deficit[b] = 0.0
                    for q in (self.recent, self.window, self.full):
                        q[b].clear()
                    fallbacks += 1
                    continue
            self.window[b].append((a, d))
            self.full[b].append(a >= d)
            if cfg.fallback_threshold is not None and len(self.window[b]) == cfg.fallback_window:
                rate = sum(x for x, _ in self.window[b]) / max(sum(t for _, t in self.window[b]), 1)
                if rate < cfg.fallback_threshold:
                    self.serial_until[b] = self.steps + cfg.fallback_steps
                    self.window[b].clear()
                    self.full[b].clear()
                    fallbacks += 1
                    continue
            if cfg.dynamic_depth == "acceptance" and len(self.full[b]) == cfg.depth_window:
                share = sum(self.full[b]) / cfg.depth_window
                if share >= cfg.accept_up:
                    self.depth[b] = min(self.depth[b] + 1, self.max_depth)
                elif share < cfg.accept_down:
                    self.depth[b] = max(self.depth[b] - 1, cfg.min_depth)
                self.full[b].clear()
        if cfg.dynamic_depth == "throughput":
            self.tput[0] += sum(emitted)
            self.tput[1] += seconds
            if self.steps % cfg.depth_window == 0:
                rate = self.tput[0] / max(self.tput[1], 1e-12)
                if self.tput_prev is not None:
                    change = +1 if rate > self.tput_prev * (1 + cfg.rise) else \
                        -1 if rate < self.tput_prev * (1 - cfg.fall) else 0
                    self.depth = [min(max(d + change, cfg.min_depth), self.max_depth) for d in self.depth]
                self.tput_prev, self.tput = rate, [0, 0.0]
        return fallbacks
