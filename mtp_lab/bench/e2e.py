"""End-to-end A/B on the same weights: our engine serial vs MTP, and Hugging Face `generate()` as an outside
serial baseline.

    python -m mtp_lab.bench.e2e --out results/e2e.csv                   # the embedded model (real heads)
    python -m mtp_lab.bench.e2e --shape llama7b --out results/e2e.csv   # Llama-7B-shaped random weights, bf16 (GPU)

What is timed (gpt-fast's convention): decode tokens/s = (new tokens − 1 per sequence) / (wall time − time to
first token), summed over the prompts; warm-up runs are not timed. Hugging Face is timed the same way:
generate(max_new_tokens=N) minus generate(max_new_tokens=1) on the same prompt, so both sides exclude prefill.

Targets (`load_target`):
  embedded  data/tiny-stdlib-llama with its trained heads (or another checkpoint folder with heads/).
  smollm2   SmolLM2-135M-Instruct (the pip-packaged GGUF, bf16 on a CPU: the engine's exact mode) with its trained
            heads (data/smollm2-135m-instruct-heads), on held-out chat prompts in the chat template, batch 1.
  llama7b   Llama-2-7B's shape (32 layers, D 4096, V 32000) with random weights in bf16 — GPU only; on CPU
            `quick=True` swaps in a tiny shape to exercise the path. Random heads would accept nothing, so its
            drafts come from the SYNTHETIC `OracleDrafter` at a chosen per-depth acceptance (`parse_profile`):
            verification stays real, only the drafter is simulated, which isolates the runtime's own cost.
"""
import json
import os
import sys
from dataclasses import dataclass

import torch

from mtp_triton.loading import packaged_file
from mtp_triton.drafters import OracleDrafter
from mtp_triton.ops import get_ops
from mtp_triton.model import LlamaEngine, ModelConfig
from mtp_triton.mtp_module import MTPModule, is_module_folder
from mtp_triton.stats import gpu_energy_j  # noqa: F401  (kept importable as e2e.gpu_energy_j)
from mtp_triton.tree import get_tree
from ..bundle import (CHAT_PROMPTS, EMBEDDED, PROMPTS, SMOLLM2, encode, heads_dir_for, load_bundle, load_embedded,
                      pick_prompts, pick_tree, read_accuracy, read_prompts)
from ..cli import add_common, command_parser
from .common import ensure_writable_dir, env_info, save_rows
from .ab import SERIAL, Config, resolved, run_prompts, summarise, warm_up
from .hf_baseline import PROMPT_LOOKUP, hf_twin, time_hf  # noqa: F401  (the HF baseline, kept importable from here)

# Llama-2-7B (Touvron et al. 2023): 6.7 B parameters, 13.5 GB in bf16.
LLAMA7B = dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=32, head_dim=128, rms_norm_eps=1e-5,
               max_position_embeddings=4096)
# The same proportions, tiny: exercises the llama7b path on CPU (--quick). Not a 7B measurement.
LLAMA7B_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, head_dim=16, rms_norm_eps=1e-5,
                    max_position_embeddings=1024)

# Per-depth acceptance profiles for the synthetic drafter: the probability that depth d's top-1 draft is right
# given its parent was (constant over depth here). consumer80: the "about 80 % draft acceptance" that an evaluation
# framework for MTP on local quantised models quotes for a ~27B model on a consumer GPU
# (data/published/mtp_eval_consumer_gpu.csv); deepseek85/90: DeepSeek-V3's 85–90 % second-token acceptance
# (https://arxiv.org/abs/2412.19437), extended to every depth (an optimistic reading).
PROFILES = {"consumer80": 0.80, "deepseek85": 0.85, "deepseek90": 0.90}
ORACLE_DEPTH = 8


def parse_profile(spec, depth=ORACLE_DEPTH):
    """'consumer80' | '0.7' | '0.9/0.8/0.7' -> (label, [p_1 .. p_depth]); a short list repeats its last entry."""
    if spec in PROFILES:
        return spec, [PROFILES[spec]] * depth
    try:
        ps = [float(x) for x in str(spec).split("/")]
    except ValueError:
        raise ValueError(f"unknown acceptance profile {spec!r}: use one of {sorted(PROFILES)}, a probability "
                         "like 0.8, or per-depth values like 0.9/0.8/0.7") from None
    if not ps or not all(0.0 <= p <= 1.0 for p in ps):
        raise ValueError(f"acceptance profile {spec!r}: entries must be probabilities in [0, 1]")
    ps = (ps + [ps[-1]] * depth)[:depth]
    return f"p{spec}", ps


def oracle_acc(profile, top_k=2):
    """Per-head, per-rank accuracies acc [H, top_k] of `OracleDrafter` at this profile.

    The oracle puts the true token at rank 0 with probability p_h, else at rank 1 with probability p_h, and
    never at a lower rank: acc[h, 0] = p_h, acc[h, 1] = (1 − p_h) p_h, acc[h, r >= 2] = 0.
    """
    p = torch.tensor(profile, dtype=torch.float64)
    acc = torch.zeros(len(profile), top_k, dtype=torch.float64)
    acc[:, 0] = p
    if top_k > 1:
        acc[:, 1] = (1 - p) * p
    return acc


# ---- targets ----------------------------------------------------------------------------------------------
@dataclass
class Target:
    """A model to measure, with its prompts and where its drafts come from."""
    suite: str                  # "embedded" | "smollm2" | "llama7b"
    model: LlamaEngine
    prompts: list               # list of token-id lists
    description: str            # one line: what this is (and what it is not)
    heads: object = None        # MTPHeads, or None when drafts are synthetic
    heads_dir: str = None
    eos_token_id: object = None
    module: object = None       # an MTP module (mtp_module.MTPModule) for the same model, when one is shipped

    @property
    def prompt_len(self):
        return round(sum(len(p) for p in self.prompts) / len(self.prompts), 1)

    def row(self):
        """The columns every measured row of this target carries."""
        m = self.model
        return dict(suite=self.suite, model=self.description, model_params_M=round(
            sum(p.numel() for p in m.parameters()) / 1e6, 2), dtype=str(m.dtype).replace("torch.", ""),
            layers=m.config.num_hidden_layers, hidden=m.config.hidden_size, vocab=m.config.vocab_size,
            num_prompts=len(self.prompts), prompt_len=self.prompt_len)


def has_embedded(path=EMBEDDED):
    """True when `path` holds a loadable checkpoint (config.json, *.safetensors) and heads/."""
    return (os.path.exists(os.path.join(path, "config.json"))
            and any(f.endswith(".safetensors") for f in os.listdir(path))
            and os.path.exists(os.path.join(path, "heads", "heads.safetensors")))


def random_engine(cfg, device, dtype, seed=0):
    """A LlamaEngine with seeded random weights, built directly on `device` (a 7B model never touches the CPU)."""
    cfg = cfg if isinstance(cfg, ModelConfig) else ModelConfig(**cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = LlamaEngine(cfg)
    return model.to(dtype).eval()


def _code_prompts(tokenizer, n, prompt_len):
    """The first n prompts of data/prompts, tokenized, each cut to its last prompt_len tokens."""
    texts = [r["text"] for r in read_prompts(PROMPTS, n)]
    return [tokenizer(t)["input_ids"][-prompt_len:] for t in texts]


def _random_prompts(vocab, n, prompt_len, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, prompt_len), generator=g).tolist()


def load_target(suite, model_path=EMBEDDED, device=None, quick=False, num_prompts=None, prompt_len=None,
                seed=0, heads_dir=None, dtype=None):
    """Build the model to measure. Raises RuntimeError (with the reason) when a suite cannot run here.

    model_path: the embedded suite's checkpoint; heads_dir: the smollm2 suite's heads (default: the shipped ones);
    dtype: the llama7b suite's weights (default bf16 on a GPU, fp32 on a CPU; the other suites keep their own)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    if suite == "embedded":
        if not has_embedded(model_path):
            raise RuntimeError(f"embedded: no checkpoint with trained heads at {model_path} (config.json, "
                               "*.safetensors and heads/heads.safetensors)")
        n, plen = num_prompts or (1 if quick else 4), prompt_len or (24 if quick else 128)
        model, heads, tok = load_embedded(model_path, device=device)
        return Target("embedded", model, _code_prompts(tok, n, plen),
                      f"{os.path.basename(os.path.normpath(model_path))} (trained heads)", heads=heads,
                      heads_dir=os.path.join(model_path, "heads"), eos_token_id=tok.eos_token_id)
    if suite == "smollm2":
        return _smollm2_target(device, num_prompts or (1 if quick else 3), heads_dir)
    if suite == "llama7b":
        if not gpu and not quick:
            raise RuntimeError("llama7b: a 7B model in bf16 needs a GPU (13.5 GB of weights); skipped on CPU "
                               "(use --quick to exercise the path at a tiny shape)")
        shape = LLAMA7B_TINY if quick and not gpu else LLAMA7B
        dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
        n, plen = num_prompts or (1 if quick else 2), prompt_len or (16 if quick else 128)
        model = random_engine(shape, device, dtype, seed)
        name = "Llama-7B shape, random weights" if shape is LLAMA7B else "Llama-7B proportions, TINY (CPU path check)"
        return Target("llama7b", model, _random_prompts(model.config.vocab_size, n, plen, seed), name)
    raise ValueError(f"unknown suite {suite!r} (embedded | smollm2 | llama7b)")


def smollm2_installed():
    """True when the pip package that ships SmolLM2-135M-Instruct is installed."""
    try:
        packaged_file(SMOLLM2)
        return True
    except FileNotFoundError:
        return False


def _smollm2_target(device, n, heads_dir=None):
    """SmolLM2-135M-Instruct with its heads on the first n held-out chat prompts, one per category (bundle.encode:
    the chat template). RuntimeError when the package or the heads are missing."""
    hd = heads_dir or heads_dir_for(SMOLLM2)
    try:
        packaged_file(SMOLLM2)
    except FileNotFoundError as e:
        raise RuntimeError(f"smollm2: {e}") from None
    if not os.path.exists(hd):
        raise RuntimeError(f"smollm2: no MTP heads at {hd} (train them: python -m mtp_lab train_heads distill; "
                           "or pass --smollm2-heads <folder>)")
    model, heads, tok = load_bundle(SMOLLM2, hd, str(device))          # on a CPU: bf16 (the demo's choice)
    md = heads_dir_for(SMOLLM2, "mtp")
    module = load_bundle(SMOLLM2, md, str(device), drafter="mtp")[1] if heads_dir is None and is_module_folder(
        md) else None                                                  # the other family, side by side
    rows = pick_prompts(read_prompts(CHAT_PROMPTS), 1)[:n]
    dtype, where = str(model.dtype).replace("torch.", ""), os.path.basename(os.path.normpath(hd))
    return Target("smollm2", model, [encode(tok, r["text"]) for r in rows],
                  f"SmolLM2-135M-Instruct (GGUF Q4_1 dequantised to {dtype}; heads {where})",
                  heads=heads, heads_dir=hd, eos_token_id=tok.eos_token_id, module=module)


# ---- drafting sources -------------------------------------------------------------------------------------
@dataclass
class Drafting:
    """Where MTP drafts come from: trained heads, an MTP module (dynamic: it draws its own tree; a "tree" here is
    a dict of its draft settings, mtp_module.DRAFT_DEFAULTS' keys), or the synthetic oracle at a per-depth profile."""
    label: str
    num_heads: int
    heads: object = None
    profile: list = None        # oracle only
    acc: object = None          # [H, K] per-head, per-rank accuracies, when known (the analytic model uses them)
    seed: int = 0

    @property
    def synthetic(self):
        return self.profile is not None

    @property
    def dynamic(self):
        return isinstance(self.heads, MTPModule)

    def kwargs(self, truth, vocab_size, offset=0, tree=None):
        """generate() keyword arguments for the sequences whose serial continuations are `truth`, with `tree` (for
        the MTP module: None for its defaults, or a dict of draft settings)."""
        if self.dynamic:
            return dict(heads=self.heads.with_draft(**(tree or {})))
        if self.profile is None:
            return dict(heads=self.heads, tree=tree)
        return dict(drafter=OracleDrafter(truth, self.profile, vocab_size, seed=self.seed + offset), tree=tree)


def heads_drafting(target):
    acc = read_accuracy(target.heads_dir, target.heads.num_heads)[0] if target.heads_dir else None
    return Drafting("heads", target.heads.num_heads, heads=target.heads, acc=acc)


def module_drafting(target):
    return Drafting("MTP module", target.module.draft["depth"], heads=target.module)


def oracle_drafting(spec, seed=0):
    label, profile = parse_profile(spec)
    return Drafting(f"oracle {label} (SYNTHETIC)", len(profile), profile=profile, acc=oracle_acc(profile),
                    seed=seed)


def drafting_tree(target, drafting, budget=16):
    """The tree a user would get: for trained heads `bundle.pick_tree('stored')` (the tree stored with them, else
    tuned to heads/accuracy.json, else the preset); for the oracle, the best `budget`-node tree for its accuracies;
    None for the MTP module (it draws its own tree every step)."""
    if drafting.dynamic:
        return None
    if not drafting.synthetic:
        return pick_tree("stored", drafting.heads, target.heads_dir)
    return get_tree("tuned", drafting.num_heads, accuracy=drafting.acc, budget=budget)


# ---- running and timing (the A/B core, `ab`) --------------------------------------------------------------
PEERS = (Config("hf-generate", peer=True), Config("hf-prompt-lookup", dict(prompt_lookup=PROMPT_LOOKUP), peer=True))
PEER_CONFIG = {"hf-generate": "serial", "hf-prompt-lookup": f"prompt-lookup-{PROMPT_LOOKUP}"}   # rows' `config`


def serial_truth(model, prompts, max_new_tokens, depth, batch=1, eos=None, **kw):
    """The serial continuations the oracle proposes from (depth extra tokens, so the last step can draft too)."""
    return run_prompts(model, prompts, max_new_tokens + depth, [Config(SERIAL, dict(kw, mtp=False))],
                       batch=batch, eos=eos)[1][SERIAL]


def mtp_config(name, model, drafting, tree, truth=None, **kw):
    """The MTP configuration of a drafting: its generate() keyword arguments for the prompts [lo, hi) (an oracle's
    drafts come from those prompts' serial continuations `truth`)."""
    V = model.config.vocab_size
    return Config(name, lambda lo, hi: dict(kw, **drafting.kwargs(truth[lo:hi] if truth else None, V, lo, tree)))


def measure(target, configs, max_new_tokens, *, batch=1, hf=None, reference=SERIAL):
    """The configurations, and the transformers PEERS when there is a twin `hf` and batch is 1, interleaved on every
    group of `batch` prompts, after one warm-up of each (`ab.warm_up`).
    -> ({config: `ab.summarise` entry}, {config: tokens of every prompt})."""
    prompts, eos = target.prompts, target.eos_token_id
    configs = configs + (list(PEERS) if hf is not None and batch == 1 else [])
    warm_up(target.model, prompts[:batch], resolved(configs, 0, min(batch, len(prompts))), hf=hf, eos=eos,
            max_new=min(16, max_new_tokens))
    rows, tokens = run_prompts(target.model, prompts, max_new_tokens, configs, batch=batch, hf=hf, eos=eos,
                               reference=reference)
    return summarise(rows, reference=reference), tokens


def summary_row(base, s, **extra):
    """One measured CSV row of e2e and tables from an `ab.summarise` entry s."""
    nan = float("nan")
    mib = s["peak_memory_bytes"] / 2 ** 20 if s["peak_memory_bytes"] is not None else None
    return dict(base, tree_size=s["tree_size"], kernels=s["kernels"], tokens_per_s=s["tok_s"],
                ms_per_token=1e3 / s["tok_s"], speedup_vs_serial=s["vs_serial"],
                tau=s["tau"] if s["tau"] is not None else nan,
                accept_rate_per_depth=json.dumps([round(x, 4) for x in s["accept"]]), ttft_ms=1e3 * s["ttft_s"],
                peak_memory_MB=mib, energy_j=s["energy_j"], tokens_per_j=s["tokens_per_j"],
                identical_to_serial=s["identical"] == s["prompts"], **extra)


def peer_rows(base, table):
    """The transformers rows (PEERS) of a `measure` table, if it has them: greedy and prompt-lookup generate vs our
    serial engine."""
    return [summary_row(dict(base, provider=cfg.name, batch=1, config=PEER_CONFIG[cfg.name]), s,
                        note=f"{cfg.name} vs our serial engine (batch 1): {s['identical']}/{s['prompts']} "
                             "sequences token-identical; speedup_vs_serial = its tok/s / ours")
            for cfg in PEERS if (s := table.get(cfg.name))]


# ---- the A/B ----------------------------------------------------------------------------------------------
def ab_rows(target, drafting, max_new_tokens, batches=(1,), tree=None, kernels="auto", hf=True, run_id=None):
    """Serial vs MTP on our engine at each batch size (on a GPU both also with the verify step as a CUDA graph),
    plus transformers' greedy and prompt-lookup generate (batch 1) on the same weights, all interleaved per group
    of prompts."""
    model, dev = target.model, target.model.device
    env = env_info(dev)
    tree = tree or drafting_tree(target, drafting)
    base = dict(env, table="e2e", run_id=run_id or env["timestamp"], **target.row(),
                max_new_tokens=max_new_tokens, drafter=drafting.label, synthetic_drafts=drafting.synthetic)
    kw = dict(kernels=kernels)
    twin = hf_twin(model) if hf else None
    rows = []
    for batch in batches:
        truth = serial_truth(model, target.prompts, max_new_tokens, drafting.num_heads, batch,
                             target.eos_token_id, **kw) if drafting.synthetic else None
        configs = [Config(SERIAL, dict(kw, mtp=False)), mtp_config("ours-mtp", model, drafting, tree, truth, **kw)]
        if dev.type == "cuda" and get_ops(kernels, dev).kind == "triton":   # the same runs, verify step as a CUDA
            # graph (the Triton kernels' only: the twins plan each step on the host)
            configs += [Config("ours-serial-graph", dict(kw, mtp=False, cuda_graph=True)),
                        mtp_config("ours-mtp-graph", model, drafting, tree, truth, cuda_graph=True, **kw)]
        table, _ = measure(target, configs, max_new_tokens, batch=batch, hf=twin)
        for cfg in configs:
            provider = "ours-serial" if cfg.name == SERIAL else cfg.name
            rows.append(summary_row(dict(base, provider=provider, batch=batch,
                                         config="serial" if "serial" in provider else "tree",
                                         cuda_graph=provider.endswith("-graph")), table[cfg.name]))
        rows += peer_rows(base, table)
    return rows


def target_parser(prog, doc, out, out_help="CSV to append rows to"):
    """The command line of an end-to-end measurement: --out (a CSV) and which model, where, how big, whose drafts."""
    ap = command_parser(prog, doc.splitlines()[0], "out", out=dict(default=out, help=out_help))
    ap.add_argument("--shape", default="embedded", choices=["embedded", "llama7b"])
    add_common(ap, "model", "device", "quick", model=dict(default=EMBEDDED, help="checkpoint folder with heads/ "
               "(embedded shape)"), quick=dict(help="tiny sizes (always on CPU)"))
    ap.add_argument("--profile", default="consumer80", help="synthetic acceptance profile for llama7b (consumer80, "
                    "0.9, ...)")
    return add_common(ap, "max-new-tokens", "kernels", "dtype", dtype=dict(
        choices=["bfloat16", "float32"], help="llama7b's weights (default: bfloat16 on a GPU, float32 on a CPU)"))


def parse_target(ap, argv, cpu_note, new_tokens):
    """The parsed `target_parser` options with the suite filled in: a.target, a.drafting, a.quick and
    a.max_new_tokens (default: 12 when quick, else new_tokens); None when the suite cannot run here (the reason is
    printed). --out, a CSV path, is checked first. Without a GPU, `cpu_note` is printed and the run is quick."""
    a = ap.parse_args(argv)
    found = _target(a, cpu_note)
    if found is None:
        return None
    a.target, a.drafting, a.quick = found
    a.max_new_tokens = a.max_new_tokens or (12 if a.quick else new_tokens)
    return a


def _target(a, cpu_note):
    ensure_writable_dir(os.path.dirname(os.path.abspath(a.out)))            # before the compute
    gpu = torch.cuda.is_available() and (a.device is None or str(a.device).startswith("cuda"))
    if not gpu:
        print(cpu_note)
    quick = a.quick or not gpu
    try:
        target = load_target(a.shape, a.model, a.device, quick=quick, dtype=a.dtype and getattr(torch, a.dtype))
    except RuntimeError as e:
        print(f"skipped: {e}")
        return None
    drafting = oracle_drafting(a.profile) if a.shape == "llama7b" else heads_drafting(target)
    return target, drafting, quick


def main(argv=None):
    ap = target_parser("python -m mtp_lab.bench.e2e", __doc__, "out/e2e.csv")
    ap.add_argument("--batches", default=None, help="comma list of batch sizes (default 1,4 on GPU, 1,2 else)")
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    a = parse_target(ap, argv, "no GPU: CPU run at tiny size (as --quick) — these are CPU numbers (torch ops), not "
                               "GPU numbers", 128)
    if a is None:
        return 0
    target, drafting, quick, n = a.target, a.drafting, a.quick, a.max_new_tokens
    batches = [int(b) for b in a.batches.split(",")] if a.batches else ([1, 2] if quick else [1, 4])
    if max(batches) > len(target.prompts):
        target.prompts = (target.prompts * max(batches))[: max(batches)]
    print(f"{target.suite}: {target.description}; drafts from {drafting.label}; batches {batches}, "
          f"{n} new tokens, prompt length {target.prompt_len}")
    command = "python -m mtp_lab.bench.e2e " + " ".join(sys.argv[1:] if argv is None else argv)
    save_rows([dict(r, command=command) for r in ab_rows(target, drafting, n, batches, kernels=a.kernels,
                                                          hf=not a.no_hf)], a.out,
              line=lambda r: f"{r['provider']:12} batch {r['batch']:>2} {r['config']:6} {r['tokens_per_s']:9.1f} "
                             f"tok/s x{r['speedup_vs_serial']:.2f} tau {r['tau']:.2f}  identical "
                             f"{r['identical_to_serial']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
