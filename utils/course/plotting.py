"""One matplotlib style for every figure of the course."""
from __future__ import annotations

import os
from pathlib import Path

import matplotlib as mpl

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "images"                 # committed figures: written only when reference results are regenerated
LEARNER_FIGURES = ROOT / "build" / "figures"   # everyone else's runs (ignored by git)
WRITE_IMAGES_VAR = "COURSE_WRITE_IMAGES"  # set to 1 by `python -m utils.course.references`

STYLE = {
    "figure.figsize": (7.0, 4.0),
    "figure.dpi": 110,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titleweight": "bold",
    "legend.frameon": False,
    "lines.linewidth": 2.0,
    "lines.markersize": 5,
}


def use_course_style() -> None:
    """Apply the course's plot style to matplotlib's global settings."""
    mpl.rcParams.update(STYLE)


def pyplot():
    """matplotlib.pyplot in the course's style, for a benchmark that saves its plots: a notebook keeps its inline
    backend; anywhere else (a terminal, a GPU machine without a display) the file-only Agg backend is chosen."""
    if mpl.get_backend().lower() not in ("agg", "module://matplotlib_inline.backend_inline"):
        mpl.use("Agg")
    import matplotlib.pyplot as plt

    use_course_style()
    return plt


def seqlen_axis(ax, seqlens) -> None:
    """A log2 x-axis ticked at the sequence lengths, labelled 512, 1k, 2k, ..."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(seqlens, [f"{n // 1024}k" if n % 1024 == 0 else str(n) for n in seqlens])
    ax.minorticks_off()
    ax.set_xlabel("sequence length N")


def figure_dir() -> Path:
    """Where figures go: images/ while reference results are regenerated, else build/figures/, so that a
    learner's run never overwrites the committed figures."""
    return IMAGES if os.environ.get(WRITE_IMAGES_VAR) == "1" else LEARNER_FIGURES


def save_figure(fig, name: str) -> Path:
    """Save `fig` as <figure_dir()>/<name>.png (name without extension) and return the path."""
    if not isinstance(name, str) or not name or "/" in name or name.endswith(".png"):
        raise ValueError(f"name must be a bare file name without extension, got {name!r}")
    folder = figure_dir()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.png"
    fig.savefig(path, bbox_inches="tight")
    return path


def write_png(fig, path) -> Path:
    """Save `fig` at `path` (a benchmark's own output file), close it, and return the path."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return path
