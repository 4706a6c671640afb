"""Hugging Face `generate()` on the same weights as our engine: the outside serial baseline of e2e and tables.

`hf_twin` builds a `transformers.LlamaForCausalLM` holding exactly our engine's weights; `time_hf` times its greedy
generate the way ours is timed (decode tokens/s excludes prefill: generate(N) minus generate(1) on the same prompt);
`bench.ab` runs it as a peer configuration beside ours.
"""
import torch

from mtp_triton.stats import gpu_energy_j
from .common import stopwatch


def hf_twin(model):
    """A `transformers.LlamaForCausalLM` holding exactly `model`'s weights (same device and dtype)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    c = model.config
    kw = dict(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
              num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
              num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
              rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings,
              tie_word_embeddings=c.tie_word_embeddings, attention_bias=c.attention_bias, mlp_bias=c.mlp_bias,
              bos_token_id=None, eos_token_id=c.eos_token_id, pad_token_id=None, attn_implementation="sdpa")
    if c.rope_scaling:
        kw["rope_scaling"] = dict(c.rope_scaling)
    with torch.device(model.device):
        hf = LlamaForCausalLM(LlamaConfig(**kw))
    hf = hf.to(model.dtype).eval()
    sd = {}
    for k, v in model.state_dict().items():
        if k == "inv_freq":
            continue
        if k.startswith("layers."):
            i, rest = k[len("layers."):].split(".", 1)
            sub = "self_attn." if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj", "o_proj") else (
                "mlp." if rest.split(".")[0] in ("gate_proj", "up_proj", "down_proj") else "")
            k = f"model.layers.{i}.{sub}{rest}"
        elif k != "lm_head.weight":
            k = "model." + k
        sd[k] = v
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m and not (c.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"hf_twin: weights do not map: missing {missing[:4]}, unexpected {unexpected[:4]}")
    return hf


STATIC_CACHE_LEN = 512    # the compiled peer's static cache: one size for every prompt here (<= 512 positions), so
                          # none recompiles; a longer prompt + max_new_tokens gets a larger cache (and compiles again)


def compiled_kwargs(device):
    """generate() keyword arguments for transformers' compiled decoding, the strongest peer a CPU user has: a static
    KV cache of STATIC_CACHE_LEN positions and its automatic `torch.compile` of the decode forward (inductor; on a
    CPU with `freezing`, which prepacks the weights as constants, and `cpp_wrapper`, which calls the kernels from C++
    instead of Python). The first call compiles (minutes on a small CPU; the graphs are cached for the process)."""
    from transformers import CompileConfig
    cpu = torch.device(device).type == "cpu"
    cfg = (CompileConfig(fullgraph=True, dynamic=False, mode=None, options=dict(freezing=True, cpp_wrapper=True))
           if cpu else CompileConfig(fullgraph=True, dynamic=False))    # GPU: transformers' default, CUDA graphs
    cfg._compile_all_devices = True            # transformers compiles on accelerators only unless told to
    return dict(cache_implementation="static", max_cache_len=STATIC_CACHE_LEN, compile_config=cfg)


def time_hf(hf, prompts, max_new_tokens, eos_token_id=None, warmup="each", prompt_lookup=None, compiled=False):
    """HF greedy `generate` one prompt at a time: decode tokens/s (prefill excluded as for ours), energy, tokens.
    warmup: "each" (an 8-token generate before every prompt), "first" (before the first prompt only) or "none".
    prompt_lookup: n for transformers' prompt-lookup decoding (`prompt_lookup_num_tokens=n`: drafts copied from
    n-gram matches in the context, verified by the model; no training), None for plain greedy. compiled: its
    compiled decoding (`compiled_kwargs`)."""
    dev = hf.device
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=eos_token_id)
    if prompt_lookup is not None:
        kw["prompt_lookup_num_tokens"] = prompt_lookup
    if compiled:
        kw.update(compiled_kwargs(dev))
    energy, tokens, per_prompt = 0.0, [], []
    for i, p in enumerate(prompts):
        ids = torch.tensor([p], device=dev)
        with torch.no_grad():
            if warmup == "each" or (warmup == "first" and i == 0):
                hf.generate(ids, max_new_tokens=min(8, max_new_tokens), **kw)       # warm-up
            t_first = stopwatch(lambda: hf.generate(ids, max_new_tokens=1, **kw), dev)[1]
            e0 = gpu_energy_j(dev) if dev.type == "cuda" else None
            out, t_all = stopwatch(lambda: hf.generate(ids, max_new_tokens=max_new_tokens, **kw), dev)
            e1 = gpu_energy_j(dev) if dev.type == "cuda" else None
        tokens.append(out[0, len(p):].tolist())
        per_prompt.append(dict(new_tokens=len(tokens[-1]), decode_s=max(t_all - t_first, 1e-9), ttft_s=t_first))
        energy = None if energy is None or e0 is None or e1 is None else energy + (e1 - e0)
    decode_s = sum(p["decode_s"] for p in per_prompt)                   # decode tokens: new tokens - 1 per prompt
    return dict(tokens=tokens, new_tokens=sum(map(len, tokens)), per_prompt=per_prompt, energy_j=energy,
                decode_tokens_per_s=sum(len(t) - 1 for t in tokens) / decode_s,
                kernels="transformers generate (sdpa" + (", static cache, torch.compile)" if compiled else ")"))


PROMPT_LOOKUP = 10                     # draft tokens per step of transformers' prompt-lookup rows (its docs' example)
