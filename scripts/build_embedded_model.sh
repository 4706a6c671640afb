#!/usr/bin/env bash
# Rebuild data/tiny-stdlib-llama (the embedded model) from the running Python's standard library, on CPU.
# These are the exact commands behind the committed model; ~52 min of training on 2 cores, plus ~25 min for
# the optional frozen-vs-joint comparison (COMPARE=0 skips it). Training stops on wall-clock budgets
# (--max-minutes) as well as step counts, so a busier machine gives fewer steps: compare records/*.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
M=data/tiny-stdlib-llama
R=$M/records
CACHE=${CACHE:-/tmp/mtp-corpus-cache}
WORK=${WORK:-/tmp/mtp-build}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$R" "$WORK"
want() { [[ "${STEPS:-1234567}" == *$1* ]]; }   # STEPS=67 runs only steps 6 and 7

# 1. held-out prompts: code cut from third-party packages in site-packages (never the stdlib)
if want 1; then
  $PY -m mtp_lab.corpus --prompts-out data/prompts/thirdparty_code.jsonl
fi

# 2. corpus statistics + byte-level BPE tokenizer (vocab 4096) trained on the training split
if want 2; then
  $PY -m mtp_lab.corpus --tokenizer-out $M --stats-out $R/corpus.json
fi

# 3. joint MTP pre-training: next-token loss + 0.3 x mean of 4 head losses (28 + 14 min budget)
if want 3; then
  $PY -m mtp_lab.train_heads joint --tokenizer $M --out $M --records $R --cache-dir $CACHE \
      --num-heads 4 --mtp-weight 0.3 --head-frac 0.25 --steps 1100 --max-minutes 28 --lr 3e-3 --warmup 50 \
      --batch 8 --seq-len 512 --log-every 10 --eval-every 100 --seed 0
  #    ... continued for 14 more minutes with a fresh warm-up + cosine schedule (the first 28 min on a busy
  #    machine left the held-out loss still falling fast)
  $PY -m mtp_lab.train_heads joint --tokenizer $M --init-model $M --out $M --records $R --run-name train_joint_2 \
      --cache-dir $CACHE --num-heads 4 --mtp-weight 0.3 --head-frac 0.25 --steps 700 --max-minutes 14 --lr 2e-3 \
      --warmup 20 --batch 8 --seq-len 512 --log-every 10 --eval-every 100 --seed 2
fi

# 4. 8 heads self-distilled on the frozen base (from the 4 joint heads), on cached hidden states of the base's
#    own greedy continuations + real text; measures accuracy.json and simulated tau on the prompts (10 min budget)
if want 4; then
  $PY -m mtp_lab.train_heads frozen --model $M --out $M/heads --records $R --cache-dir $CACHE \
      --init $M/heads_joint --num-heads 8 --targets soft --real-windows 128 --self-generated 768 \
      --prompt-len 128 --seq-len 512 --batch 4 --steps 1400 --max-minutes 10 --lr 1e-3 --warmup 20 \
      --eval-generated 32 --eval-new-tokens 128 --eval-prompts data/prompts/thirdparty_code.jsonl --seed 0
fi

# 5. tau with the real decoder (mtp_triton.generate), greedy, per tree, on the third-party prompts
if want 5; then
  $PY -m mtp_lab.train_heads eval --model $M --heads $M/heads --prompts data/prompts/thirdparty_code.jsonl \
      --new-tokens 128 --tree-budget 32 --out $R/tau_generate.json
fi

# 6. (optional) frozen base vs joint: two equal small budgets differing only in the MTP loss weight,
#    each followed by the same frozen-base distillation of 4 heads (plain: from zero, Medusa-style;
#    joint: from its joint heads). Models stay in $WORK; only the records are kept.
if want 6; then
  if [ "${COMPARE:-1}" = 1 ]; then
    for kind in plain joint; do
      w=0.3; [ $kind = plain ] && w=0
      init=(); [ $kind = joint ] && init=(--init $WORK/$kind/heads_joint)
      $PY -m mtp_lab.train_heads joint --tokenizer $M --out $WORK/$kind --records $R/compare_$kind \
          --cache-dir $CACHE --num-heads 4 --mtp-weight $w --head-frac 0.25 --steps 400 --max-minutes 60 \
          --lr 3e-3 --warmup 50 --batch 8 --seq-len 512 --log-every 10 --eval-every 100 --seed 1
      $PY -m mtp_lab.train_heads frozen --model $WORK/$kind --out $WORK/$kind/heads --records $R/compare_$kind \
          --cache-dir $CACHE "${init[@]}" --num-heads 4 --targets soft --real-windows 64 --self-generated 128 \
          --prompt-len 128 --seq-len 512 --batch 4 --steps 300 --max-minutes 60 --lr 1e-3 --warmup 20 \
          --eval-generated 16 --eval-new-tokens 128 --eval-prompts data/prompts/thirdparty_code.jsonl --seed 1
    done
  fi
fi

# 7. the model card, rendered from records/ (with the sha256 of every file): run last
if want 7; then
  $PY $M/make_card.py
fi
