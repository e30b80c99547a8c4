r"""
Draws a run's profiler traces (trace_rank{R}.json from train_gpt2.py --profile=true) as a PNG
timeline with one lane of compute and one of collectives per rank, so that what overlaps shows.

    torchrun --standalone --nproc_per_node=2 train_gpt2.py configs/shakespeare_cpu.toml \
        --profile=true --max_steps=6 --out_dir=out/profile --resume=never --overwrite=true
    python -m scripts.timeline out/profile                     # out/profile/timeline.png
    python -m scripts.timeline out/profile --steps 2 --out ddp.png --title "ddp, 2 ranks"

CPU traces show collectives as gloo's threads run them, CUDA traces as NCCL's kernels run, and compute
in GPU time where recorded. Each rank's time starts at its first profiled step. Needs matplotlib.
"""

import json
import re
from pathlib import Path
if not __spec__: raise SystemExit("run it as python -m scripts.timeline from the repository root")

from gpt2_ddp import configurator
from gpt2_ddp.configurator import UserError
from scripts.plot import pyplot, save_png

COMPUTE = {"data": "tab:gray", "forward": "tab:blue", "backward": "tab:orange",
           "optimizer": "tab:green", "newton_schulz": "tab:brown"}  # drawn in this order
# the composite names first: "gather" is in "all_gather", "scatter" in "reduce_scatter"
COLLECTIVES = {"all_reduce": "tab:red", "reduce_scatter": "tab:purple", "all_gather": "tab:cyan",
               "broadcast": "tab:olive", "gather": "tab:pink", "scatter": "gold"}


def collective_kind(name):
    """The COLLECTIVES key that a c10d op's, gloo range's or NCCL kernel's name stands for, or None."""
    flat = re.sub(r"[^a-z]", "", name.lower())
    return next((kind for kind in COLLECTIVES if kind.replace("_", "") in flat), None)


def gloo_collectives(events):
    """(kind, event) of each collective gloo ran, kind as c10d issued it (not gloo's all_reduce)."""
    issued = {}  # the gloo range's kind -> the kinds c10d issued to it, in order
    for e in sorted(events, key=lambda e: e["ts"]):
        if e["name"].startswith("c10d::") and (kind := collective_kind(e["name"])):
            ran_as = "all_reduce" if kind == "reduce_scatter" else kind
            issued.setdefault(ran_as, []).append(kind)
    queues = {kind: iter(kinds) for kind, kinds in issued.items()}
    # each gloo family runs its ops in issue order, so they pair up with c10d's
    for e in sorted((e for e in events if e["name"].startswith("gloo:")), key=lambda e: e["ts"]):
        if ran_as := collective_kind(e["name"]):
            yield next(queues.get(ran_as, iter(())), ran_as), e


def complete(event):
    """Whether a trace event is a complete one ("ph": "X") with a name, a start and a duration."""
    return (isinstance(event, dict) and event.get("ph") == "X" and isinstance(event.get("name"), str)
            and all(type(event.get(key)) in (int, float) for key in ("ts", "dur")))


def lanes(trace, steps):
    """(compute, collectives) lists of (kind, start_ms, duration_ms) from the first `steps` profiled
    steps of one rank's trace. Raises UserError for a trace without profiled steps."""
    events = [e for e in trace["traceEvents"] if complete(e)]
    windows = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"].startswith("ProfilerStep#"))
    if not windows:
        raise UserError("no ProfilerStep in the trace: was it written by train_gpt2.py --profile=true?")
    start, end = windows[0][0], windows[min(steps, len(windows)) - 1][1]
    ranges = ("gpu_user_annotation" if any(e.get("cat") == "gpu_user_annotation" for e in events)
              else "user_annotation")
    kernels = [(collective_kind(e["name"]), e) for e in events if e.get("cat") == "kernel"
               and "nccl" in e["name"].lower() and collective_kind(e["name"])]

    def span(e):
        return (e["ts"] - start) / 1000, e["dur"] / 1000

    compute = [(e["name"], *span(e)) for e in events
               if e["name"] in COMPUTE and e.get("cat") == ranges and start <= e["ts"] < end]
    comm = [(kind, *span(e)) for kind, e in (kernels or gloo_collectives(events)) if start <= e["ts"] < end]
    return compute, comm


def draw(traces, out, steps, title):
    """Writes the PNG `out` of traces ({rank: chrome trace}). Raises UserError without matplotlib."""
    plt = pyplot()
    from matplotlib.patches import Patch
    from matplotlib.transforms import ScaledTranslation
    ranks = sorted(traces)
    fig, ax = plt.subplots(figsize=(14, 1.2 + 1.1 * len(ranks)))
    labels = []
    for i, rank in enumerate(ranks):
        compute, comm = lanes(traces[rank], steps)
        y = 2 * (len(ranks) - 1 - i)
        for lane_y, spans, colors in ((y + 1, compute, COMPUTE), (y, comm, COLLECTIVES)):
            for kind, start, duration in sorted(spans, key=lambda span: list(colors).index(span[0])):
                ax.broken_barh([(start, max(duration, 0.05))], (lane_y + 0.1, 0.8),
                               facecolors=colors[kind], edgecolor="black", linewidth=0.2)
        labels += [(y + 0.5, f"rank {rank} collectives"), (y + 1.5, f"rank {rank} compute")]
    ax.set_yticks([pos for pos, _ in labels], [text for _, text in labels])
    ax.set_xlabel("ms from the first profiled step")
    ax.set_title(title or f"{len(ranks)} rank(s), {steps} profiled step(s)")
    legend = {**COMPUTE, **COLLECTIVES}
    below_x_label = ax.transAxes + ScaledTranslation(0, -0.5, fig.dpi_scale_trans)  # in inches: any height
    ax.legend(handles=[Patch(color=c, label=k.replace("_", "-")) for k, c in legend.items()],
              loc="upper center", bbox_to_anchor=(0.5, 0), bbox_transform=below_x_label,
              ncol=len(legend), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    save_png(fig, out)


def main(argv):
    parser = configurator.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("run", help="an out_dir holding trace_rank*.json, or one trace file")
    parser.add_argument("--steps", type=int, default=1, help="profiled steps to draw (1-3)")
    parser.add_argument("--out", help="the PNG (default: timeline.png beside the traces)")
    parser.add_argument("--title", help="the figure's title (default: the ranks and steps drawn)")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    run = Path(args.run)
    paths = sorted(run.glob("trace_rank*.json")) if run.is_dir() else [run]
    if not paths:
        raise UserError(f"no trace_rank*.json in {run}: run train_gpt2.py with --profile=true and "
                        f"at least 6 steps")
    traces = {}
    for path in paths:
        match = re.search(r"rank(\d+)", path.name)
        try:
            trace = json.loads(path.read_text())
        except OSError as e:
            raise UserError(f"cannot read {path}: {e.strerror}") from None
        except ValueError as e:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
            raise UserError(f"{path} is not JSON ({e}): not a trace of train_gpt2.py") from None
        if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
            raise UserError(f"{path} holds no traceEvents list: not a trace of train_gpt2.py")
        traces[int(match[1]) if match else 0] = trace
    out = args.out or (run if run.is_dir() else run.parent) / "timeline.png"
    draw(traces, out, args.steps, args.title)
    print(f"wrote {out}")


if __name__ == "__main__":
    configurator.run(main, "timeline.py")
