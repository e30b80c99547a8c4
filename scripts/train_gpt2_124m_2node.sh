#!/usr/bin/env bash
# GPT-2 124M on two nodes of 8 GPUs, with torchrun's c10d rendezvous. Run this same command on
# both nodes, with MASTER_HOST set to the address of the first node (reachable from the second):
#   MASTER_HOST=10.0.0.1 bash scripts/train_gpt2_124m_2node.sh
# Both nodes need the data at the same data_dir; only global rank 0 writes out_dir.
set -euo pipefail
cd "$(dirname "$0")/.."
: "${MASTER_HOST:?set MASTER_HOST to the first node's address}"
torchrun --nnodes=2 --nproc_per_node=8 \
    --rdzv-backend=c10d --rdzv-endpoint="${MASTER_HOST}:29500" --rdzv-id=gpt2_124m \
    train_gpt2.py configs/gpt2_124m.toml "$@"
