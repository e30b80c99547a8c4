#!/usr/bin/env bash
# A long run that survives worker failures: torchrun restarts all workers up to MAX_RESTARTS
# times (default 3), and each restart resumes exactly from the latest checkpoint in out_dir
# (resume=auto), so keep checkpoint_interval small enough to lose little work.
#   NPROC=8 bash scripts/train_resilient.sh configs/gpt2_124m.toml --checkpoint_interval=500
set -euo pipefail
cd "$(dirname "$0")/.."
# On one node nothing else is needed: train_gpt2.py keeps each restart's keys apart in the store
# torchrun shares with the workers (pytorch/pytorch#135712). Across nodes, restart counts differ
# per node: there, export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 on every node before torchrun.
torchrun --standalone --nproc_per_node="${NPROC:-8}" --max-restarts="${MAX_RESTARTS:-3}" \
    train_gpt2.py "$@"
