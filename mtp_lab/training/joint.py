"""Recipe 1, `joint`: multi-token-prediction pre-training of a fresh small Llama and its heads together
(Gloeckle et al. 2024, https://arxiv.org/abs/2404.19737; DeepSeek-V3 §2.2, https://arxiv.org/abs/2412.19437):

    L = CE(next token) + lambda * mean_h CE_h(token t + h + 2)

(DeepSeek-V3 uses lambda = 0.3 then 0.1). The head losses also shape the trunk: its hidden state has to carry
information about later tokens. To keep the extra cost small, each step scores the heads on a random fraction
`--head-frac` of the positions (the LM head projection per head costs as much as the model's own output layer).

    python -m mtp_lab.train_heads joint --tokenizer TOK --out MODEL_DIR --num-heads 4 --steps 1000

Writes MODEL_DIR (safetensors, tokenizer, generation config with the EOS id), MODEL_DIR/heads_joint, and
<run-name>.json, <run-name>_curve.csv / .png in --records (default --out).
"""
import json
import os

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mtp_lab.cli import float_in, int_at_least
from mtp_triton.heads import MTPHeads
from mtp_lab.training.data import load_text_files, random_windows, token_streams
from mtp_lab.training.evaluate import head_topk_accuracy
from mtp_lab.training.hidden import autocast, final_hidden, head_z, init_from
from mtp_lab.records import write_json
from mtp_lab.training.loop import Loop, LoopConfig, Recorder, add_training_arguments


def build_llama(vocab_size, layers=4, hidden=256, q_heads=4, kv_heads=2, intermediate=688, max_pos=2048,
                tie=False, eos_id=0, seed=0):
    """A small LlamaForCausalLM (GQA), built offline from a config."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_pos, tie_word_embeddings=tie, bos_token_id=eos_id,
                      eos_token_id=eos_id, pad_token_id=eos_id, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def joint_losses(model, heads, ids, S, head_frac, gen):
    """(next-token CE, [CE of head h]) on windows ids [B, S + H + 1]; the heads are scored on a random
    fraction of the positions (one randperm draw from gen). No head losses when there are no heads."""
    x = final_hidden(model, ids[:, :S])                                   # [B, S, D]
    ntp = F.cross_entropy(model.lm_head(x).flatten(0, 1).float(), ids[:, 1:S + 1].flatten())
    head = []
    if heads is None:
        return ntp, head
    pos = torch.randperm(S, generator=gen)[:max(1, int(S * head_frac))].to(ids.device)   # positions scored
    xs = x[:, pos]                                                         # [B, n, D]
    for h in range(heads.num_heads):
        logits = model.lm_head(head_z(heads, xs, h)).float()               # [B, n, V]
        head.append(F.cross_entropy(logits.flatten(0, 1), ids[:, pos + h + 2].flatten()))
    return ntp, head


@torch.no_grad()
def heldout_losses(model, heads, val, S, batch, args):
    """(next-token CE, [CE of head h]) per position over the held-out windows val [N, S + H + 1]."""
    H = heads.num_heads
    model.eval()
    tot, th = 0.0, [0.0] * H
    for i in range(0, val.shape[0], batch):
        ids = val[i:i + batch].to(args.device)
        with autocast(args.dtype, args.device):
            x = final_hidden(model, ids[:, :S])
            tot += F.cross_entropy(model.lm_head(x).flatten(0, 1).float(), ids[:, 1:S + 1].flatten(),
                                   reduction="sum").item()
            for h in range(H):
                lg = model.lm_head(head_z(heads, x, h)).float()
                th[h] += F.cross_entropy(lg.flatten(0, 1), ids[:, h + 2:S + h + 2].flatten(), reduction="sum").item()
    model.train()
    n = val.shape[0] * S
    return tot / n, [t / n for t in th]


def train_joint(args):
    from transformers import AutoTokenizer, GenerationConfig
    texts = load_text_files(args.data) if args.data else None      # bad --data: refused before anything loads
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    streams = token_streams(tok, texts, args.cache_dir)
    H, S, B = args.num_heads, args.seq_len, args.batch
    if args.init_model:     # continue training a saved model (and its joint heads, when there are enough)
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(args.init_model, dtype=torch.float32).to(args.device)
        args.hidden = model.config.hidden_size
    else:
        model = build_llama(len(tok), args.layers, args.hidden, args.q_heads, args.kv_heads, args.intermediate,
                            args.max_pos, args.tie, tok.eos_token_id, args.seed).to(args.device)
    heads = MTPHeads(H, args.hidden, device=args.device)          # W_h = 0: every head starts as the LM head
    init_dir = os.path.join(args.init_model or "", args.heads_subdir)
    if args.init_model and os.path.exists(os.path.join(init_dir, "heads.safetensors")):
        init_from(heads, init_dir)
    val = random_windows(streams["val"], args.val_windows, S + H + 1, torch.Generator().manual_seed(1234))
    rec = Recorder(args.records or args.out, args.run_name, recipe="joint")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"joint: {n_params / 1e6:.2f} M params, {H} heads, lambda={args.mtp_weight}, "
          f"train {streams['train'].numel()} / val {streams['val'].numel()} tokens")
    trained_heads = heads if H and args.mtp_weight else None

    def step_fn(step):
        ids = random_windows(streams["train"], B, S + H + 1, gen).to(args.device)
        with autocast(args.dtype, args.device):
            ntp, head = joint_losses(model, trained_heads, ids, S, args.head_frac, gen)
            loss = ntp + (args.mtp_weight * sum(head) / H if head else 0.0)
        loss.backward()
        return {"loss": loss.item(), "loss_ntp": ntp.item(), **{f"loss_head{h}": v.item() for h, v in enumerate(head)}}

    def on_log(row):        # held-out losses every --eval-every steps (on the logged ones)
        if row["step"] % args.eval_every:
            return None
        v, vh = heldout_losses(model, heads, val, S, B, args)
        tqdm.write(f"step {row['step']} tokens {row['tokens']} train {row['loss_ntp']:.3f} val {v:.3f} "
                   f"({row['tokens'] / max(row['elapsed_s'], 0.1):.0f} tok/s)")
        return {"val_ntp": v, "val_head0": vh[0] if vh else None}

    cfg = LoopConfig.from_args(args, "joint", weight_decay=args.weight_decay, betas=(0.9, 0.95), clip=1.0)
    loop = Loop(list(model.parameters()) + list(heads.parameters()), cfg, state=(gen.get_state, gen.set_state))
    loop.resume()
    model.train()
    loop.run(step_fn, rec, on_log=on_log, on_save=lambda: model.save_pretrained(args.out))  # a crash copy
    step, train_s, tokens = loop.step, loop.elapsed, loop.step * B * S
    val_loss, vh = heldout_losses(model, heads, val, S, B, args)
    rec.log(step=step, tokens=tokens, elapsed_s=round(train_s, 1), lr=loop.lr, val_ntp=val_loss,
            val_head0=vh[0] if vh else None)
    # save: model (safetensors), tokenizer, generation config with the EOS id, joint heads
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id,
                                               bos_token_id=tok.eos_token_id, do_sample=False)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    with torch.no_grad():
        xv = torch.cat([final_hidden(model.eval(), val[i:i + B, :S].to(args.device)) for i in range(0, len(val), B)])
        acc = head_topk_accuracy(heads, model.lm_head, xv, val[:, 1:S + 1].to(args.device),
                                 torch.ones(xv.shape[:2], dtype=torch.bool), k=5) if H else torch.zeros(0, 5)
    if H:
        heads.save(os.path.join(args.out, args.heads_subdir), recipe="joint", mtp_weight=args.mtp_weight,
                   note="trained jointly with the base; head h predicts token t + h + 2")
    metrics = {"recipe": "joint", "init_model": args.init_model, "params": n_params, "num_heads": H,
               "mtp_weight": args.mtp_weight, "steps": step, "tokens": tokens, "train_seconds": round(train_s, 1),
               "tokens_per_s": round(tokens / train_s, 1), "val_ntp_loss": val_loss, "val_head_loss": vh,
               "head_top1_real": acc[:, 0].tolist(), "head_top5_real": acc.sum(1).tolist(),
               "config": {k: v for k, v in vars(args).items() if k != "func"}, "threads": torch.get_num_threads()}
    write_json(os.path.join(args.records or args.out, f"{args.run_name}.json"), metrics)
    rec.write()
    print(json.dumps({k: metrics[k] for k in ("steps", "tokens", "val_ntp_loss", "head_top1_real")}, indent=1))
    return metrics


def add_arguments(j):
    """The `joint` subcommand's options: the shared training options, then its own."""
    add_training_arguments(j, min_heads=0)                        # 0 heads: a plain language model
    j.add_argument("--tokenizer", required=True, help="tokenizer folder (transformers AutoTokenizer)")
    j.add_argument("--layers", type=int_at_least(1), default=4)
    j.add_argument("--hidden", type=int_at_least(1), default=256, help="a multiple of --q-heads")
    j.add_argument("--q-heads", type=int_at_least(1), default=4)
    j.add_argument("--kv-heads", type=int_at_least(1), default=2, help="divides --q-heads")
    j.add_argument("--intermediate", type=int_at_least(1), default=688)
    j.add_argument("--max-pos", type=int_at_least(1), default=2048)
    j.add_argument("--tie", action="store_true", help="tie input embeddings and LM head")
    j.add_argument("--init-model", default=None, help="continue from a saved model folder (new LR schedule)")
    j.add_argument("--run-name", default="train_joint", help="name of the records (<name>.json, <name>_curve.csv)")
    j.add_argument("--mtp-weight", type=float_in(0), default=0.3,
                   help="lambda: weight of the mean head loss (0: plain LM)")
    j.add_argument("--head-frac", type=float_in(0, 1, low_open=True), default=0.25,
                   help="fraction of positions the heads are trained on (0 < f <= 1)")
    j.add_argument("--weight-decay", type=float_in(0), default=0.1)
    j.add_argument("--val-windows", type=int_at_least(1), default=48)
    j.add_argument("--heads-subdir", default="heads_joint")
