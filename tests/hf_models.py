"""Tiny random-init `transformers` Llama models built offline, shared by the parity tests."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIGS = {
    # id: (LlamaConfig kwargs)
    "gqa-hd16-v203-untied-L2": dict(vocab_size=203, hidden_size=64, intermediate_size=120, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-hd32-v311-tied-L1": dict(vocab_size=311, hidden_size=128, intermediate_size=200, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "gqa-hd64-v97-llama3rope-L3": dict(vocab_size=97, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                                       num_attention_heads=4, num_key_value_heads=1, head_dim=64,
                                       tie_word_embeddings=False, rope_theta=500000.0,
                                       rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                         high_freq_factor=4.0, original_max_position_embeddings=64)),
}


def make_hf(name, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    cfg = LlamaConfig(max_position_embeddings=512, attn_implementation="sdpa", **CONFIGS[name])
    return LlamaForCausalLM(cfg).to(dtype).eval()


def hf_greedy(hf, prompts, max_new_tokens, eos_token_id=None):
    """transformers' own greedy decoding, one sequence at a time (no padding)."""
    out = []
    for p in prompts:
        kw = dict(eos_token_id=eos_token_id, pad_token_id=0) if eos_token_id is not None else dict(
            eos_token_id=None, pad_token_id=0)
        o = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0, **kw)
        out.append(o[0, len(p):].tolist())
    return out
