"""Imported in the package's stead only when a script runs by its path (python scripts/NAME.py), which
puts scripts/ first on sys.path: ends the run with the command that works."""
import sys
from pathlib import Path

sys.exit(f"{sys.argv[0]}: run it as python -m scripts.{Path(sys.argv[0]).stem} from the repository's root")
