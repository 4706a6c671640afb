"""The tensors the heads work on: the base's final-norm hidden states x (computed once and cached when the base
is frozen), the base's own greedy tokens and continuations, and one head's residual output z_h; plus heads
started from a saved set.

Head h reads x_t [D] and predicts the token at t + h + 2 through the model's LM head (Medusa, Cai et al. 2024,
https://arxiv.org/abs/2401.10774):
    z_h = x + silu(W_h x + b_h),    logits_h = lm_head(z_h)
"""
import torch
import torch.nn.functional as F

from mtp_triton.heads import load_heads


def final_hidden(model, ids):
    """x [B, S, D]: the final-norm hidden state the LM head (and the MTP heads) read."""
    return model.model(input_ids=ids).last_hidden_state


def head_z(heads, x, h):
    """z_h = x + silu(W_h x + b_h) for one head (x [..., D] -> [..., D]); `heads(x)[..., h, :]` without the rest.
    Heads that read the root token need it too: they are measured by `distill` (`measure.evaluate_heads`)."""
    if getattr(heads, "root_input", False) or getattr(heads, "token_inputs", 0):
        raise ValueError("these heads read the root token or their path; this measurement feeds them x only — "
                         "use `train_heads distill`'s held-out measurement (mtp_lab.training.measure)")
    return x + F.silu(x @ heads.res_weight[h].T + heads.res_bias[h])


def autocast(dtype, device):
    """bf16 autocast for --dtype bf16, else a context that leaves fp32 as it is."""
    if dtype == "bf16":
        return torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16)
    return torch.autocast(device_type=torch.device(device).type, enabled=False)


@torch.no_grad()
def cache_hidden(model, seqs, batch, store_dtype=torch.float32):
    """x [N, S, D] on the CPU: the frozen base's final-norm hidden states, computed once."""
    dev = next(model.parameters()).device
    return torch.cat([final_hidden(model, seqs[i:i + batch].to(dev)).to("cpu", store_dtype)
                      for i in range(0, seqs.shape[0], batch)])


@torch.no_grad()
def base_argmax(model, x, batch=8):
    """[N, S]: the base's own greedy token after each position (argmax of its LM head)."""
    dev, w = next(model.parameters()).device, model.lm_head.weight
    return torch.cat([model.lm_head(x[i:i + batch].to(dev, w.dtype)).argmax(-1).cpu()
                      for i in range(0, x.shape[0], batch)])


@torch.no_grad()
def greedy_continue(model, prompts, new_tokens, batch=64):
    """[N, P + new_tokens]: greedy continuations (no early stop), with a KV cache, batch by batch."""
    import inspect
    from transformers import DynamicCache
    # transformers >= 5.2x calls the cache argument `cache` (the old `past_key_values` still works, with a warning)
    kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    outs = []
    for i in range(0, prompts.shape[0], batch):
        ids = prompts[i:i + batch]
        cache = DynamicCache()                                  # updated in place by every forward
        out = model(input_ids=ids, use_cache=True, **{kw: cache})
        toks = [ids]
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new_tokens - 1):
            toks.append(nxt)
            out = model(input_ids=nxt, use_cache=True, **{kw: cache})
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
        toks.append(nxt)
        outs.append(torch.cat(toks, dim=1))
    return torch.cat(outs)


def init_from(heads, path):
    """Copy the first heads from a saved set; extra heads start as copies of the deepest saved one.
    Returns how many heads the saved set had."""
    src = load_heads(path)
    if src.hidden_size != heads.hidden_size:
        raise ValueError(f"--init heads have hidden size {src.hidden_size}, the model {heads.hidden_size}")
    with torch.no_grad():
        for h in range(heads.num_heads):
            j = min(h, src.num_heads - 1)
            heads.res_weight[h].copy_(src.res_weight[j])
            heads.res_bias[h].copy_(src.res_bias[j])
    return src.num_heads
