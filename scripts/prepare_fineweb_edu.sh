#!/usr/bin/env bash
# Tokenize FineWeb-Edu sample-10BT (about 10B GPT-2 tokens, 100 shards of 100M) into
# data/fineweb-edu/, streamed from the Hugging Face hub (needs a network; about 20 GB on disk).
# The first 100M tokens form the val shard, as in build-nanogpt.
set -euo pipefail
cd "$(dirname "$0")/.."
python prepare_data.py --dataset HuggingFaceFW/fineweb-edu --dataset_config sample-10BT "$@"
