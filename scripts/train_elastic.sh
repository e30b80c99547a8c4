#!/usr/bin/env bash
# An elastic run on MIN to MAX nodes (NNODES, default 1:2) that goes on when a node is lost: the
# survivors restart at the smaller world size, up to MAX_RESTARTS times (default 3), and resume from
# the latest checkpoint in out_dir, which every node must see. Run this same command on every node,
# with RDZV_HOST set to the address of one of them, which must stay up (it holds the rendezvous):
#   RDZV_HOST=10.0.0.1 NPROC=8 bash scripts/train_elastic.sh configs/gpt2_124m.toml --checkpoint_interval=500
# RDZV_PORT (default 29500) and RDZV_ID (default gpt2_elastic) name the rendezvous; TORCHRUN_ARGS adds
# torchrun flags, such as shorter rendezvous timeouts: --rdzv-conf=join_timeout=60,last_call_timeout=5
set -euo pipefail
cd "$(dirname "$0")/.."
: "${RDZV_HOST:?set RDZV_HOST to the address of the node that holds the rendezvous}"
# restart counts differ per node, so the workers of each restart need a store of their own
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# exec: a stop signal to this script reaches torchrun, which passes it on to the workers
# shellcheck disable=SC2086  # TORCHRUN_ARGS holds several flags
exec torchrun --nnodes="${NNODES:-1:2}" --nproc_per_node="${NPROC:-8}" --max-restarts="${MAX_RESTARTS:-3}" \
    --rdzv-backend=c10d --rdzv-endpoint="${RDZV_HOST}:${RDZV_PORT:-29500}" \
    --rdzv-id="${RDZV_ID:-gpt2_elastic}" ${TORCHRUN_ARGS:-} train_gpt2.py "$@"
