"""The one training loop every recipe shares: AdamW, linear warm-up then cosine decay, a step *or* time budget
(whichever ends first), a progress bar, averaged loss rows, and checkpoints that a rerun resumes from.

    loop = Loop(params, LoopConfig(steps=2000, max_minutes=30, lr=1e-3, checkpoint="runs/x/ckpt.pt"))
    loop.run(step_fn, recorder)        # step_fn(step) -> {name: float}, having called .backward() itself

A recipe only writes `step_fn`: draw a batch, compute its losses, back-propagate them (a recipe that keeps one
head's logits alive at a time back-propagates head by head), and return the numbers to log.
"""
import csv
import json
import math
import os
import time
from dataclasses import dataclass

import torch


def lr_at(progress, step, base_lr, warmup, min_frac=0.1):
    """Linear warm-up for `warmup` steps, then cosine from base_lr to min_frac * base_lr at progress 1."""
    if step < warmup:
        return base_lr * (step + 1) / warmup
    return base_lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@dataclass
class LoopConfig:
    steps: int                        # step budget
    max_minutes: float = 1e9          # time budget (training time, summed over resumed runs)
    lr: float = 1e-3
    warmup: int = 50
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    clip: float = None                # gradient-norm clip (None: off)
    log_every: int = 50
    desc: str = "train"
    checkpoint: str = None            # path of a checkpoint to write (and resume from)
    checkpoint_minutes: float = 5.0
    progress_interval: float = 1.0    # seconds between progress-bar refreshes


class Recorder:
    """Loss rows of a run: appended as they come, written as CSV (+ a PNG curve) at the end."""

    def __init__(self, out_dir, name):
        self.out_dir, self.name, self.rows = out_dir, name, []

    def log(self, **row):
        self.rows.append(row)

    def write(self):
        if not self.rows:
            return None
        os.makedirs(self.out_dir, exist_ok=True)
        path = os.path.join(self.out_dir, f"{self.name}_curve.csv")
        keys = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(self.rows)
        plot_curve(self.rows, path[:-4] + ".png", self.name)
        return path


def plot_curve(rows, path, title):
    """Every loss-like column against the step, from the logged rows (never typed in)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = [k for k in rows[0] if k.startswith(("loss", "val")) and isinstance(rows[0][k], (int, float))]
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        if pts:
            ax.plot(*zip(*pts), label=k, lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


class Loop:
    """AdamW over `params` (decay on matrices only), the schedule, the budgets, logging and checkpoints."""

    def __init__(self, params, cfg, state=None):
        """state: optional (get, set) of extra state to checkpoint (e.g. a batch generator's RNG)."""
        self.cfg = cfg
        self.params = [p for p in params if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
        self.extra = state
        self.step, self.elapsed = 0, 0.0

    def save(self):
        if not self.cfg.checkpoint:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.cfg.checkpoint)), exist_ok=True)
        blob = {"step": self.step, "elapsed": self.elapsed, "opt": self.opt.state_dict(),
                "params": [p.detach().clone() for p in self.params],
                "extra": self.extra[0]() if self.extra else None}
        tmp = self.cfg.checkpoint + ".tmp"
        torch.save(blob, tmp)
        os.replace(tmp, self.cfg.checkpoint)          # a kill mid-save keeps the previous checkpoint

    def resume(self):
        """Continue from the checkpoint if there is one. Returns the step it resumed at (0: a fresh start)."""
        if not (self.cfg.checkpoint and os.path.exists(self.cfg.checkpoint)):
            return 0
        blob = torch.load(self.cfg.checkpoint, weights_only=False)
        if len(blob["params"]) != len(self.params) or any(a.shape != b.shape for a, b in zip(blob["params"],
                                                                                            self.params)):
            raise ValueError(f"{self.cfg.checkpoint} does not match these parameters (another configuration?)")
        with torch.no_grad():
            for p, v in zip(self.params, blob["params"]):
                p.copy_(v)
        self.opt.load_state_dict(blob["opt"])
        self.step, self.elapsed = blob["step"], blob["elapsed"]
        if self.extra and blob["extra"] is not None:
            self.extra[1](blob["extra"])
        return self.step

    def progress(self, started):
        run = self.elapsed + (time.time() - started)
        return max(self.step / self.cfg.steps, run / (60 * self.cfg.max_minutes))

    def run(self, step_fn, recorder=None):
        """Train until a budget ends. Returns the number of steps done (in total, across resumes)."""
        from tqdm import tqdm
        cfg = self.cfg
        started, last_ckpt = time.time(), time.time()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=cfg.desc, mininterval=cfg.progress_interval)
        sums, n = {}, 0
        while self.progress(started) < 1.0:
            lr = lr_at(self.progress(started), self.step, cfg.lr, cfg.warmup)
            for g in self.opt.param_groups:
                g["lr"] = lr
            self.opt.zero_grad(set_to_none=True)
            parts = step_fn(self.step)
            if cfg.clip:
                torch.nn.utils.clip_grad_norm_(self.params, cfg.clip)
            self.opt.step()
            self.step += 1
            bar.update(1)
            for k, v in parts.items():
                sums[k] = sums.get(k, 0.0) + float(v)
            n += 1
            if recorder is not None and (self.step % cfg.log_every == 0 or self.step == 1):
                recorder.log(step=self.step, elapsed_s=round(self.elapsed + time.time() - started, 1), lr=lr,
                             **{k: v / n for k, v in sums.items()})
                sums, n = {}, 0
            if cfg.checkpoint and time.time() - last_ckpt > 60 * cfg.checkpoint_minutes:
                self.elapsed += time.time() - started
                started = last_ckpt = time.time()
                self.save()
        bar.close()
        self.elapsed += time.time() - started
        self.save()
        return self.step
