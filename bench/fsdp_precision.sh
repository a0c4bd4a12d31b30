#!/usr/bin/env bash
# FSDP2 with and without train.precision=bf16 (its mixed-precision policy), 2 ranks: the bytes per step of
# each collective and the loss after 5 steps. Run from the repository root: bash bench/fsdp_precision.sh
set -euo pipefail
small=("data.synthetic.rows={train: 2048, valid: 256, test: 256}" data.synthetic.num_sparse=4
       data.synthetic.num_multi=1 data.synthetic.vocab_sizes=64 data.num_workers=0 model.embedding.dim=8
       model.num_layers=1 model.dropout=0 train.batch_size=64 train.max_steps=5 train.log_every=5
       train.progress=false train.early_stopping=null distributed.sharding=row_wise distributed.dense=fsdp
       distributed.count_bytes=true)
out=$(mktemp -d)
for p in fp32 bf16; do
  .venv/bin/recscale train configs/demo.yaml --out "$out/$p" --nproc 2 "${small[@]}" "train.precision=$p" > /dev/null 2>&1
  .venv/bin/python -c "
import json, sys
r = [json.loads(x) for x in open(sys.argv[1]) if '\"train\"' in x][-1]
print(sys.argv[2], 'loss', round(r['loss'], 5), {k: v['intra'] for k, v in r['comm'].items()})" "$out/$p/metrics.jsonl" "$p"
done
rm -rf "$out"
