#!/usr/bin/env bash
# The CPU quickstart: tokenize the embedded tiny shakespeare corpus, then train a small GPT with
# DDP over two CPU processes (gloo). A few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
python prepare_data.py  # says in a second that it has nothing to do where the shards are made
OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 train_gpt2.py configs/shakespeare_cpu.toml "$@"
