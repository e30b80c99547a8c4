"""train_gpt2.main over several runs in one worker process, for tests that train many configs at one
world size: each torchrun launch starts its workers and imports torch once, however many runs follow.

    PYTHONPATH=. torchrun --standalone --nproc_per_node=2 tests/many_runs.py RUNS.json

RUNS.json holds a list of argument lists, trained in order (run_each).
"""

import gc
import json
import os
import sys

import train_gpt2


def run_each(runs, train=train_gpt2.main):
    """train(run) for each of `runs` in turn; exits with the first non-zero exit code, or raises what
    train raised. Each run joins its process group under a store prefix of its own, as a restarted
    worker does (train_gpt2.setup_distributed's TORCHELASTIC_RESTART_COUNT), so that no run reads
    the keys of the run before it."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for i, run in enumerate(runs):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{attempt}_run_{i}"
        code = train(run)
        gc.collect()
        if code:
            sys.exit(code)


if __name__ == "__main__":
    run_each(json.loads(open(sys.argv[1]).read()))
