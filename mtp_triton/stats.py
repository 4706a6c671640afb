"""What a `generate` call measured: a typed record with one definition (and unit) per field, and its recorder.

The decoding loop only reports events to a `StatsRecorder` (prefill done, one step's acceptances and emitted
tokens, the end); timing, latency percentiles, memory and energy are computed here, outside the hot loop.

Vocabulary: a *step* is one verify forward for the whole batch; a *sequence-step* is one sequence taking part in a
step (a batch of 3 that runs 10 steps with every sequence live makes 30 sequence-steps). *Decode tokens* are the
new tokens after the first one (the first comes from prefill, not from a step).
"""
import dataclasses
import math
import time
from collections import Counter
from dataclasses import dataclass

import torch


@dataclass
class GenerateStats:
    steps: int                      # verify forwards after prefill (the batch counted once per step)
    new_tokens: int                 # tokens emitted over all sequences, the prefill token included
    tokens_per_step: float          # tau = decode tokens / sequence-steps (bonus included; nan without steps)
    accept_rate_per_depth: list     # [d - 1] = share of sequence-steps whose tree reached depth d that accepted >= d
    accept_len_histogram: list      # [a] = sequence-steps that accepted exactly a drafts
    fallback_count: int             # times a sequence fell back to serial decoding (low acceptance)
    time_draft_s: float             # seconds in drafting (all heads, top-k), summed over steps
    time_verify_s: float            # seconds in the verify forward + logits
    time_accept_s: float            # seconds in tree acceptance
    time_append_s: float            # seconds appending accepted K/V and updating the cache
    ttft_s: float                   # seconds from the call to the first token (prefill included)
    total_s: float                  # seconds of the whole call
    itl_p50_s: float                # inter-token latency percentiles, seconds: a step's time / tokens it emitted,
    itl_p95_s: float                #   one sample per emitted decode token (None without decode tokens)
    itl_p99_s: float
    tokens_per_s: float             # new_tokens / total_s
    decode_tokens_per_s: float      # decode tokens / (total_s - ttft_s)
    peak_memory_bytes: int          # CUDA: max allocated in the call; CPU: the process's RSS high-water mark
    energy_j: float                 # GPU energy over the call from NVML (None where it cannot be measured)
    kernels: str                    # "triton", "torch" or "compiled": which implementation ran
    tree_size: int                  # nodes of the full candidate tree, root included (1 = serial)
    verified_nodes_per_step: float  # mean nodes per verify forward, root included (< tree_size with pruning or
                                    #   a shallower runtime depth; nan without steps)
    cache_bytes: int                # bytes of the paged K/V cache allocated for the call
    cost_model: str = None          # the verify-step costs that sized each step's tree (`costs.StepCosts.describe`;
                                    #   None when the whole tree was verified, or it was pruned by a threshold)

    def as_dict(self):
        """Plain dict (lists copied), for CSV rows and JSON."""
        return dataclasses.asdict(self)


def percentile(xs, q):
    """The q-th percentile by the nearest-rank rule (no interpolation); None for an empty list."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def peak_memory_bytes(device):
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024   # Linux reports KiB
    except Exception:
        return None


def gpu_energy_j(device):
    """Cumulative energy of the GPU in joules from NVML (pynvml), or None where it cannot be read."""
    try:
        import pynvml
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(torch.device(device).index or 0)
        return pynvml.nvmlDeviceGetTotalEnergyConsumption(h) * 1e-3       # mJ -> J
    except Exception:
        return None


class PhaseTimer:
    """Seconds per phase; on CUDA with events, so nothing syncs until `result()`."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        self.total = Counter()
        self.events = []

    def start(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def stop(self, name, t0):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.events.append((name, t0, e))
        else:
            self.total[name] += time.perf_counter() - t0

    def result(self):
        if self.cuda:
            torch.cuda.synchronize()
            for name, a, b in self.events:
                self.total[name] += a.elapsed_time(b) * 1e-3
            self.events = []                      # folded in: result() can be called again
        return self.total


class StatsRecorder:
    """Collects what the loop reports and builds the `GenerateStats` at the end."""

    def __init__(self, device, batch):
        self.device = torch.device(device)
        self.batch = batch
        self.timer = PhaseTimer(self.device)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self.energy0 = gpu_energy_j(self.device) if self.device.type == "cuda" else None
        self.t_start = time.perf_counter()
        self.ttft = None
        self.steps = self.seq_steps = self.fallbacks = 0
        self.accept_hist, self.reached, self.accepted_at = Counter(), Counter(), Counter()
        self.itl = []
        self.nodes = 0

    def first_token(self):
        self.ttft = time.perf_counter() - self.t_start

    def step(self, seconds, accepted, depths, emitted, nodes=None):
        """One step: per live sequence its accepted drafts, its allowed depth and the tokens it emitted; nodes: the
        size of the tree the step verified."""
        self.steps += 1
        self.nodes += nodes or 0
        for a, d in zip(accepted, depths):
            self.seq_steps += 1
            self.accept_hist[a] += 1
            for k in range(1, d + 1):
                self.reached[k] += 1
                self.accepted_at[k] += a >= k
        n = sum(emitted)
        self.itl += [seconds / max(n, 1)] * n

    def finish(self, new_tokens, kernels, tree_size, cache_bytes, cost_model=None):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        total = time.perf_counter() - self.t_start
        ttft = self.ttft if self.ttft is not None else total
        phases = self.timer.result()
        decode = new_tokens - self.batch
        depth = max(self.reached) if self.reached else 0
        energy = None
        if self.energy0 is not None:
            e1 = gpu_energy_j(self.device)
            energy = None if e1 is None else e1 - self.energy0
        return GenerateStats(
            steps=self.steps, new_tokens=new_tokens,
            tokens_per_step=decode / self.seq_steps if self.seq_steps else float("nan"),
            accept_rate_per_depth=[self.accepted_at[d] / self.reached[d] for d in range(1, depth + 1)],
            accept_len_histogram=[self.accept_hist[i] for i in range(max(self.accept_hist, default=0) + 1)],
            fallback_count=self.fallbacks,
            time_draft_s=phases["draft"], time_verify_s=phases["verify"], time_accept_s=phases["accept"],
            time_append_s=phases["append"], ttft_s=ttft, total_s=total,
            itl_p50_s=percentile(self.itl, 50), itl_p95_s=percentile(self.itl, 95),
            itl_p99_s=percentile(self.itl, 99),
            tokens_per_s=new_tokens / total, decode_tokens_per_s=decode / max(total - ttft, 1e-12),
            peak_memory_bytes=peak_memory_bytes(self.device), energy_j=energy, kernels=kernels,
            tree_size=tree_size, cache_bytes=cache_bytes, cost_model=cost_model,
            verified_nodes_per_step=self.nodes / self.steps if self.steps else float("nan"))
