"""The weight-streaming floor of a decode step, for the rows of every speed measurement.

At batch 1 a verify step reads every weight matrix once (q, k, v, o, gate, up, down of each layer, the LM head;
of the embedding only T rows), so it cannot take less than

    floor_s = weight_bytes_per_step / bandwidth

where bandwidth is what this machine sustains copying a buffer far larger than its caches (a STREAM-style copy:
bytes read + bytes written, per second). The fraction of the floor a run reaches is floor_s / (its seconds per
step) = floor_s * tokens_per_s / tau. The copy is measured, not taken from a datasheet: on a shared 2-core machine
it varies run to run, so every row records the value its own run measured (`common.copy_bandwidth`, best of 5
copies of 256 MiB).
"""
from .common import copy_bandwidth

ROOFLINE_BYTES = 256 << 20              # the copied buffer: far larger than the caches of the machines measured


def weight_bytes_per_step(model):
    """Bytes of weights one verify step streams: every parameter once, except the embedding table, of which a step
    reads only its tokens' rows (unless the LM head is tied to it: then the whole table, once, as the LM head)."""
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) in seen or (p is embed and not tied):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
    return total


def roofline_fields(model, tokens_per_s, tau=1.0):
    """Row fields: weight_bytes_per_step, copy_gb_s (measured), floor_step_ms and floor_fraction = floor / measured
    seconds per step (steps per second = tokens_per_s / tau)."""
    w = weight_bytes_per_step(model)
    bw = copy_bandwidth(model.device, ROOFLINE_BYTES, best=True)
    floor = w / bw
    steps_per_s = tokens_per_s / tau if tau and tau == tau and tokens_per_s == tokens_per_s else float("nan")
    return dict(weight_bytes_per_step=w, copy_gb_s=round(bw / 1e9, 2), floor_step_ms=round(floor * 1e3, 3),
                floor_fraction=round(floor * steps_per_s, 4))
