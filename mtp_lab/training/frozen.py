"""Recipe 2, `frozen`: Medusa-1 self-distillation for an existing checkpoint (Cai et al. 2024,
https://arxiv.org/abs/2401.10774). The base is frozen and only the heads learn, towards the base's own
predictions, so the heads learn what the *base* would say:

    soft: L_h = KL(p_base(. | x_{t+h+1}) || softmax(lm_head(z_h(x_t))))      hard: CE to argmax p_base

Since the base never changes, its hidden states are computed once and cached; training then touches only the
cache (one D x D matmul and the LM head per head). `--self-generated N` adds N free-running greedy continuations
of the base: those are the sequences the heads see at decode time (small models loop; heads trained on real
text alone do not predict the loops).

    python -m mtp_lab.train_heads frozen --model MODEL_DIR --out HEADS_DIR --self-generated 512

Writes the heads to --out, with accuracy.json beside them: {"acc": acc[H][K], ...}, where acc[h][r] is the
held-out probability that rank r of head h equals the base's greedy token (input of `Tree.from_accuracies`),
measured on greedy continuations of held-out prompts; and train_frozen.json, train_frozen_curve.csv / .png in
--records (default --out).
"""
import json
import os
import time

import torch
import torch.nn.functional as F

from mtp_lab.cli import add_common, int_at_least
from mtp_triton.heads import MTPHeads
from mtp_lab.training.data import load_text_files, random_windows, token_streams
from mtp_lab.training.evaluate import (distinct_ratio, head_topk_accuracy, prompts_tau, standard_trees,
                                          tau_report)
from mtp_lab.training.hidden import base_argmax, cache_hidden, greedy_continue, head_z, init_from
from mtp_lab.records import write_json
from mtp_lab.training.loop import Loop, LoopConfig, Recorder, add_training_arguments


def frozen_head_losses(heads, lm_head, x, targets="soft", backward=True):
    """Per-head self-distillation losses on hidden states x [B, S, D] of the frozen base.

    Head h at position t learns the base's distribution at t + h + 1 (which predicts token t + h + 2):
    soft: KL(p_base || q_h), hard: CE(q_h, argmax p_base). With backward=True each head's loss is
    back-propagated right away (scaled by 1/H: the loss is the mean over heads), so only one head's
    [B, S, V] logits are alive at a time.
    """
    S, w = x.shape[1], lm_head.weight
    with torch.no_grad():
        base_logp = torch.log_softmax(lm_head(x.to(w.dtype)).float(), -1)      # [B, S, V]
        base_p = base_logp.exp() if targets == "soft" else None
        ent = -(base_p * base_logp).sum(-1) if targets == "soft" else None     # [B, S]
        arg = base_logp.argmax(-1)
    out = []
    for h in range(heads.num_heads):
        n = S - h - 1
        if n <= 0:
            break
        logq = torch.log_softmax(lm_head(head_z(heads, x[:, :n].float(), h).to(w.dtype)).float(), -1)
        if targets == "soft":   # KL = cross-entropy - entropy of the target
            loss = (-(base_p[:, h + 1:] * logq).sum(-1) - ent[:, h + 1:]).mean()
        else:
            loss = F.nll_loss(logq.flatten(0, 1), arg[:, h + 1:].flatten())
        if backward:
            (loss / heads.num_heads).backward()
        out.append(loss.detach())
    return out


def training_sequences(model, streams, args, gen):
    """(seqs [N, S], what they are): --real-windows real-text windows, then --self-generated greedy
    continuations of the base from --prompt-len real tokens (drawn from gen in that order)."""
    S, P = args.seq_len, args.prompt_len
    parts, kinds = [], []
    if args.real_windows:
        parts.append(random_windows(streams["train"], args.real_windows, S, gen))
        kinds.append(f"{args.real_windows} real windows")
    if args.self_generated:
        prompts = random_windows(streams["train"], args.self_generated, P, gen)
        parts.append(greedy_continue(model, prompts.to(args.device), S - P, args.gen_batch).cpu())
        kinds.append(f"{args.self_generated} greedy continuations ({P} prompt + {S - P} generated tokens)")
    if not parts:
        raise ValueError("frozen: nothing to train on (--real-windows 0 and --self-generated 0)")
    return torch.cat(parts), kinds


def heldout(model, heads, streams, args):
    """Held-out evaluation: real text (heads vs the real tokens and vs the base's argmax), and greedy
    continuations of held-out prompts (-> accuracy.json, the input of Tree.from_accuracies; simulated tau)."""
    S, P, K = args.seq_len, args.prompt_len, args.top_k
    egen = torch.Generator().manual_seed(args.seed + 777)
    val = random_windows(streams["val"], args.val_windows, S, egen)
    xv = cache_hidden(model, val, 8)
    acc_real = head_topk_accuracy(heads, model.lm_head, xv[:, :-1], val[:, 1:],
                                  torch.ones(val[:, 1:].shape, dtype=torch.bool), k=K)
    acc_base = head_topk_accuracy(heads, model.lm_head, xv, base_argmax(model, xv),
                                  torch.ones(val.shape, dtype=torch.bool), k=K)
    with torch.no_grad():
        val_kl = [l.item() for l in frozen_head_losses(heads, model.lm_head, xv[:8].to(args.device),
                                                       "soft", backward=False)]
    del xv
    vprompts = random_windows(streams["val"], args.eval_generated, P, egen)
    vseqs = greedy_continue(model, vprompts.to(args.device), args.eval_new_tokens, args.gen_batch).cpu()
    acc_greedy, taus_val = tau_report(heads, model, vseqs, P, standard_trees, K)
    return acc_greedy, {
        "val_kl_per_head": val_kl,
        "heldout_real": {"top1_vs_text": acc_real[:, 0].tolist(), "top5_vs_text": acc_real[:, :5].sum(1).tolist(),
                         "top1_vs_base": acc_base[:, 0].tolist(), "top5_vs_base": acc_base[:, :5].sum(1).tolist()},
        "heldout_greedy": {"prompts": args.eval_generated, "prompt_len": P, "new_tokens": args.eval_new_tokens,
                           "top1": acc_greedy[:, 0].tolist(), "top5": acc_greedy[:, :5].sum(1).tolist(),
                           "tau_simulated": taus_val, "distinct_ratio": distinct_ratio(vseqs[:, P:])}}


def check_args(args):
    """Refuse flags that are each in range but do not fit together (ValueError naming them), before any loading."""
    if args.self_generated and args.prompt_len >= args.seq_len:
        raise ValueError(f"frozen: --prompt-len {args.prompt_len} must be less than --seq-len {args.seq_len} (each "
                         "greedy continuation starts from --prompt-len tokens and runs to --seq-len)")
    if args.seq_len < args.num_heads + 2:
        raise ValueError(f"frozen: --seq-len {args.seq_len} is too short for --num-heads {args.num_heads}: head h "
                         "learns the token h + 2 ahead, so --seq-len must be at least --num-heads + 2")


def train_frozen(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    check_args(args)
    texts = load_text_files(args.data) if args.data else None      # bad --data: refused before anything loads
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    tok = AutoTokenizer.from_pretrained(args.tokenizer or args.model)
    streams = token_streams(tok, texts, args.cache_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(args.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    D, S, H, P = model.config.hidden_size, args.seq_len, args.num_heads, args.prompt_len
    rec = Recorder(args.records or args.out, "train_frozen", recipe=f"frozen-{args.targets}")
    t0 = time.time()

    # 1. the sequences the heads learn on: real text windows + the base's own greedy continuations
    seqs, kinds = training_sequences(model, streams, args, gen)
    t_gen = time.time() - t0
    # 2. frozen base: hidden states once (the heads' only input), then the base is only used for its LM head
    x_cache = cache_hidden(model, seqs, args.batch, dtype)
    t_cache = time.time() - t0 - t_gen
    print(f"frozen: cached {tuple(x_cache.shape)} hidden states ({'; '.join(kinds)}) in {t_gen + t_cache:.0f} s")

    heads = MTPHeads(H, D, device=args.device)                   # W_h = 0 (Medusa): each head starts as the LM head
    init_n = init_from(heads, args.init) if args.init else 0

    def step_fn(step):
        idx = torch.randint(0, x_cache.shape[0], (args.batch,), generator=gen)
        losses = [l.item() for l in frozen_head_losses(heads, model.lm_head, x_cache[idx].to(args.device),
                                                       args.targets)]
        return {"loss": sum(losses) / len(losses), **{f"loss_head{h}": v for h, v in enumerate(losses)}}

    # the cache above is rebuilt from the seed on a rerun; the checkpoint then restores gen's later position
    loop = Loop(heads.parameters(), LoopConfig.from_args(args, "frozen"), state=(gen.get_state, gen.set_state))
    loop.resume()
    loop.run(step_fn, rec)
    del x_cache

    # 3. held-out evaluation, then third-party prompts (tau)
    acc_greedy, heldout_metrics = heldout(model, heads, streams, args)
    metrics = {
        "recipe": "frozen", "targets": args.targets, "model": args.model, "num_heads": H,
        "init": args.init, "init_heads": init_n, "sequences": kinds, "cache_shape": [seqs.shape[0], S, D],
        "generate_seconds": round(t_gen, 1), "cache_seconds": round(t_cache, 1),
        "train_seconds": round(loop.elapsed, 1), "steps": loop.step, **heldout_metrics,
        "config": {k: v for k, v in vars(args).items() if k != "func"}, "threads": torch.get_num_threads(),
    }
    if args.eval_prompts:   # held-out third-party code: greedy continuations prompt by prompt
        metrics["thirdparty_greedy"] = prompts_tau(heads, model, tok, args.eval_prompts, args.eval_prompt_max,
                                                   args.eval_new_tokens, standard_trees(acc_greedy.tolist()),
                                                   args.top_k, args.device)
    heads.save(args.out, recipe="frozen", targets=args.targets, base=os.path.abspath(args.model)
               if args.store_base_path else os.path.basename(os.path.normpath(args.model)),
               note="self-distilled on a frozen base; head h predicts token t + h + 2")
    write_json(os.path.join(args.out, "accuracy.json"), {
        "format": "mtp_triton.accuracy/1",
        "description": "acc[h][r] = held-out P(rank r of head h == the base's greedy token t + h + 2), "
                       "measured teacher-forced on greedy continuations; input of Tree.from_accuracies(acc, budget)",
        "num_heads": H, "top_k": args.top_k, "acc": acc_greedy.tolist(), "tree_budget": args.tree_budget,
        "measured_on": f"{args.eval_generated} greedy continuations ({args.eval_new_tokens} tokens) of held-out "
                       f"prompts ({P} tokens)"})
    write_json(os.path.join(args.records or args.out, "train_frozen.json"), metrics)
    rec.write()
    taus = metrics["heldout_greedy"]["tau_simulated"]
    print(json.dumps({"top1_greedy": metrics["heldout_greedy"]["top1"],
                      "tau": {k: round(v["tau"], 3) for k, v in taus.items()}}, indent=1))
    return metrics


def add_arguments(f):
    """The `frozen` subcommand's options: the shared training options, then its own (and its defaults)."""
    add_training_arguments(f)
    add_common(f, "model", model=dict(required=True, help="a Hugging Face causal-LM folder (Llama family)"))
    f.add_argument("--tokenizer", default=None, help="tokenizer folder (default: --model)")
    f.add_argument("--targets", choices=["soft", "hard"], default="soft",
                   help="soft: KL to the base's distribution; hard: CE to its argmax")
    f.add_argument("--init", default=None, help="heads folder to start from (extra heads copy the deepest one)")
    f.add_argument("--real-windows", type=int_at_least(0), default=256, help="real-text windows of --seq-len to cache")
    f.add_argument("--self-generated", type=int_at_least(0), default=0,
                   help="N greedy continuations of the base (prompt --prompt-len, up to --seq-len) to cache")
    f.add_argument("--prompt-len", type=int_at_least(1), default=64, help="tokens of real text each continuation "
                   "and each held-out one starts from (less than --seq-len)")
    f.add_argument("--gen-batch", type=int_at_least(1), default=64)
    f.add_argument("--val-windows", type=int_at_least(1), default=32)
    f.add_argument("--eval-generated", type=int_at_least(1), default=32,
                   help="held-out prompts continued greedily for eval")
    f.add_argument("--eval-new-tokens", type=int_at_least(1), default=256)
    f.add_argument("--eval-prompts", default=None, help="prompts JSONL (id, source, text) for a tau estimate")
    f.add_argument("--eval-prompt-max", type=int_at_least(1), default=512, help="keep the last N tokens of each prompt")
    f.add_argument("--top-k", type=int_at_least(1), default=10, help="ranks measured per head (accuracy.json)")
    f.add_argument("--store-base-path", action="store_true", help="record the absolute base path in heads.json")
    f.add_argument("--tree-budget", type=int_at_least(1), default=16,
                   help="nodes of the default tuned tree, recorded in accuracy.json for the decoder")
    f.set_defaults(lr=1e-3, steps=600, warmup=20)
