"""Loss curves of one or several runs as a PNG, from their metrics.jsonl (`kubetrain runs plot`)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from kubetrain.errors import UserInputError
from kubetrain.runs.reader import RunRecords, expand

WIDTH_PX, HEIGHT_PX, DPI = 1200, 500, 100
XAxis = Literal["step", "tokens"]


def plot_losses(paths: list[Path], out: Path, x: XAxis = "step") -> Path:
    """Write train loss (left) and validation loss (right) of each run, one colour per run, to `out`."""
    if out.suffix.lower() != ".png":
        raise UserInputError(f"the plot is a PNG: give an output file ending in .png, not '{out.name}'")
    series = [RunRecords.read(label, path) for label, path in expand(paths)]
    if not any(s.train or s.evals for s in series):
        raise UserInputError(f"no loss records to plot in {', '.join(str(p) for p in paths)}")
    try:
        # Figure + the Agg canvas, not pyplot: no global state, no display needed, safe in a server or a test.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise UserInputError("the 'matplotlib' package is missing: pip install 'matplotlib>=3.8'") from None

    fig = Figure(figsize=(WIDTH_PX / DPI, HEIGHT_PX / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    train_ax, val_ax = fig.subplots(1, 2)
    for i, s in enumerate(series):
        color = f"C{i % 10}"
        if s.train:
            train_ax.plot([r[x] for r in s.train], [r["loss"] for r in s.train], color=color, label=s.label)
        if s.evals:
            val_ax.plot([r[x] for r in s.evals], [r["val_loss"] for r in s.evals], color=color, marker="o",
                        markersize=3, label=s.label)
    for ax, title in ((train_ax, "train loss"), (val_ax, "validation loss")):
        ax.set_title(title)
        ax.set_xlabel("tokens" if x == "tokens" else "step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
        else:
            ax.text(0.5, 0.5, "no records", ha="center", va="center", transform=ax.transAxes, color="gray")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    return out
