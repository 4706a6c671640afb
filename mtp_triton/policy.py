"""The runtime policy: how deep each sequence drafts this step, and what it learns from the result.

Speculation pays only while drafts are accepted often enough to cover the cost of verifying them. The policy
switches it off where it does not pay, per sequence, with two rules (the first on by default on a CPU, the second
off by default):

- fallback by cost: each speculative step costs some serial steps' time (c(T) / c(1) measured, drafting included:
  `costs.StepCosts.serial_steps`) and emits some tokens; a serial step would have emitted one per serial step.
  A sequence's deficit, D <- max(0, D + cost - tokens) (a CUSUM test: it forgets what speculation gained and adds
  up what it lost since), reaching `fallback_deficit` serial steps means speculation has stopped paying: the
  sequence decodes serially for `fallback_steps` steps, twice as many after each fallback in a row (up to 8x),
  then speculates again. On wherever the tree is sized by cost (`size_by_cost`): a prompt whose drafts are rarely
  right then costs a little more than serial decoding (each try loses up to `fallback_deficit` serial steps),
  instead of paying for drafting and verifying every step. Depends on timing, so not reproducible run to run.
  With it, a sequence drafts at most one level deeper than the deepest node the pruner kept at its last step
  (drafting levels nobody verifies is wasted);
- fallback: when a sequence's acceptance rate over its last `fallback_window` speculative steps drops below
  `fallback_threshold`, it decodes serially for `fallback_steps` steps, then speculates again.

Depth d means: nodes of the candidate tree deeper than d are switched off for that sequence (their parent is set to
-1, so they cannot be accepted). Depth 0 is a serial step. Whatever the policy decides, the output is the same:
it changes only how many tokens each step can emit.

Two settings work inside each step rather than across steps (`sizing`): confidence pruning (`prune_below`,
`sizing.Pruner`) verifies only the drafted nodes whose path probability under the drafter is at least that value,
so a step whose drafts look unlikely verifies a smaller tree, and costs less. Its generalisation is on by default on
a CPU (`size_by_cost`, `sizing.CostPruner`): each step verifies the n most probable drafted nodes, with n chosen by
their expected tokens against their measured cost (`costs.StepCosts`, this machine's c(T)). The policy feeds it
each sequence's recent record (`calibration`): how right the drafter's probabilities were, and the rate reached.
"""
import math
from collections import deque
from dataclasses import dataclass


@dataclass
class RuntimeConfig:
    """Settings of the runtime policy (see the module docstring); the fallback on acceptance and confidence pruning
    are off by default, sizing the verified tree by its measured cost is on by default on a CPU (size_by_cost=None)."""
    fallback_threshold: float = None      # rolling acceptance rate below which a sequence decodes serially
    fallback_window: int = 8              # speculative steps in the rolling window
    fallback_steps: int = 16              # serial steps before speculation is tried again
    fallback_deficit: float = 2.0         # fallback by cost: serial steps of time lost before it decodes serially
    prune_below: float = None             # confidence pruning: verify nodes with path probability >= this only
    size_by_cost: bool = None             # verify the nodes that pay on this machine (sizing.CostPruner); None: on a
                                          #   CPU with a drafter that reports probabilities, when generate() got
                                          #   tree=None and prune_below is not set
    fallback_by_cost: bool = None         # serial steps while speculating is slower than serial decoding, measured;
                                          #   None: wherever size_by_cost is on (True needs size_by_cost)

    def __post_init__(self):
        for name, low in (("fallback_window", 1), ("fallback_steps", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"RuntimeConfig: {name} must be an int >= {low}, got {value!r}")
        for name, high in (("fallback_deficit", math.inf), ("fallback_threshold", 1.0)):
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
        self.max_depth = max_depth
        self.recent = [deque(maxlen=self.cfg.fallback_window) for _ in range(batch)]  # (tokens, cost, acc, predicted)
        self.deficit = [0.0] * batch                          # fallback by cost: serial steps lost (CUSUM)
        self.reach = [max_depth] * batch                      # ... and the deepest node kept at the last step
        self.backoff = [1] * batch                            # the next cost fallback's multiple of fallback_steps
        self.serial_until = [0] * batch                       # fallback: serial while step < serial_until[b]
        self.window = [deque(maxlen=self.cfg.fallback_window) for _ in range(batch)]  # (accepted, depth) per step
        self.steps = 0

    def depths(self, rows, done=None):
        """Depth per row this step (rows: batch indices; done[b]: sequence b has finished, CUDA-graph mode)."""
        return [0 if self.steps < self.serial_until[b] or (done is not None and done[b])
                else min(self.max_depth, self.reach[b] + 1) for b in rows]        # reach: max_depth unless by_cost

    def calibration(self, rows):
        """(alpha, rho) per row, from its recent speculative steps, for `sizing.CostPruner.weigh`:
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

    def update(self, rows, depths, accepted, emitted, predicted=None, cost=None, kept_depth=None):
        """Learn from a step: per row its depth, accepted drafts and emitted tokens; with by_cost also per row the
        drafts the cost pruner expected accepted and the depth of the deepest node it kept, and the step's cost in
        serial steps. Returns the fallbacks it began."""
        fallbacks = 0
        self.steps += 1
        predicted = predicted or [0.0] * len(rows)
        kept_depth = kept_depth or [self.max_depth] * len(rows)
        for b, d, a, e, p, k in zip(rows, depths, accepted, emitted, predicted, kept_depth):
            if d == 0:
                continue
            if self.by_cost:
                self.reach[b] = k
                self.recent[b].append((e, cost, a, p))
                if self._cost_fallback(b, cost - e):
                    fallbacks += 1
                    continue
            self.window[b].append((a, d))
            if self._acceptance_fallback(b):
                fallbacks += 1
        return fallbacks

    def _cost_fallback(self, b, loss):
        """The fallback by cost: add a step's loss (its cost less its tokens, in serial steps) to the deficit."""
        self.deficit[b] = max(0.0, self.deficit[b] + loss)
        if self.deficit[b] == 0.0:                                                  # speculation pays again
            self.backoff[b] = 1
        elif self.deficit[b] >= self.cfg.fallback_deficit:                          # stopped paying: serial
            self.serial_until[b] = self.steps + self.cfg.fallback_steps * self.backoff[b]
            self.backoff[b] = min(2 * self.backoff[b], self.BACKOFF)
            self.deficit[b] = 0.0
            self.recent[b].clear()
            self.window[b].clear()
            return True
        return False

    def _acceptance_fallback(self, b):
        """The fallback on acceptance: the rolling rate accepted / drafted over a full window below the threshold."""
        cfg, window = self.cfg, self.window[b]
        if cfg.fallback_threshold is None or len(window) < cfg.fallback_window:
            return False
        rate = sum(a for a, _ in window) / max(sum(d for _, d in window), 1)
        if rate >= cfg.fallback_threshold:
            return False
        self.serial_until[b] = self.steps + cfg.fallback_steps
        window.clear()
        return True
