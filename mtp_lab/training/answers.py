"""Self-distillation data: the target model's own answers to a prompt set (as Medusa-2 builds its training data).

MTP heads should predict what *this* model will say, not what some corpus says: so the training text is the model's
own output. Every prompt is answered greedily (what greedy MTP verifies against) and a share of them also by
sampling (temperature, top-p), for variety. Answers are written to a JSONL file as they finish, so an interrupted
run resumes where it stopped (rows already in the file are skipped).

The answers can come from this engine or from transformers' own `generate` on the same checkpoint (`hf=` a
*ForCausalLM object): on a CPU transformers' batched decoding (contiguous cache, fused SDPA attention) is the faster
of the two at batch 32, and for training data a near-tie decided the other way now and then does not matter.

    rows = read_prompts("data/chat/train.jsonl")
    write_answers(model, tok, rows, "runs/smollm2/answers.jsonl", max_new_tokens=256, sample_share=0.4)

Jobs run in an order whose every prefix holds each prompt category in proportion (`proportional`): greedy answers
first, then the sampled ones; only inside a window of consecutive jobs are prompts sorted by length, so that a batch
pads little. A run stopped early leaves a smaller data set of the same mix, not one without the long categories.

At scale the answers go to gzip'ed JSONL shards that are committed to git (`write_answer_shards`; a shard is
written whole, tmp file + os.replace, so it is either complete or absent; resuming skips every (id, mode) already
in a shard), read back by `read_answer_shards`:

    python -m mtp_lab train_heads answers --out data/smollm2-135m-instruct-answers --minutes 120

Training prompts never come from the tuning or held-out splits (`HELD_OUT`): such a file, or a prompt file holding
one of their texts, is refused (`check_prompt_files`).
"""
import collections
import datetime
import glob
import gzip
import json
import os
import random
import time

import torch

from ..bundle import ROOT, SMOLLM2, chat_ids
from ..cli import add_common, float_in, int_at_least
from mtp_triton.generate import generate
from ..records import device_name, git_commit, open_log, output_lock, read_jsonl, write_bytes

# the tuning and held-out prompt splits: never training prompts (by file name, and by text wherever they are)
HELD_OUT = tuple(os.path.join(ROOT, "data", "chat", f) for f in
                 ("dev_chat.jsonl", "heldout_chat.jsonl", "heldout_templated.jsonl"))
TRAIN_PROMPTS = (os.path.join("data", "chat", "train.jsonl"), os.path.join("data", "chat", "self_prompts.jsonl"))
SHARD_FIELDS = ("id", "category", "mode", "prompt_ids", "answer_ids")       # what a shard row must hold


def normalise(text):
    """Case-folded, whitespace collapsed: the key for duplicates and held-out overlap (here, in `self_prompts` and
    in `retree`)."""
    return " ".join(text.casefold().split())


def read_prompts(path, what="prompt file"):
    """Rows of a prompts JSONL (id, category, text, ...); a line without an id or a text string, a torn line, a file
    that is not UTF-8 or is missing: a ValueError naming `what` (the flag), the file and the line."""
    return read_jsonl(path, what, ("id", "text"))


def jobs(rows, sample_share=0.4, seed=0):
    """(row, mode, seed) per answer to make: every row greedy, a seeded share of them also sampled. Whether a row is
    sampled, and its seed, depend only on (seed, its id): a larger share samples the same rows and more."""
    out = [(r, "greedy", 0) for r in rows]
    for r in rows:
        rng = random.Random(f"{seed}:{r['id']}")
        if rng.random() < sample_share:
            out.append((r, "sample", rng.randrange(1 << 30)))
    return out


def category_of(row):
    """A prompt row's category ("none" without one)."""
    return row.get("category") or "none"


def proportional(todo, seed=0):
    """The jobs (row, mode, seed) in an order whose every prefix holds each category in proportion to its count:
    greedy jobs first, then sampled ones; within a mode, a category's jobs (shuffled, seeded) are spread evenly,
    the i-th of n at (i + 1/2) / n of the way."""
    out = []
    for mode in ("greedy", "sample"):
        groups = collections.defaultdict(list)
        for j in todo:
            if j[1] == mode:
                groups[category_of(j[0])].append(j)
        keyed = []
        for cat, js in sorted(groups.items()):
            random.Random(f"{seed}:{mode}:{cat}").shuffle(js)
            keyed += [((i + 0.5) / len(js), cat, j) for i, j in enumerate(js)]
        out += [j for _, _, j in sorted(keyed, key=lambda k: k[:2])]
    return out


def batches_of(window, lengths, batch):
    """A window of jobs cut into batches of one mode each, prompts of similar length together (short ones pad less);
    lengths: {prompt id: prompt tokens}. -> [[job, ...], ...], each of at most `batch` jobs."""
    out = []
    for mode in ("greedy", "sample"):
        js = sorted((j for j in window if j[1] == mode), key=lambda j: lengths[j[0]["id"]])
        out += [js[i:i + batch] for i in range(0, len(js), batch)]
    return out


def windows(todo, size):
    """Consecutive slices of `size` jobs (the last one shorter)."""
    return [todo[i:i + size] for i in range(0, len(todo), size)]


def done_keys(path):
    """(id, mode) of the answers in the log `path` (a torn last line left out: that answer is made again)."""
    if not os.path.exists(path):
        return set()
    return {(r["id"], r["mode"]) for r in read_jsonl(path, "answers file", ("id", "mode"), torn_last="skip")}


@torch.no_grad()
def hf_answers(hf, prompts, max_new_tokens, eos, sample=False, temperature=0.7, top_p=0.9, seed=0):
    """transformers' generate on a batch of token-id prompts (left-padded). -> new tokens per prompt, up to EOS."""
    S = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), S), eos, dtype=torch.int64)
    att = torch.zeros(len(prompts), S, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, S - len(p):] = torch.tensor(p)
        att[i, S - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if sample else dict(do_sample=False)
    if sample:
        torch.manual_seed(seed)
    out = hf.generate(input_ids=ids.to(hf.device), attention_mask=att.to(hf.device), max_new_tokens=max_new_tokens,
                      eos_token_id=eos, pad_token_id=eos, **kw)[:, S:].tolist()
    return [o[:o.index(eos) + 1] if eos in o else o for o in out]


def encode(tok, todo, max_prompt_tokens=512):
    """{prompt id: its chat-template token ids (the last max_prompt_tokens)} of the rows of the jobs `todo`."""
    enc = {}
    for r, _, _ in todo:
        if r["id"] not in enc:
            enc[r["id"]] = chat_ids(tok, r["text"])[-max_prompt_tokens:]
    return enc


@torch.no_grad()
def answer_batch(model, part, enc, max_new_tokens, eos, temperature=0.7, top_p=0.9, hf=None):
    """The answers (new token ids, up to and with EOS) to one batch of jobs of one mode: by this engine (serial,
    lossless: greedy answers are the model's greedy answers), or by transformers (`hf`); a sampled batch is seeded
    with its first job's seed. -> [[int]] in the order of `part`."""
    prompts = [enc[r["id"]] for r, _, _ in part]
    sample, seed = part[0][1] == "sample", part[0][2]
    if hf is not None:
        return hf_answers(hf, prompts, max_new_tokens, eos, sample, temperature, top_p, seed)
    kw = dict(temperature=temperature, top_p=top_p, seed=seed) if sample else {}
    return generate(model, prompts, max_new_tokens, mtp=False, eos_token_id=eos, **kw).tokens


def answer_row(job, prompt_ids, answer_ids, batch_seed, by, **extra):
    """One answer's row: id, category, mode, seed (the batch's), by, prompt_ids, answer_ids, then `extra`."""
    r, mode, _ = job
    return dict(id=r["id"], category=r.get("category"), mode=mode, seed=batch_seed, by=by, prompt_ids=prompt_ids,
                answer_ids=answer_ids, **extra)


@torch.no_grad()
def write_answers(model, tok, rows, path, max_new_tokens=256, sample_share=0.4, temperature=0.7, top_p=0.9,
                  batch=32, max_prompt_tokens=512, seed=0, progress=True, hf=None):
    """Answer every row (greedy, plus sampled for a share) and append one JSON line per answer to `path`.

    Jobs run in the `proportional` order (greedy first); inside windows of 8 batches, prompts of similar length
    share a batch (short prompts pad less); a sampled batch uses its first job's seed. Returns the number of answers
    written by this call."""
    have = done_keys(path)
    todo = [j for j in jobs(rows, sample_share, seed) if (j[0]["id"], j[1]) not in have]
    enc = encode(tok, todo, max_prompt_tokens)
    lengths = {i: len(p) for i, p in enc.items()}
    batches = [b for w in windows(proportional(todo, seed), batch * 8) for b in batches_of(w, lengths, batch)]
    eos, by = tok.eos_token_id, "transformers" if hf is not None else "engine"
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(todo), desc="answers", unit="answer")
    written = 0
    with open_log(path) as f:
        for part in batches:
            answers = answer_batch(model, part, enc, max_new_tokens, eos, temperature, top_p, hf)
            for job, ans in zip(part, answers):
                f.write(json.dumps(answer_row(job, enc[job[0]["id"]], ans, part[0][2], by)) + "\n")
            f.flush()
            written += len(part)
            if bar:
                bar.update(len(part))
    if bar:
        bar.close()
    return written


# ---- shards: the answers at scale, committed to git -------------------------------------------------------------
def shard_paths(folder):
    """The shard files of an answers folder, <folder>/shards/NNNNN.jsonl.gz, in shard order (temporary files of an
    interrupted write are not shards)."""
    return sorted(glob.glob(os.path.join(folder, "shards", "[0-9][0-9][0-9][0-9][0-9].jsonl.gz")))


def read_answer_shards(folder):
    """Yield every answer row of the shards in <folder>/shards/ (NNNNN.jsonl.gz, in shard order; within a shard in
    the order written). Each row is a dict:

        id           the prompt's id in its prompt file (str)
        category     the prompt's category (str, e.g. "coding"; None where the prompt has none)
        mode         "greedy" (temperature 0: the model's own greedy answer) or "sample" (temperature, top_p of `gen`)
        seed         the batch's sampling seed (0 for greedy; a sampled answer also depends on its batch-mates)
        by           "engine" (mtp_triton.generate, serial) or "transformers"
        prompt_ids   [int]: the prompt in the model's chat template, ending where the answer starts
        answer_ids   [int]: the answer's new tokens, ending with EOS (<|im_end|>) unless it hit the limit
        hit_limit    bool: the answer stopped at gen.max_new_tokens without EOS (kept: flag it, drop it, or mask it)
        prompt_file  the prompt file it came from (repository-relative)
        gen          dict: max_new_tokens, temperature, top_p, dtype, threads, device, torch, commit, command, date

    A shard that is not gzip'ed JSONL, or a row without the fields of SHARD_FIELDS, is a ValueError naming the file."""
    for path in shard_paths(folder):
        yield from read_shard(path)


def read_shard(path):
    """The rows of one shard file (see `read_answer_shards`); a bad file is a ValueError naming it and the line."""
    try:
        text = gzip.decompress(open(path, "rb").read()).decode("utf-8")
    except (OSError, EOFError, UnicodeDecodeError) as e:
        raise ValueError(f"answer shard {path}: not a gzip'ed UTF-8 JSONL file ({e}); delete it, the next run "
                         "writes its answers again") from None
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"answer shard {path}:{n}: not valid JSON ({e.msg})") from None
        missing = [k for k in SHARD_FIELDS if not isinstance(row, dict) or k not in row]
        if missing:
            raise ValueError(f"answer shard {path}:{n}: no {', '.join(map(repr, missing))} field")
        rows.append(row)
    return rows


def write_shard(path, rows):
    """Write rows as one gzip'ed JSONL file, whole (tmp file + fsync + os.replace: complete or absent)."""
    data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in rows).encode("utf-8")
    write_bytes(path, gzip.compress(data, compresslevel=9, mtime=0))


def check_prompt_files(paths):
    """The prompt rows of `paths` (each row tagged with prompt_file: the path given). Refused with a ValueError
    naming the --prompts file: a tuning or held-out split (HELD_OUT, by name), a file holding any of their texts
    (whitespace and case aside), and an id that two rows share."""
    held_names = {os.path.basename(h) for h in HELD_OUT}
    held = {normalise(r["text"]) for h in HELD_OUT if os.path.exists(h) for r in read_prompts(h, "held-out file")}
    rows, seen = [], {}
    for path in paths:
        if os.path.basename(path) in held_names:
            raise ValueError(f"--prompts {path}: {os.path.basename(path)} is a tuning/held-out split; training "
                             f"prompts come only from {' and '.join(TRAIN_PROMPTS)} (and self_prompts.py)")
        mine = read_prompts(path, "--prompts file")
        bad = [r["id"] for r in mine if normalise(r["text"]) in held]
        if bad:
            raise ValueError(f"--prompts {path}: {len(bad)} prompt(s) equal a tuning/held-out prompt "
                             f"(first: id {bad[0]}); remove them, the held-out splits must stay held out")
        for r in mine:
            if r["id"] in seen:
                raise ValueError(f"--prompts {path}: id {r['id']!r} is also in {seen[r['id']]}; ids must be unique")
            seen[r["id"]] = path
            rows.append(dict(r, prompt_file=path))
    return rows


def shard_todo(rows, folder, sample_share, seed):
    """(jobs not in any shard yet, in the `proportional` order; keys (id, mode) already done)."""
    have = {(r["id"], r["mode"]) for r in read_answer_shards(folder)}
    return [j for j in proportional(jobs(rows, sample_share, seed), seed) if (j[0]["id"], j[1]) not in have], have


def utc_now():
    """The time now, UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def gen_info(max_new_tokens, temperature, top_p, model, command=None):
    """The `gen` dict every shard row carries: settings, machine, torch, commit (the checkout's when the run
    started), command, date (UTC; `write_answer_shards` sets it to when the shard was begun)."""
    return dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                dtype=str(model.dtype).replace("torch.", "") if hasattr(model, "dtype") else None,
                threads=torch.get_num_threads(), device=device_name("cpu"),
                torch=torch.__version__, commit=git_commit(), command=command, date=utc_now())


@torch.no_grad()
def write_answer_shards(model, tok, rows, folder, max_new_tokens=512, sample_share=1.0, temperature=0.7, top_p=0.9,
                        batch=16, shard_size=128, minutes=None, max_prompt_tokens=512, seed=0, command=None,
                        log=print):
    """Answer the prompt rows into gzip'ed JSONL shards <folder>/shards/NNNNN.jsonl.gz (rows: `read_answer_shards`).

    Jobs (`jobs`: every row greedy, a share also sampled) run in the `proportional` order, those already in a shard
    left out; each shard is the next `shard_size` jobs, batched `batch` prompts of similar length at a time
    (`batches_of`), and written whole when its last batch is done. minutes: a time budget; a shard is not begun once
    the time spent plus the last shard's time would pass it. -> (shards written, answers written)."""
    if batch < 1 or shard_size < 1:
        raise ValueError(f"batch and shard_size must be >= 1, got batch={batch}, shard_size={shard_size}")
    todo, have = shard_todo(rows, folder, sample_share, seed)
    paths = shard_paths(folder)
    nxt = int(os.path.basename(paths[-1])[:5]) + 1 if paths else 0
    eos, t0, last, written, shards = tok.eos_token_id, time.time(), 0.0, 0, 0
    stamp = gen_info(max_new_tokens, temperature, top_p, model, command)     # the code that runs: read once
    log(f"{len(have)} answers in {len(paths)} shards; {len(todo)} to make")
    for window in windows(todo, shard_size):
        spent = time.time() - t0
        if minutes is not None and spent + last > 60 * minutes:
            log(f"time budget of {minutes} min: stopping after {shards} shards ({spent / 60:.1f} min)")
            break
        t1 = time.time()
        enc = encode(tok, window, max_prompt_tokens)
        lengths = {i: len(p) for i, p in enc.items()}
        gen = dict(stamp, date=utc_now())
        out = []
        for part in batches_of(window, lengths, batch):
            answers = answer_batch(model, part, enc, max_new_tokens, eos, temperature, top_p)
            out += [answer_row(j, enc[j[0]["id"]], a, part[0][2], "engine",
                               hit_limit=len(a) >= max_new_tokens and a[-1] != eos,
                               prompt_file=j[0].get("prompt_file"), gen=gen) for j, a in zip(part, answers)]
        path = os.path.join(folder, "shards", f"{nxt:05d}.jsonl.gz")
        write_shard(path, out)
        last = time.time() - t1
        ntok = sum(len(r["answer_ids"]) for r in out)
        nxt, shards, written = nxt + 1, shards + 1, written + len(out)
        log(f"{path}: {len(out)} answers, {ntok} answer tokens, {last:.0f} s, {ntok / last:.1f} answer tok/s; "
            f"{written} answers this run, {len(todo) - written} to go")
    return shards, written


def command_line(args):
    """The `answers` command that reproduces `args`, every flag written out (the rows' gen.command)."""
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                     if k not in ("func", "recipe") and v is not None)
    return f"python -m mtp_lab train_heads answers {flags}"


def run(args):
    """The `answers` subcommand: the model's answers to the training prompts, into shards (resumable)."""
    from mtp_triton.loading import load_model, load_tokenizer
    from ..bundle import DTYPES
    rows = check_prompt_files(args.prompts.split(","))      # before the model loads: a bad file fails in a second
    torch.set_num_threads(args.threads)
    with output_lock(args.out, "an answers folder"):
        model = load_model(args.model, device="cpu", dtype=DTYPES[args.dtype])
        tok = load_tokenizer(args.model)
        command = command_line(args)
        shards, written = write_answer_shards(
            model, tok, rows, args.out, args.max_new_tokens, args.sample_share, args.temperature, args.top_p,
            args.batch, args.shard_size, args.minutes, args.max_prompt_tokens, args.seed, command=command,
            log=lambda line: print(line, flush=True))
    print(json.dumps(dict(shards_written=shards, answers_written=written)))
    return 0


def add_arguments(sp):
    """The `answers` options (registered in mtp_lab/train_heads.py)."""
    add_common(sp, "model", model=SMOLLM2)
    sp.add_argument("--prompts", default=",".join(TRAIN_PROMPTS),
                    help="prompt files, comma-separated (default %(default)s); the tuning/held-out splits are refused")
    add_common(sp, "out", out=os.path.join("data", "smollm2-135m-instruct-answers"))
    add_common(sp, "max-new-tokens", max_new_tokens=512)
    sp.add_argument("--sample-share", type=float_in(0, 1), default=1.0,
                    help="share of prompts also answered by sampling (0 to 1; default %(default)s)")
    sp.add_argument("--temperature", type=float_in(0, low_open=True), default=0.7, help="for the sampled answers")
    sp.add_argument("--top-p", type=float_in(0, 1, low_open=True), default=0.9, help="for the sampled answers")
    sp.add_argument("--batch", type=int_at_least(1), default=16, help="prompts per generate() call")
    sp.add_argument("--shard-size", type=int_at_least(1), default=128, help="answers per shard")
    sp.add_argument("--minutes", type=float_in(0, low_open=True), default=None,
                    help="time budget: no shard is begun that the last shard's time says would end past it")
    sp.add_argument("--max-prompt-tokens", type=int_at_least(1), default=512)
    sp.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the model's dtype (default fp32)")
    add_common(sp, "seed", "threads")
