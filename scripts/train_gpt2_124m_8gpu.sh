#!/usr/bin/env bash
# GPT-2 124M on one node of 8 GPUs (DDP over NCCL). Run scripts/prepare_fineweb_edu.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"  # torchrun's default, set so that it does not warn
torchrun --standalone --nproc_per_node=8 train_gpt2.py configs/gpt2_124m.toml "$@"
