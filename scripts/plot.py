"""
Plots runs' log.jsonl into one PNG, overlaid and named by directory: train and val loss, HellaSwag
acc_norm against GPT-2 124M's and GPT-3 125M's, learning rate, tokens/s, MFU and gradient norm, then
a panel for each other number the logs hold (a fork's own values, muon_lr, mem_gb, loss_scale...).

    python -m scripts.plot out/shakespeare_cpu                       # writes out/shakespeare_cpu/plot.png
    python -m scripts.plot out/run_a out/run_b/log.jsonl --out compare.png

Needs matplotlib (pip install matplotlib), which training does not.
"""

import math
from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.plot from the repository root")

import numpy as np

from gpt2_ddp import configurator
from gpt2_ddp.atomic import atomic_write
from gpt2_ddp.configurator import UserError
from gpt2_ddp.runs import read_log

# build-nanogpt's references: GPT-2 124M under this scoring, GPT-3 Small from its paper's table 3.2
REFERENCES = {"GPT-2 124M": 0.2955, "GPT-3 125M": 0.337}
PANELS = [  # (title, log key, y scale)
    ("loss", "loss", "linear"), ("HellaSwag acc_norm", "hellaswag_acc_norm", "linear"),
    ("learning rate", "lr", "linear"), ("tokens/s", "tokens_per_sec", "linear"),
    ("MFU (%)", "mfu", "linear"), ("gradient norm", "grad_norm", "log")]
# logged numbers with no panel of their own: val_loss is in the loss panel, dt_ms is tokens/s,
# optimizer_state_bytes comes once and hellaswag_examples is a count
NOT_DRAWN = {"step", "val_loss", "dt_ms", "optimizer_state_bytes", "hellaswag_examples"}


def number(value):
    """Whether a value is a float (numpy's too) or an int64-sized int; a bool is neither."""
    return isinstance(value, float) or type(value) is int and abs(value) < 2**63


def series(records, key):
    """(steps, values) numpy arrays of the records holding a finite `key`: a NaN ends a moving average."""
    points = [(r["step"], r[key]) for r in records if number(r.get(key)) and math.isfinite(r[key])]
    return np.array([p[0] for p in points]), np.array([p[1] for p in points], dtype=float)


def smooth(values):
    """Moving average over a 50th of the run (at least 1 step), shorter over the first steps."""
    window = max(1, len(values) // 50)
    sums = np.cumsum(np.insert(values, 0, 0.0))
    counts = np.minimum(np.arange(1, len(values) + 1), window)
    return (sums[1:] - sums[np.maximum(0, np.arange(1, len(values) + 1) - window)]) / counts


def pyplot():
    """matplotlib.pyplot, drawing to files only. Raises UserError if matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        raise UserError("matplotlib is not installed: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no window
    import matplotlib.pyplot as plt
    return plt


def save_png(fig, out):
    """Writes fig to the PNG `out` atomically and closes it. Raises UserError, naming `out`, if it can't."""
    import matplotlib.pyplot as plt
    try:
        if Path(out).is_dir():
            raise UserError(f"{out} is a directory: pass --out the path of a PNG file")
        fig.tight_layout()
        atomic_write(out, lambda f: fig.savefig(f, format="png", dpi=100))
    except OSError as e:
        raise UserError(f"cannot write {out}: {e.strerror}; pass --out a path you can write") from None
    finally:
        plt.close(fig)


def plot(runs, out):
    """Draws `runs` ({label: records}) into the PNG `out`, a panel for each key of PANELS that some
    record holds (the loss panel always), then one titled by its key for each other key under which
    some record holds a finite number, but NOT_DRAWN's, in the order the logs first hold them.
    Raises UserError without matplotlib."""
    plt = pyplot()
    panels = [panel for panel in PANELS if panel[1] == "loss" or any(
        len(series(records, panel[1])[0]) for records in runs.values())]
    drawn = NOT_DRAWN | {key for _, key, _ in PANELS}
    panels += [(key, key, "linear") for key in dict.fromkeys(
        key for records in runs.values() for r in records for key, value in r.items()
        if key not in drawn and number(value) and math.isfinite(value))]
    rows, columns = math.ceil(len(panels) / 3), min(len(panels), 3)
    fig, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), sharex=True, squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.remove()
    loss_ranges = []  # each run's lowest loss and train loss's 95th percentile: its first steps lie above
    for ax, (title, key, scale) in zip(axes.flat, panels):
        ax.set(title=title, xlabel="step", yscale=scale)
        for i, (label, records) in enumerate(runs.items()):
            color = f"C{i}"
            steps, values = series(records, key)
            if key == "mfu":
                values = values * 100
            if key == "loss":
                val_steps, val = series(records, "val_loss")
                if len(steps):
                    ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
                    ax.plot(steps, smooth(values), color=color, label=f"{label} train (smoothed)")
                if len(val_steps):
                    ax.plot(val_steps, val, "o--", color=color, markersize=3, label=f"{label} val")
                if len(steps) or len(val_steps):
                    loss_ranges.append((np.concatenate([values, val]).min(),
                                        np.percentile(values if len(steps) else val, 95)))
            elif len(steps):
                ax.plot(steps, values, color=color, marker="o" if len(steps) < 50 else None,
                        markersize=3, label=label)
        if loss_ranges and key == "loss":  # the first steps' fall would squeeze the rest to the bottom
            low, top = min(r[0] for r in loss_ranges), max(r[1] for r in loss_ranges)
            span = (top - low) or 1.0
            ax.set_ylim(low - 0.05 * span, top + 0.2 * span)
        if not ax.lines:
            ax.text(0.5, 0.5, f"no {key} in these logs", ha="center", va="center",
                    transform=ax.transAxes, color="gray")
        elif key == "hellaswag_acc_norm":  # the references only beside data
            for (name, value), style in zip(REFERENCES.items(), ("--", ":")):
                ax.axhline(value, color="gray", linestyle=style, label=f"{name} ({value})")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    save_png(fig, out)


def plottable(record):
    """Whether a record has a finite step, and an int64-sized number (no bool) or null under each key."""
    values = [record.get(key) for key in ("step", "val_loss", *(key for _, key, _ in PANELS))]
    return (all(v is None or number(v) for v in values)
            and values[0] is not None and math.isfinite(values[0]))


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("logs", nargs="+", help="log.jsonl files or the out_dirs holding them")
    parser.add_argument("--out", help="the PNG to write (default: plot.png beside the first log)")
    args = parser.parse_args(argv)
    dirs = [path if path.is_dir() else path.parent for path in map(Path, args.logs)]
    runs = {}
    for log, folder in zip(args.logs, dirs):
        label = folder.resolve().name
        while label in runs:
            label += "'"
        runs[label] = read_log(log, plottable, "a record of train_gpt2.py")
    out = args.out or dirs[0] / "plot.png"
    plot(runs, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    configurator.run(main, "plot.py")
