"""Imported in the package's stead only when a script runs by its path (python scripts/NAME.py), which
puts scripts/ first on sys.path: ends the run with the command that works."""
import sys
from pathlib import Path

if __name__ == "gpt2_ddp":  # not as scripts.gpt2_ddp, which tools that import every script load
    sys.exit(f"{sys.argv[0]}: run it as python -m scripts.{Path(sys.argv[0]).stem} from the repository root")
