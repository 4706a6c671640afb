"""The committed model in data/tiny-stdlib-llama: loads offline, generates, matches its card."""
import hashlib
import json
import os
import re
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "data", "tiny-stdlib-llama")
PROMPTS = os.path.join(ROOT, "data", "prompts", "thirdparty_code.jsonl")
PROMPT = 'def read_config(path):\n    """Read a JSON config file."""\n    with open(path) as f:\n'


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    return AutoModelForCausalLM.from_pretrained(MODEL).eval(), AutoTokenizer.from_pretrained(MODEL)


def test_config_as_documented(hf):
    model, tok = hf
    c = model.config
    assert c.model_type == "llama" and c.vocab_size == len(tok) == 4096
    assert c.num_attention_heads % c.num_key_value_heads == 0 and c.num_key_value_heads < c.num_attention_heads
    assert tok.eos_token == "<|endoftext|>" and tok.eos_token_id == c.eos_token_id
    assert model.generation_config.eos_token_id == tok.eos_token_id
    assert any(f.endswith(".safetensors") for f in os.listdir(MODEL))
    assert not any(f.endswith((".bin", ".pt")) for f in os.listdir(MODEL))


def test_tokenizer_round_trip(hf):
    _, tok = hf
    text = "    for i, x in enumerate(items):\n        print(f'{i}: {x!r}')  # é ✓\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text                          # byte-level: lossless, even for non-ASCII
    assert len(ids) < len(text.encode()) / 2                # BPE actually merges code


def test_greedy_generate(hf):
    model, tok = hf
    ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
    new = out[0, ids.shape[1]:]
    assert 1 <= new.numel() <= 12
    # a trained model: the continuation is far more likely than under a uniform model
    with torch.no_grad():
        logp = torch.log_softmax(model(out).logits[0, ids.shape[1] - 1:-1].float(), -1)
    mean_lp = logp.gather(1, new[:, None]).mean().item()
    assert mean_lp > -torch.log(torch.tensor(4096.0)).item() / 2, mean_lp


def test_heldout_loss_is_trained(hf):
    # next-token loss on third-party code (never trained on) is far below uniform (ln 4096 = 8.3)
    model, tok = hf
    text = json.loads(open(PROMPTS).readline())["text"]
    ids = tok(text, return_tensors="pt")["input_ids"][:, :256]
    with torch.no_grad():
        loss = model(ids, labels=ids).loss.item()
    assert loss < 4.5, loss


def test_heads_load():
    from mtp_triton.heads import load_heads
    heads = load_heads(os.path.join(MODEL, "heads"))
    cfg = json.load(open(os.path.join(MODEL, "config.json")))
    assert heads.num_heads >= 5 and heads.hidden_size == cfg["hidden_size"]
    assert heads.res_weight.abs().max() > 0                 # trained, not the zero (identity) init
    acc = json.load(open(os.path.join(MODEL, "heads", "accuracy.json")))
    a = torch.tensor(acc["acc"])
    assert acc["format"] == "mtp_triton.accuracy/1" and a.shape == (heads.num_heads, acc["top_k"])
    assert (a >= 0).all() and (a.sum(1) <= 1 + 1e-9).all()
    assert (a[:, 0][:-1] >= a[:, 0][1:] - 0.05).all(), "top-1 accuracy should fall with depth"


def test_card_checksums_match_files():
    card = open(os.path.join(MODEL, "README.md")).read()
    rows = re.findall(r"^\| `([^`]+)` \| `([0-9a-f]{64})` \| (\d+) \|$", card, flags=re.M)
    listed = {r for r, _, _ in rows}
    for must in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "heads/heads.safetensors", "heads/heads.json", "heads/accuracy.json"):
        assert must in listed, f"{must} missing from the card's checksum table"
    for rel, digest, size in rows:
        path = os.path.join(MODEL, rel)
        assert os.path.exists(path), f"card lists {rel}, which does not exist"
        with open(path, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, f"sha256 of {rel} differs from the card"
        assert os.path.getsize(path) == int(size)
    on_disk = {os.path.relpath(os.path.join(d, f), MODEL).replace(os.sep, "/")
               for d, dirs, files in os.walk(MODEL) for f in files if "__pycache__" not in d} - {"README.md"}
    assert on_disk == listed, f"files not in the card: {sorted(on_disk - listed)}"
    assert sum(int(s) for _, _, s in rows) <= 25 * 2 ** 20


def test_prompts_file():
    rows = [json.loads(line) for line in open(PROMPTS)]
    assert len(rows) >= 25 and len({r["id"] for r in rows}) == len(rows)
    for r in rows:
        assert set(r) >= {"id", "source", "text"} and len(r["text"]) > 400
        assert r["source"].split()[0] not in sys.stdlib_module_names, f"{r['id']} comes from the stdlib"


def test_load_model_contract(hf):
    # the project's own engine loads the same checkpoint and agrees with transformers on the logits
    import mtp_triton
    model, tok = hf
    engine = mtp_triton.load_model(MODEL, device="cpu")
    assert engine.config.vocab_size == 4096
    ids = tok(PROMPT, add_special_tokens=False)["input_ids"]
    res = mtp_triton.generate(engine, [ids], 8, mtp=False, kernels="torch")
    ref = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()
    assert res.tokens[0][:len(ref)] == ref
