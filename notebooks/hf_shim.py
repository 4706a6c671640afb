"""Small helpers shared by the notebooks (kept out of the package: they build toy models for lessons)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_hf_llama(seed=0, dtype=torch.float64, vocab_size=211, layers=2):
    """A random-init transformers Llama (GQA 4/2, head dim 16), built offline — for exact parity demos."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).to(dtype).eval()
