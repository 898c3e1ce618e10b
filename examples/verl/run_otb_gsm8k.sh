#!/usr/bin/env bash
# otbrl's OTB with verl on one node of 8 GPUs: Qwen2.5-3B-Instruct on GSM8K. Steps in README.md here.
# Extra Hydra overrides are passed through, e.g. algorithm.adv_estimator=otbrl_otb_loo.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
DATA=${DATA:-$HOME/data/gsm8k}

python3 -m verl.trainer.main_ppo \
    --config-path="$HERE" --config-name=otb_gsm8k \
    data.train_files="$DATA/train.parquet" \
    data.val_files="$DATA/test.parquet" \
    "$@"
