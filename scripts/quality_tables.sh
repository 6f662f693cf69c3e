#!/usr/bin/env bash
# The quality tables (issues 34 and 37): each comparison at 5 seeds on both tiny targets (the
# demo's synthetic world and a GSM8K-trained Qwen3), DFlash 1 and DFlash 2, tau by the
# reference client over held-out prompts, with 95% intervals (`dflash-train compare`).
#
#   bash scripts/quality_tables.sh WORK [objectives|losses|all] [demo|gsm|both]
#
# With the project's venv active. One run at a time, resumable: running the same command again
# skips every (variant, seed) whose result is in WORK/cmp/*/results.jsonl. Each table is
# WORK/cmp/NAME/summary.md. GSM8K comes from ../shared/data/gsm8k (or $GSM8K). Hours on 2 CPU
# cores: about 5 minutes a run alone.
set -euo pipefail
WORK=${1:?usage: quality_tables.sh WORK [objectives|losses|all] [demo|gsm|both]}
WHAT=${2:-all}
TARGETS=${3:-both}
HERE=$(cd "$(dirname "$0")" && pwd)
GSM8K=${GSM8K:-$HERE/../../shared/data/gsm8k}
SEEDS=${SEEDS:-5}
mkdir -p "$WORK" && cd "$WORK"
export OMP_NUM_THREADS=1

# The demo's recipe (`dflash-train demo`): two target and two drafter replicas on CPU threads.
FLAGS="--target-devices cpu,cpu --drafter-devices cpu,cpu --cpu-threads 1 --draft-layers 1
  --block-size 16 --target-layer-ids 0 --num-anchors 32 --batch-size 4 --batch-cost blocks
  --lr 5e-3 --epochs 2 --num-prefetchers 2 --hs-queue-depth 120 --hs-min-ready 90
  --log-every 50 --no-progress"
FLAGS=$(echo $FLAGS)
OBJECTIVES=(--variant "decay-adamw=--position-weights decay --optimizer adamw"
            --variant "dpace-adamw=--position-weights dpace --optimizer adamw"
            --variant "dpace-muon=--position-weights dpace --optimizer muon")
LOSSES=(--variant "ce=--loss ce" --variant "kl=--loss kl"
        --variant "lk_alpha=--loss lk_alpha" --variant "lk_lambda=--loss lk_lambda")

targets() {
  if [[ $TARGETS != gsm && ! -f demo/target/config.json ]]; then
    dflash-train demo --out demo >demo.log
    python "$HERE/demo_heldout.py" --demo demo --num 256
  fi
  if [[ $TARGETS != demo && ! -f gsm/target/model.safetensors ]]; then
    python "$HERE/gsm8k_target.py" --gsm8k "$GSM8K" --out gsm --heldout 256
    dflash-train prepare --data gsm/train.jsonl --tokenizer gsm/target --out gsm/prepared \
      --max-length 1024
  fi
}

table() {  # NAME TARGET ARCH FLAGS VARIANT...
  local name=$1 target=$2 arch=$3 flags=$4
  shift 4
  local prompts=demo/data/heldout-256.jsonl
  [[ $target == gsm ]] && prompts=gsm/heldout.jsonl
  dflash-train compare --out "cmp/$name" --target "$target/target" --data "$target/prepared" \
    --prompts "$prompts" --seeds "$SEEDS" --train-flags "$flags --arch $arch" "$@"
}

targets
GFLAGS="${FLAGS/--epochs 2/--epochs 1 --max-steps 900}"
for target in demo gsm; do
  [[ $TARGETS == both || $TARGETS == "$target" ]] || continue
  flags=$FLAGS
  [[ $target == gsm ]] && flags=$GFLAGS
  for arch in dflash dflash2; do
    if [[ $WHAT == objectives || $WHAT == all ]]; then
      table "$target-$arch" "$target" "$arch" "$flags" "${OBJECTIVES[@]}"
    fi
    if [[ $WHAT == losses || $WHAT == all ]]; then
      table "$target-$arch-losses" "$target" "$arch" "$flags" "${LOSSES[@]}"
    fi
  done
done
echo "tables: $(ls -d cmp/*/summary.md 2>/dev/null | tr '\n' ' ')"
