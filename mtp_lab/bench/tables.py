"""Reproduce the published speedup tables on whatever hardware runs this, and put them side by side.

    python -m mtp_lab tables --out out/tables                       # every suite (llama7b needs a GPU)
    python -m mtp_lab tables --quick --out /tmp/t                    # tiny, CPU: checks the whole path
    python -m mtp_lab tables --shape llama7b --profiles consumer80,0.9 --no-smollm2   # 7B shape, synthetic drafts
    python -m mtp_lab tables --shape --smollm2 --out out/smollm2     # only the SmolLM2 sweep

Writes <out>/tables.csv (rows appended, each with env_info() and a run_id), <out>/tables.md and <out>/tables.png
(both drawn from the CSV rows of this run). What is measured, per suite:

1. The depth sweep of an MTP-on-NPU engineering report (BM1684, Llama-7B: serial, MTP-2, MTP-4, MTP-8;
   data/published/npu_report_bm1684_llama7b.csv), measured here — serial, MTP-2/4/8 as chain-2/4/8 trees and the
   default tree: decode tok/s, ms/token, speedup, tokens/J (GPU energy from NVML; blank where it cannot be measured,
   never estimated), τ (tokens per step), acceptance per depth and whether the tokens equal serial decoding's.
     embedded  the embedded model with its trained heads (real acceptance); chain-8 only with >= 8 heads.
     smollm2   SmolLM2-135M-Instruct with its trained heads and their stored tree, a few held-out chat prompts
               (data/chat/heldout_chat.jsonl), batch 1; bf16 on a CPU, where MTP is bit-identical to serial.
               --smollm2 / --no-smollm2 (default: on when its pip package is installed, except with --quick).
     llama7b   Llama-7B shape, random bf16 weights, GPU only; drafts from the SYNTHETIC OracleDrafter at chosen
               per-depth acceptance profiles (consumer80, deepseek85/90), isolating the runtime's cost from head
               quality.
   A chain deeper than the heads is skipped, with a note printed and kept in its row.
2. The analytic model: E[tokens/step] = Tree.expected_accept_len(acc) + 1 (the bonus token), divided by the
   measured verify-step cost ratio c(T) = time(T-node verify) / time(1-node verify) (`costs.step_cost`):
        predicted speedup = (E[accepted drafts] + 1) / c(T)
   next to the measured speedup, and τ_measured / c(T) (what is left is drafting, accept, append and Python).
3. A per-phase profile (`profile_step`): draft / verify attention / other verify / accept / append / Python;
   on a GPU also a torch.profiler kernel table.
4. Hugging Face generate(do_sample=False) on the same weights as an outside serial baseline, plain and with
   prompt-lookup decoding (`e2e.PEERS`), interleaved per prompt with the sweep.
"""
import argparse
import contextlib
import os
import sys

import torch

from mtp_triton.tree import Tree
from mtp_triton.costs import step_cost
from . import e2e
from ..cli import Resumable, add_common, command_parser, error, run
from ..bundle import EMBEDDED
from .ab import SERIAL, Config
from .common import (KeptRows, append_rows, ensure_writable_dir, env_info, int_at_least, output_lock, read_rows,
                    resume_rows, write_text)
from .eval_harness import fingerprint
from .roofline import roofline_fields
from .profile_step import kernel_rows, phase_rows
from .tables_render import load_published, markdown, npu_sweep, plot  # noqa: F401  (the rendering, importable here)

CHAINS = (2, 4, 8)
DEFAULT_PROFILES = "consumer80,deepseek85,deepseek90"
# Per suite: the extra sections besides the sweep and the analytic model (the SmolLM2 suite keeps to the sweep:
# minutes on a CPU).
SECTIONS = {"embedded": dict(hf=True, phases=True), "llama7b": dict(hf=True, phases=True),
            "smollm2": dict(hf=False, phases=False)}


# ---- the analytic model -----------------------------------------------------------------------------------
def expected_tokens_per_step(tree, acc):
    """E[tokens per step] = E[accepted drafts] + 1 (the bonus token), independent per-head accuracies acc [H, K]."""
    return tree.expected_accept_len(acc) + 1.0


def analytic_speedup(tree, acc, cost_ratio):
    """Predicted speedup over serial: tokens per step / (verify-step cost relative to a 1-node step)."""
    return expected_tokens_per_step(tree, acc) / cost_ratio


def acc_from_depth_rates(rates):
    """Measured P(accept length >= d) per depth -> conditional top-1 accuracies acc [H, 1] (rank 0 only)."""
    acc, prev = [], 1.0
    for r in rates:
        acc.append([r / prev if prev > 0 else 0.0])
        prev = r
    return torch.tensor(acc, dtype=torch.float64)


# ---- one suite --------------------------------------------------------------------------------------------
def sweep_configs(drafting, tree):
    """[(name, tree or None for serial, note)]: serial, MTP-2/4/8 chains (when the heads allow), the default tree."""
    out = [("serial", None, "")]
    if drafting.dynamic:                    # the MTP module: MTP-n is its own chain (top-1, depth n), then its tree
        out += [(f"MTP-{n}", dict(depth=n, top_k=1, beam=1, nodes=n + 1), f"the module's chain of {n} (top-1)")
                for n in CHAINS]
        return out + [("tree", {}, "the module's dynamic tree (its stored settings)")]
    for n in CHAINS:
        if n <= drafting.num_heads:
            out.append((f"MTP-{n}", Tree.chain(n), f"chain-{n}"))
        else:
            out.append((f"MTP-{n}", None, f"skipped: needs {n} heads, this drafter has {drafting.num_heads}"))
    stored = getattr(drafting.heads, "tree", None) is not None
    out.append(("tree", tree, "the heads' stored tree" if stored else "default tree (tuned to the accuracies when "
                "known)"))
    return out


def suite_rows(target, draftings, max_new_tokens, *, kernels="auto", hf=True, phases=True, run_id=None,
               log=print):
    """Everything for one target: the sweep of every drafting and the transformers peers, all interleaved per
    prompt (`e2e.measure`), the analytic model, phases and kernels."""
    model = target.model
    env = env_info(model.device)
    base = dict(env, run_id=run_id or env["timestamp"], **target.row(), batch=1, max_new_tokens=max_new_tokens)
    kw = dict(kernels=kernels)
    depth = max(d.num_heads for d in draftings)
    truth = (e2e.serial_truth(model, target.prompts, max_new_tokens, depth, eos=target.eos_token_id, **kw)
             if any(d.synthetic for d in draftings) else None)                    # the oracle's proposals
    sweeps = [(d, sweep_configs(d, e2e.drafting_tree(target, d))) for d in draftings]
    configs = [Config(SERIAL, dict(kw, mtp=False))] + [
        e2e.mtp_config(f"{i}:{name}", model, d, t, truth, **kw)
        for i, (d, sweep) in enumerate(sweeps) for name, t, _ in sweep if name != "serial" and t is not None]
    rows, twin = [], None
    if hf:
        try:
            twin = e2e.hf_twin(model)
        except Exception as exc:                       # an HF version that cannot build the twin: say so, go on
            rows.append(dict(base, table="hf", provider="hf-generate", note=f"HF baseline failed: {exc!r}"[:300]))
    table, _ = e2e.measure(target, configs, max_new_tokens, hf=twin)            # with the peers when there is a twin
    log(f"[{target.suite}] serial: {table[SERIAL]['tok_s']:.1f} tok/s ({env['device']})")
    fixed = {t.paths: t for d, sweep in sweeps if not d.dynamic for _, t, _ in sweep if t is not None}
    cache_len = int(target.prompt_len) + max_new_tokens // 2
    seconds = step_cost(model, [Tree.root_only(), *fixed.values()], context=cache_len, kernels=kernels)
    verify_s = dict(zip(fixed, seconds[1:]))                                      # tree.paths -> seconds
    for i, (d, sweep) in enumerate(sweeps):
        measured = {}
        for name, t, note in sweep:
            row = dict(base, table="sweep", drafter=d.label, synthetic_drafts=d.synthetic, config=name, note=note)
            if name != "serial" and t is None:
                log(f"[{target.suite}] {d.label:28} {name:7} {note}")
                rows.append(row)
                continue
            s = table[SERIAL if name == "serial" else f"{i}:{name}"]
            measured[name] = (t, s)
            depth = t.get("depth", d.num_heads) if isinstance(t, dict) else t.max_depth if t is not None else 0
            rows.append(e2e.summary_row(row, s, depth=depth, speedup=s["vs_serial"],
                                        speedup_pct=100 * (s["vs_serial"] - 1),
                                        **roofline_fields(model, s["tok_s"], s["tau"])))
            log(f"[{target.suite}] {d.label:28} {name:7} T={s['tree_size']:<3} {s['tok_s']:8.1f} "
                f"tok/s  x{s['vs_serial']:.2f}  tau {s['tau']:.2f}")
        if not d.dynamic:                   # the analytic model prices fixed trees
            rows += analytic_rows(d, measured, seconds[0], verify_s,
                                  dict(base, drafter=d.label, synthetic_drafts=d.synthetic))
    if phases:                                          # the first drafting's tree, one prompt at a time
        d0 = draftings[0]
        tree = e2e.drafting_tree(target, d0)
        kw = dict(kw, eos_token_id=target.eos_token_id)
        mtp = e2e.mtp_config(f"tree-{tree.size}", model, d0, tree, truth, **kw)
        configs = [("serial", dict(kw, mtp=False)), (mtp.name, lambda i: mtp.kw(i, i + 1))]
        pb = dict(base, drafter=d0.label)
        rows += phase_rows(model, target.prompts, max_new_tokens, configs, pb)
        for name, ckw in configs:
            try:
                rows += kernel_rows(model, target.prompts, min(max_new_tokens, 32), name, ckw, pb)
            except Exception as exc:                   # the profiler is a diagnostic: report, do not abort
                rows.append(dict(pb, table="kernels", config=name, kernel="(torch.profiler failed)",
                                 note=repr(exc)[:300]))
    return rows + [dict(r, table="hf") for r in e2e.peer_rows(dict(base, drafter="none"), table)]


def analytic_rows(drafting, sweep, t1, verify_s, base):
    """Predicted vs measured speedup per measured MTP config (see the module docstring). sweep: {config: (tree,
    `ab.summarise` entry)}; t1, verify_s: seconds of a 1-node verify step and {tree.paths: seconds}."""
    chains = [n for n in sweep if n.startswith("MTP-")]
    acc, source = drafting.acc, ("oracle profile (exact for the synthetic drafter)" if drafting.synthetic
                                 else "heads/accuracy.json")
    if acc is None and chains:
        longest = max(chains, key=lambda n: int(n.split("-")[1]))
        acc = acc_from_depth_rates(sweep[longest][1]["accept"])
        source = f"measured {longest} acceptance (rank 0 only: a lower bound for trees)"
    ser_tps = sweep["serial"][1]["tok_s"]
    rows = []
    for name, (t, s) in sweep.items():
        if t is None:
            continue
        ratio = verify_s[t.paths] / t1
        e_tok = expected_tokens_per_step(t, acc) if acc is not None else None
        rows.append(dict(base, table="analytic", config=name, tree_size=t.size, acc_source=source if acc is not None
                         else "unknown", expected_tokens_per_step=e_tok, verify_ms_T=1e3 * verify_s[t.paths],
                         verify_ms_1=1e3 * t1, verify_cost_ratio=ratio,
                         predicted_speedup=e_tok / ratio if e_tok is not None else None,
                         tau=s["tau"], predicted_from_tau=s["tau"] / ratio, measured_speedup=s["tok_s"] / ser_tps))
    return rows


# ---- the whole run ----------------------------------------------------------------------------------------
def suite_setup(target, quick, profiles, max_new_tokens, num_prompts, kernels, hf):
    """What a suite's rows depend on besides the device, readable: the weights' fingerprints and the settings
    (--resume reuses a suite only for the same setup)."""
    heads = f" heads {fingerprint(target.heads)}" if target.heads is not None else ""
    if target.module is not None:
        heads += f" module {fingerprint(target.module)}"
    return (f"model {fingerprint(target.model)}{heads} quick {quick} profiles {profiles} max_new_tokens "
            f"{max_new_tokens} num_prompts {num_prompts} kernels {kernels} hf {hf}")


def run_tables(out, shapes=("embedded", "llama7b"), *, quick=False, device=None, model_path=EMBEDDED,
               profiles=None, max_new_tokens=None, num_prompts=None, kernels="auto", hf=True, log=print,
               command=None, smollm2_heads=None, resume=False):
    """Measure every suite that can run here, append the rows to <out>/tables.csv, write tables.md and tables.png.

    Returns (rows of this run, {"csv", "md", "png": paths}). A suite that cannot run here (llama7b on CPU without
    quick) adds one row with table="skipped" and the reason. A suite's rows are appended as soon as it finishes.
    resume: a suite whose rows tables.csv already holds for the same setup (`suite_setup`) and device is not
    measured again; its rows are part of the tables (torn rows are left out, and said so)."""
    ensure_writable_dir(out)                     # before the compute: a bad folder fails now, not after a suite
    env = env_info(device)
    run_id = env["timestamp"]
    rows, earlier = [], []
    csv_path = os.path.join(out, "tables.csv")
    kept = KeptRows(resume_rows(csv_path, log=log) if resume else [], ("setup", "device", "suite"))
    profiles = profiles or ("consumer80" if quick else DEFAULT_PROFILES)
    for shape in shapes:
        try:
            target = e2e.load_target(shape, model_path, device, quick=quick, num_prompts=num_prompts,
                                     heads_dir=smollm2_heads)
        except RuntimeError as exc:
            log(f"[{shape}] skipped: {exc}")
            rows.append(dict(env, run_id=run_id, table="skipped", suite=shape, note=str(exc)))
            continue
        n = max_new_tokens or (12 if quick else 128)
        sections = dict(SECTIONS[shape], hf=hf and SECTIONS[shape]["hf"])
        setup = suite_setup(target, quick, profiles, n, num_prompts, kernels, sections["hf"])
        again = kept.matching(lambda k: k == (setup, str(env["device"]), shape))
        if again:
            log(f"[{shape}] kept from an earlier run ({len(again)} rows of {csv_path})")
            earlier += again
            write_outputs(out, run_id, [], earlier)
            continue
        if target.model.device.type != "cuda":
            log(f"[{shape}] CPU run: these are CPU numbers (torch ops), not GPU numbers")
        if shape == "llama7b":
            draftings = [e2e.oracle_drafting(p) for p in profiles.split(",") if p.strip()]
        else:
            draftings = [e2e.heads_drafting(target)]
            if target.module is not None:
                draftings.append(e2e.module_drafting(target))      # the other drafter family, side by side
        new = suite_rows(target, draftings, n, kernels=kernels, **sections, run_id=run_id, log=log)
        new = [dict(r, suite=shape, setup=setup, **({"command": command} if command else {})) for r in new]
        rows += new
        write_outputs(out, run_id, new, earlier)  # after every suite: a later timeout keeps what was measured
        del target
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    skipped = [r for r in rows if r["table"] == "skipped"]
    return rows + earlier, write_outputs(out, run_id, skipped, earlier)


def write_outputs(out, run_id, new_rows, kept=()):
    """Append new_rows to <out>/tables.csv, then redraw tables.md and tables.png from the CSV rows of run_id and
    the `kept` rows of earlier runs (--resume)."""
    paths = {k: os.path.join(out, f"tables.{k}") for k in ("csv", "md", "png")}
    append_rows(paths["csv"], new_rows)
    mine = [r for r in read_rows(paths["csv"]) if r.get("run_id") == run_id] if os.path.exists(paths["csv"]) else []
    mine = list(kept) + mine
    published = load_published()
    write_text(paths["md"], markdown(mine, published))
    plot(mine, published, paths["png"])
    return paths


def main(argv=None):
    ap = command_parser("python -m mtp_lab tables", __doc__.splitlines()[0], "out", "quick", "model", "device",
                        out=dict(default=os.path.join("out", "tables"), help="folder for tables.csv / .md / .png"),
                        quick=dict(help="tiny sizes (CPU CI); llama7b runs at a tiny shape"),
                        model=dict(default=EMBEDDED, help="checkpoint folder with heads/ (the embedded suite)"))
    ap.add_argument("--shape", nargs="*", default=["embedded", "llama7b"], choices=["embedded", "llama7b"],
                    help="the suites besides smollm2 (none: only --smollm2)")
    ap.add_argument("--smollm2", action=argparse.BooleanOptionalAction, default=None,
                    help="the measured SmolLM2-135M-Instruct sweep (default: on when its pip package is installed, "
                         "off with --quick)")
    ap.add_argument("--smollm2-heads", default=None, help="heads for the SmolLM2 suite (default: the shipped ones, "
                    "data/smollm2-135m-instruct-heads)")
    ap.add_argument("--profiles", default=None,
                    help=f"synthetic acceptance profiles for llama7b (default {DEFAULT_PROFILES}; quick: consumer80); "
                         "names, probabilities (0.8) or per-depth lists (0.9/0.8/0.7)")
    add_common(ap, "max-new-tokens")
    ap.add_argument("--num-prompts", type=int_at_least(1), default=None)
    add_common(ap, "kernels")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    add_common(ap, "resume", resume=dict(help="skip the suites whose rows <out>/tables.csv already holds (same "
                                             "weights, settings and device)"))
    a = ap.parse_args(argv)
    smollm2 = a.smollm2 if a.smollm2 is not None else (not a.quick and e2e.smollm2_installed())
    shapes = list(a.shape) + (["smollm2"] if smollm2 else [])
    with contextlib.ExitStack() as held:
        try:                                                        # fail early: bad flags, an unwritable --out
            check_args(a, shapes)
            ensure_writable_dir(a.out)
            held.enter_context(output_lock(a.out, "a tables run"))
        except (ValueError, OSError, RuntimeError) as e:
            return error(e)
        return _run(a, argv, shapes)


def check_args(a, shapes):
    """ValueError naming the flag for what would fail (or silently measure something else) later."""
    if not shapes:
        raise ValueError("nothing to measure: give --shape or --smollm2")
    if a.profiles is not None:
        names = [p for p in a.profiles.split(",") if p.strip()]
        if not names:
            raise ValueError(f"--profiles {a.profiles!r} names no profile; e.g. --profiles consumer80,0.9")
        for p in names:
            e2e.parse_profile(p)
    if "embedded" in shapes and os.path.abspath(a.model) != os.path.abspath(EMBEDDED) and not e2e.has_embedded(a.model):
        raise ValueError(f"--model {a.model!r}: no checkpoint with trained heads there (config.json, *.safetensors "
                         "and heads/heads.safetensors); pass such a folder, or leave --model out for the embedded "
                         "model")
    if a.smollm2_heads is not None and not os.path.isdir(a.smollm2_heads):
        raise ValueError(f"--smollm2-heads {a.smollm2_heads!r}: no such folder")


def _run(a, argv, shapes):
    csv_path = os.path.join(a.out, "tables.csv")
    if not torch.cuda.is_available():
        print("no GPU: CPU run — every number below is a CPU number (torch ops" + (", tiny sizes)" if a.quick else ")"))
    with Resumable(csv_path, "suite") as stop:
        rows, paths = run_tables(a.out, shapes, smollm2_heads=a.smollm2_heads, quick=a.quick, device=a.device,
                                 model_path=a.model, profiles=a.profiles, max_new_tokens=a.max_new_tokens,
                                 num_prompts=a.num_prompts, resume=a.resume,
                                 kernels=a.kernels, hf=not a.no_hf, command="python -m mtp_lab tables " +
                                 " ".join(sys.argv[1:] if argv is None else argv))
    if stop.rc is not None:
        return stop.rc
    print(f"wrote {len(rows)} rows: {paths['csv']}, {paths['md']}, {paths['png']}")
    return 0


if __name__ == "__main__":
    sys.exit(run(main))
