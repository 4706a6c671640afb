"""Tiny random-init `transformers` models built offline, shared by the parity tests.

CONFIGS are Llama models (`LlamaConfig` kwargs). FAMILY_CONFIGS are the other supported families, two small
configs each; their biases and norm weights are drawn at random too (transformers initialises them to 0 / 1, and
a bias of zero or a norm weight of one would let a loading mistake pass unnoticed). The tied configs use larger
weights (initializer_range 0.2): with tied embeddings and tiny weights a random model just repeats its input token.
"""
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

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

FAMILIES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM),
            "mistral": (MistralConfig, MistralForCausalLM)}

FAMILY_CONFIGS = {
    # id: (family, config kwargs)
    "qwen2-gqa-hd16-v203-untied-L2": ("qwen2", dict(vocab_size=203, hidden_size=64, intermediate_size=120,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2.5-gqa-hd18-v151-tied-L2": ("qwen2", dict(vocab_size=151, hidden_size=72, intermediate_size=100,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=1, tie_word_embeddings=True,
                                                    rope_theta=1e6, initializer_range=0.2)),
    "qwen3-gqa-hd24-v203-untied-L2": ("qwen3", dict(vocab_size=203, hidden_size=64, intermediate_size=120,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, head_dim=24,
                                                    tie_word_embeddings=False)),
    "qwen3-mha-hd10-v97-tied-bias-L2": ("qwen3", dict(vocab_size=97, hidden_size=48, intermediate_size=64,
                                                      num_hidden_layers=2, num_attention_heads=3,
                                                      num_key_value_heads=3, head_dim=10, attention_bias=True,
                                                      tie_word_embeddings=True, initializer_range=0.2)),
    "mistral-win8-gqa-hd16-v203-L2": ("mistral", dict(vocab_size=203, hidden_size=64, intermediate_size=120,
                                                      num_hidden_layers=2, num_attention_heads=4,
                                                      num_key_value_heads=2, sliding_window=8)),
    "mistral-win5-mha-hd20-v131-L1": ("mistral", dict(vocab_size=131, hidden_size=60, intermediate_size=90,
                                                      num_hidden_layers=1, num_attention_heads=3,
                                                      num_key_value_heads=3, sliding_window=5)),
    # Qwen with use_sliding_window: layers >= max_window_layers slide, the first ones attend to everything
    "qwen2-swa6-layer1-L2": ("qwen2", dict(vocab_size=203, hidden_size=64, intermediate_size=120,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=6, max_window_layers=1)),
}


def make_hf(name, seed=0, dtype=torch.float64, **overrides):
    """A random model by id (CONFIGS or FAMILY_CONFIGS); overrides replace config kwargs."""
    torch.manual_seed(seed)
    if name in CONFIGS:
        cfg = LlamaConfig(max_position_embeddings=512, attn_implementation="sdpa", **{**CONFIGS[name], **overrides})
        return LlamaForCausalLM(cfg).to(dtype).eval()
    family, kwargs = FAMILY_CONFIGS[name]
    config_cls, model_cls = FAMILIES[family]
    cfg = config_cls(max_position_embeddings=512, attn_implementation="sdpa", **{**kwargs, **overrides})
    model = model_cls(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.normal_(0.0, cfg.initializer_range)      # the weights' own scale
            elif p.dim() == 1:                                # RMSNorm weights (incl. Qwen3's q_norm / k_norm)
                p.uniform_(0.5, 1.5)
    return model.to(dtype).eval()


def hf_greedy(hf, prompts, max_new_tokens, eos_token_id=None):
    """transformers' own greedy decoding, one sequence at a time (no padding)."""
    out = []
    for p in prompts:
        kw = dict(eos_token_id=eos_token_id, pad_token_id=0) if eos_token_id is not None else dict(
            eos_token_id=None, pad_token_id=0)
        o = hf.generate(torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, min_new_tokens=0, **kw)
        out.append(o[0, len(p):].tolist())
    return out
