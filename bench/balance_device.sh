#!/usr/bin/env bash
# bench/balance.py on a machine with a core per rank (the device tool's 16-core machine): the 2-core
# development machine runs 4 ranks 2:1 oversubscribed, where a straggler costs less wall time than on one
# device per rank. One rank per core (OMP_NUM_THREADS=1), then 4 cores per rank for the heavy tail.
# The suite's small model (d = 16, 1 encoder block) spends half its step outside the encoder; the d64 part
# repeats the heavy tail with d = 64 and 2 encoder blocks, where the history's compute dominates the step.
# Run from the repository root; JSON lines go to stdout and to ${OUT:-.}/balance_device.jsonl.
# The flops part balances by the model's FLOPs per sample (distributed.balance=flops) instead of tokens²,
# also with 4 encoder blocks, where the gloo collectives' fixed cost weighs less against the history's compute.
# Per-rank compute is the median of 3 timings of each rank's part (bench/balance.py --compute-repeats).
#   bash bench/balance_device.sh [small|d64|flops]      # every part by default
set -uo pipefail
out="${OUT:-.}/balance_device.jsonl"
export CUDA_VISIBLE_DEVICES=  # CPU ranks on gloo even where a GPU is visible
run() {  # label, OMP threads per rank, balance.py arguments...
  local label=$1 threads=$2
  shift 2
  echo "# $label: OMP_NUM_THREADS=$threads bench/balance.py $*" | tee -a "$out"
  OMP_NUM_THREADS=$threads timeout 150 "${PYTHON:-python3}" bench/balance.py --steps 8 --repeats 3 "$@" 2>/dev/null \
    | sed "s/^{/{\"label\": \"$label\", \"threads\": $threads, /" | tee -a "$out"
}
nproc | sed 's/^/# cores: /' | tee -a "$out"
heavy=(--batch 128 --max-len 512 --alpha 1.0)
part=${1:-all}
if [ "$part" = all ] || [ "$part" = small ]; then
  run heavy_pow2 1 --world 4 2 "${heavy[@]}" --buckets pow2
  run default 1 --world 4 2
  run heavy_16 1 --world 4 "${heavy[@]}" --buckets 16
  run heavy_pow2_8ranks 1 --world 8 --batch 256 --max-len 512 --alpha 1.0 --buckets pow2
  run heavy_pow2_4threads 4 --world 4 "${heavy[@]}" --buckets pow2
fi
if [ "$part" = all ] || [ "$part" = d64 ]; then
  run d64_heavy_pow2 1 --world 4 "${heavy[@]}" --buckets pow2 --dim 64 --encoder-layers 2
  run d64_heavy_pow2_8ranks 1 --world 8 --batch 256 --max-len 512 --alpha 1.0 --buckets pow2 --dim 64 --encoder-layers 2
fi
if [ "$part" = all ] || [ "$part" = flops ]; then
  d64=(--buckets pow2 --dim 64 --encoder-layers 2 --balance flops)
  run flops_d64_heavy_pow2 1 --world 4 "${heavy[@]}" "${d64[@]}"
  run flops_d64_heavy_pow2_8ranks 1 --world 8 --batch 256 --max-len 512 --alpha 1.0 "${d64[@]}"
  run flops_heavy_pow2 1 --world 4 "${heavy[@]}" --buckets pow2 --balance flops
  run flops_d64x4_heavy_pow2 1 --world 4 "${heavy[@]}" --buckets pow2 --dim 64 --encoder-layers 4 --balance flops
fi
