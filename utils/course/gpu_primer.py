"""The figure of notebook 00's GPU primer: a GPU, one of its SMs, and one thread block, drawn with matplotlib.

    python -m utils.course.gpu_primer                 # rewrites images/gpu_primer.png
    python -m utils.course.gpu_primer out.png         # writes it elsewhere

Every number on it is a datasheet fact about the NVIDIA H200 (notebook 00 names the sources); none is measured.
"""
from __future__ import annotations

import sys
from pathlib import Path

from utils.course.plotting import IMAGES, pyplot

PNG = IMAGES / "gpu_primer.png"
COLORS = {"hbm": "#e76f51", "l2": "#f4a261", "sm": "#2a9d8f", "smem": "#e9c46a", "reg": "#8ab17d",
          "tc": "#264653", "warp": "#287271", "text": "#1d1d1d"}


def _box(ax, x, y, w, h, color, text="", fontsize=8, text_color="white", alpha=1.0, **kwargs):
    """A filled rectangle with centred text; returns the patch."""
    from matplotlib.patches import FancyBboxPatch

    patch = FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.0,rounding_size=0.06", facecolor=color,
                           edgecolor="white", linewidth=1.0, alpha=alpha, **kwargs)
    ax.add_patch(patch)
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=fontsize, color=text_color)
    return patch


def _gpu(ax):
    """Left panel: the chip (SMs and L2) above its HBM."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((0.1, 1.15), 4.6, 3.55, facecolor="#f4f4f4", edgecolor="#999999", linewidth=1.0))
    ax.text(2.4, 4.5, "GPU chip: an H200 has 132 SMs (32 drawn)", ha="center", fontsize=9, weight="bold")
    for row in range(4):
        for col in range(8):
            highlight = (row, col) == (0, 7)
            _box(ax, 0.3 + col * 0.54, 3.55 - row * 0.5, 0.46, 0.4, COLORS["sm"], "SM", fontsize=6,
                 alpha=1.0 if highlight else 0.75)
    _box(ax, 0.3, 1.3, 4.2, 0.45, COLORS["l2"], "L2 cache: 50 MB, shared by all SMs", text_color=COLORS["text"])
    _box(ax, 0.1, 0.1, 4.6, 0.6, COLORS["hbm"], "HBM (global memory): 141 GB, 4.8 TB/s", fontsize=8.5)
    ax.annotate("", xy=(2.4, 1.3), xytext=(2.4, 0.7), arrowprops=dict(arrowstyle="<->", color="#555555"))
    ax.annotate("", xy=(2.4, 2.05), xytext=(2.4, 1.75), arrowprops=dict(arrowstyle="<->", color="#555555"))


def _sm(ax):
    """Middle panel: one SM, four quarters, each with its registers, scheduler and tensor core."""
    from matplotlib.patches import Rectangle

    ax.add_patch(Rectangle((5.2, 0.1), 3.5, 4.6, facecolor="#eef6f5", edgecolor=COLORS["sm"], linewidth=1.5))
    ax.text(6.95, 4.5, "one SM", ha="center", fontsize=9, weight="bold")
    ax.text(6.95, 4.25, "(streaming multiprocessor)", ha="center", fontsize=7.5)
    for i in range(4):
        x, y = 5.35 + (i % 2) * 1.7, 2.75 - (i // 2) * 1.5
        _box(ax, x, y + 0.95, 1.5, 0.3, COLORS["warp"], "warp scheduler", fontsize=6.5)
        _box(ax, x, y + 0.55, 1.5, 0.35, COLORS["reg"], "registers 64 KB", fontsize=6.5, text_color=COLORS["text"])
        _box(ax, x, y + 0.15, 0.72, 0.35, COLORS["tc"], "tensor\ncore", fontsize=6)
        _box(ax, x + 0.78, y + 0.15, 0.72, 0.35, "#6c757d", "FP32\nunits", fontsize=6)
    _box(ax, 5.35, 0.25, 3.2, 0.5, COLORS["smem"], "shared memory: up to 228 KB per SM", text_color=COLORS["text"])
    # the highlighted SM of the left panel is the one drawn here
    for y in (3.55, 3.95):
        ax.plot([4.54, 5.2], [y, 4.7 if y > 3.7 else 0.1], color=COLORS["sm"], linewidth=0.8, alpha=0.6)


def _block(ax):
    """Right panel: a thread block (one Triton program) of 4 warps of 32 threads: one warpgroup."""
    ax.text(10.6, 4.5, "thread block = one program", ha="center", fontsize=9, weight="bold")
    ax.text(10.6, 4.18, "runs on one SM; a launch runs a grid of them", ha="center", fontsize=7.5)
    for w in range(4):
        y = 3.35 - w * 0.62
        ax.text(9.05, y + 0.2, f"warp {w}", ha="right", va="center", fontsize=7)
        for t in range(32):
            _box(ax, 9.12 + (t % 16) * 0.165, y + (0.2 if t < 16 else 0.0), 0.15, 0.18, COLORS["warp"],
                 alpha=0.9)
    ax.text(10.45, 0.95, "32 threads a warp, in lockstep\n4 warps = 1 warpgroup (128 threads)",
            ha="center", va="center", fontsize=7.5)
    ax.annotate("", xy=(11.95, 3.75), xytext=(11.95, 1.3), arrowprops=dict(arrowstyle="-", color="#555555"))
    ax.text(12.0, 2.5, "warpgroup", rotation=90, va="center", fontsize=7.5)


def draw():
    """The primer's figure as a matplotlib Figure."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10.5, 4.0), dpi=90)
    ax.set_xlim(0, 12.3)
    ax.set_ylim(0, 4.8)
    ax.set_aspect("equal")
    ax.axis("off")
    _gpu(ax)
    _sm(ax)
    _block(ax)
    return fig


def write(path=PNG) -> Path:
    """Draw the figure and save it as the PNG `path`; returns the path."""
    path = Path(path)
    if path.suffix != ".png":
        raise ValueError(f"path must end in .png, got {str(path)!r}")
    from utils.course.plotting import write_png

    return write_png(draw(), path)


if __name__ == "__main__":
    print(write(sys.argv[1] if len(sys.argv) > 1 else PNG))
