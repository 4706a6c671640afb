"""The one training loop every recipe shares: AdamW, linear warm-up then cosine decay, a step *or* time budget
(whichever ends first), a progress bar, averaged loss rows, and checkpoints that a rerun resumes from.

    loop = Loop(params, LoopConfig(steps=2000, max_minutes=30, lr=1e-3, checkpoint="runs/x/ckpt.pt"),
                state=(gen.get_state, gen.set_state))     # the batch generator's position travels with it
    loop.resume()                      # 0 on a fresh start, else the step it continues from
    loop.run(step_fn, recorder)        # step_fn(step) -> {name: float}, having called .backward() itself

A recipe only writes `step_fn`: draw a batch, compute its losses, back-propagate them (a recipe that keeps one
head's logits alive at a time back-propagates head by head), and return the numbers to log. Two optional hooks:
`on_log(row)` adds columns to a logged row (a periodic held-out evaluation), `on_save()` runs with every periodic
checkpoint (to write the model in its own format too).

Every file it writes (the curve CSV and PNG, the checkpoint) goes through mtp_lab.records: a temporary file, fsync,
then one os.replace, so a kill or a full disk mid-write leaves the previous file as it was.
"""
import csv
import io
import math
import os
import time
from dataclasses import dataclass

import torch

from mtp_lab.cli import add_common, float_in, int_at_least
from mtp_lab.records import read_rows, save_torch, load_torch, write_bytes


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
    checkpoint_minutes: float = 5.0   # periodic checkpoints (and on_save); 0 / None: only the final one
    progress_interval: float = 1.0    # seconds between progress-bar refreshes
    tokens_per_step: int = None       # positions trained on per step: rows then carry `tokens` = step * this

    @classmethod
    def from_args(cls, args, desc, **overrides):
        """The settings from the shared command-line options (add_training_arguments); overrides win."""
        kw = dict(steps=args.steps, max_minutes=args.max_minutes, lr=args.lr, warmup=args.warmup,
                  log_every=args.log_every, desc=desc, checkpoint=args.checkpoint,
                  checkpoint_minutes=args.save_every_minutes, progress_interval=args.progress_interval,
                  tokens_per_step=args.batch * args.seq_len)
        return cls(**{**kw, **overrides})


def add_training_arguments(sp, min_heads=1):
    """The command-line options every training recipe takes (a recipe's add_arguments calls this first).
    Every number is range-checked by argparse (min_heads: the fewest heads the recipe can train)."""
    add_common(sp, "out", out=dict(required=True, help="output folder"))
    sp.add_argument("--data", nargs="*", help="training text (.py/.txt files in UTF-8, .jsonl with a 'text' string "
                                             "per line); default: the Python stdlib corpus (mtp_lab.corpus)")
    sp.add_argument("--cache-dir", default=None, help="where to cache the tokenized corpus")
    sp.add_argument("--num-heads", type=int_at_least(min_heads), default=4)
    sp.add_argument("--steps", type=int_at_least(1), default=1000)
    sp.add_argument("--max-minutes", type=float_in(0, low_open=True), default=60.0,
                    help="stop (and finish the LR schedule) here")
    sp.add_argument("--lr", type=float_in(0, low_open=True), default=3e-3)
    sp.add_argument("--warmup", type=int_at_least(0), default=50)
    sp.add_argument("--batch", type=int_at_least(1), default=8)
    sp.add_argument("--seq-len", type=int_at_least(2), default=512)
    add_common(sp, "seed", "device", "dtype", "threads", device="cuda" if torch.cuda.is_available() else "cpu",
               dtype=dict(default="fp32", help="autocast / storage dtype"))
    sp.add_argument("--log-every", type=int_at_least(1), default=10)
    sp.add_argument("--eval-every", type=int_at_least(1), default=100)
    sp.add_argument("--records", default=None, help="folder for metrics JSON / curve CSV+PNG (default --out)")
    sp.add_argument("--progress-interval", type=float_in(0), default=5.0, help="seconds between tqdm refreshes")
    sp.add_argument("--checkpoint", default=None,
                    help="resumable checkpoint file (parameters, optimizer, batch RNG, logged rows): written "
                         "every --save-every-minutes and at the end; a rerun with the same file continues from it")
    sp.add_argument("--save-every-minutes", type=float_in(0), default=10.0,
                    help="minutes between periodic checkpoints (joint: also writes the model folder); 0: off")


class Recorder:
    """Loss rows of a run: appended as they come, written as CSV (+ a PNG curve) at the end.

    columns: fixed columns every row starts with, e.g. Recorder(out, "train_joint", recipe="joint")."""

    def __init__(self, out_dir, name, **columns):
        self.out_dir, self.name, self.rows, self.columns = out_dir, name, [], columns

    def log(self, **row):
        self.rows.append({**self.columns, **row})

    def write(self):
        """<out_dir>/<name>_curve.csv and .png (each replaced whole, or left as it was). Returns the CSV's path."""
        if not self.rows:
            return None
        path = os.path.join(self.out_dir, f"{self.name}_curve.csv")
        keys = []
        for r in self.rows:
            keys += [k for k in r if k not in keys]
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=keys)
        w.writeheader()
        w.writerows(self.rows)
        write_bytes(path, buf.getvalue().encode("utf-8"))
        plot_curve(self.rows, path[:-4] + ".png", self.name)
        return path


def _number(v):
    """float(v) for a number or a numeric CSV string; None for a blank / missing cell."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def plot_curve(rows, path, title):
    """Every loss-like column (loss*, val*) against the training tokens when the rows count them, else the step,
    from the logged rows (never typed in): rows as logged, or as read back from the CSV (strings)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    keys = []
    for r in rows:                     # a held-out column may appear only in some rows
        keys += [k for k in r if k.startswith(("loss", "val")) and k not in keys and _number(r[k]) is not None]
    x = "tokens" if rows and all(_number(r.get("tokens")) is not None for r in rows) else "step"
    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=80)
    for k in keys:
        pts = [(_number(r[x]), _number(r.get(k))) for r in rows if _number(r.get(k)) is not None]
        ax.plot(*zip(*pts), label=k, lw=1.2, marker="o" if k.startswith("val") else None, ms=3)
    ax.set_xlabel("training tokens (positions)" if x == "tokens" else "step")
    ax.set_ylabel("loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png")
    plt.close(fig)
    write_bytes(path, png.getbuffer())


def plot_curve_csv(csv_path):
    """Re-draw <name>_curve.png from the logged rows in <name>_curve.csv. Returns the PNG's path."""
    rows = read_rows(csv_path)
    png = csv_path[:-4] + ".png"
    plot_curve(rows, png, os.path.basename(csv_path)[:-len("_curve.csv")])
    return png


class Loop:
    """AdamW over `params` (decay on matrices only), the schedule, the budgets, logging and checkpoints.

    A checkpoint holds the step, the training time so far, the parameters, the optimizer state, the extra
    `state`, the rows the recorder has logged and the sums since the last row, so a resumed run continues the
    same curve."""

    def __init__(self, params, cfg, state=None):
        """state: optional (get, set) of extra state to checkpoint (e.g. a batch generator's RNG)."""
        self.cfg = cfg
        self.params = [p for p in params if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        rest = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                      {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=cfg.betas)
        self.extra = state
        self.step, self.elapsed, self.lr = 0, 0.0, None
        self.recorder, self.resumed_rows = None, []
        self.sums, self.n = {}, 0                     # step_fn numbers summed since the last logged row

    def save(self):
        if not self.cfg.checkpoint:
            return
        blob = {"step": self.step, "elapsed": self.elapsed, "opt": self.opt.state_dict(),
                "params": [p.detach().clone() for p in self.params],
                "extra": self.extra[0]() if self.extra else None,
                "rows": list(self.recorder.rows) if self.recorder is not None else None,
                "sums": (dict(self.sums), self.n)}
        save_torch(blob, self.cfg.checkpoint)         # a kill or a full disk mid-save keeps the previous one

    def resume(self):
        """Continue from the checkpoint if there is one. Returns the step it resumed at (0: a fresh start)."""
        if not (self.cfg.checkpoint and os.path.exists(self.cfg.checkpoint)):
            return 0
        blob = load_torch(self.cfg.checkpoint, "checkpoint")
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
        self.resumed_rows = blob.get("rows") or []    # handed to the recorder by run()
        self.sums, self.n = blob.get("sums") or ({}, 0)
        return self.step

    def progress(self, started):
        run = self.elapsed + (time.time() - started)
        return max(self.step / self.cfg.steps, run / (60 * self.cfg.max_minutes))

    def run(self, step_fn, recorder=None, on_log=None, on_save=None):
        """Train until a budget ends. Returns the number of steps done (in total, across resumes).

        A row is logged at step 1 and every cfg.log_every steps: step, tokens (if cfg.tokens_per_step),
        training seconds, lr, the step_fn numbers averaged since the last row, then on_log(row)'s columns.
        on_save() runs with every periodic checkpoint (cfg.checkpoint_minutes), not with the final one."""
        from tqdm import tqdm
        cfg = self.cfg
        self.recorder = recorder
        if recorder is not None and self.resumed_rows:
            recorder.rows[:0], self.resumed_rows = self.resumed_rows, []
        periodic = bool((cfg.checkpoint or on_save) and cfg.checkpoint_minutes)
        started, last_ckpt = time.time(), time.time()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=cfg.desc, mininterval=cfg.progress_interval)
        while self.progress(started) < 1.0:
            self.lr = lr = lr_at(self.progress(started), self.step, cfg.lr, cfg.warmup)
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
                self.sums[k] = self.sums.get(k, 0.0) + float(v)
            self.n += 1
            if recorder is not None and (self.step % cfg.log_every == 0 or self.step == 1):
                row = {"step": self.step}
                if cfg.tokens_per_step:
                    row["tokens"] = self.step * cfg.tokens_per_step
                row.update(elapsed_s=round(self.elapsed + time.time() - started, 1), lr=lr,
                           **{k: v / self.n for k, v in self.sums.items()})
                row.update((on_log(row) if on_log else None) or {})
                recorder.log(**row)
                self.sums, self.n = {}, 0
            if periodic and time.time() - last_ckpt > 60 * cfg.checkpoint_minutes:
                self.elapsed += time.time() - started
                started = last_ckpt = time.time()
                self.save()
                if on_save:
                    on_save()
        bar.close()
        self.elapsed += time.time() - started
        self.save()
        return self.step
