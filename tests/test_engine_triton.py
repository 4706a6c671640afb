"""The engine with kernels="triton" (interpreter on CPU): same tokens as transformers and as kernels="torch"."""
import pytest
import torch

import mtp_triton as mt
from mtp_triton.drafters import OracleDrafter
from conftest import DEVICE
from hf_models import hf_greedy, make_hf

PROMPTS = [[5, 17, 33, 42, 90, 1], [7, 8, 9]]
N = 10


@pytest.fixture(scope="module")
def case():
    hf = make_hf("gqa-hd16-v203-untied-L2", dtype=torch.float32)
    return hf, mt.LlamaEngine.from_hf(hf, device=DEVICE)            # a CPU: Triton's interpreter


def test_triton_serial_and_mtp_match_hf(case):
    hf, model = case
    ref = hf_greedy(hf, PROMPTS, N)
    assert mt.generate(model, PROMPTS, N, mtp=False, kernels="triton").tokens == ref
    heads = mt.init_heads(model, 3, seed=0)
    res = mt.generate(model, PROMPTS, N, heads=heads, tree="medusa-8", kernels="triton")
    assert res.tokens == ref and res.stats.kernels == "triton"
    drafter = OracleDrafter(ref, [0.9, 0.8], model.config.vocab_size)
    res = mt.generate(model, PROMPTS, N, drafter=drafter, tree="chain-2", kernels="triton")
    assert res.tokens == ref and res.stats.tokens_per_step > 1.5


def test_triton_sampling_equals_torch_sampling(case):
    """Same seed, same random numbers: the Triton acceptance makes the reference's decisions."""
    _, model = case
    heads = mt.init_heads(model, 3, seed=1)
    kw = dict(heads=heads, tree="medusa-8", temperature=0.8, top_p=0.95, seed=11,
              runtime=mt.RuntimeConfig(size_by_cost=False))     # the same tree in both (auto sizes only "torch")
    a = mt.generate(model, PROMPTS, 6, kernels="triton", **kw)
    b = mt.generate(model, PROMPTS, 6, kernels="torch", **kw)
    assert a.tokens == b.tokens


@pytest.mark.gpu
def test_cuda_graph_verify_matches_eager():
    """CUDA-graph replay of the verify step gives the same tokens (batch with early EOS, bf16 and fp32)."""
    for dtype in (torch.float32, torch.bfloat16):
        hf = make_hf("gqa-hd64-v97-llama3rope-L3", dtype=dtype).cuda()
        model = mt.LlamaEngine.from_hf(hf)
        heads = mt.init_heads(model, 4, seed=0)
        prompts = PROMPTS + [[3] * 40]
        eager = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16", kernels="triton")
        eos = eager.tokens[1][5]
        eager = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16", kernels="triton", eos_token_id=eos)
        graph = mt.generate(model, prompts, 24, heads=heads, tree="medusa-16", kernels="triton", eos_token_id=eos,
                            cuda_graph=True)
        assert graph.tokens == eager.tokens


def test_cuda_graph_needs_cuda(case):
    model = mt.LlamaEngine.from_hf(case[0])                                     # on the CPU
    with pytest.raises(ValueError, match="CUDA"):
        mt.generate(model, PROMPTS, 4, cuda_graph=True)
