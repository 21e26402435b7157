"""The training curve: train/validation loss and validation BLEU from the JSONL log, as a PNG
(a multilingual run: validation BLEU of each direction)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def plot_curve(log_path: Path, png_path: Path) -> list[str]:
    """Draw the curve; returns the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt

    train: list[dict[str, Any]] = []
    valid: list[dict[str, Any]] = []
    for line in log_path.read_text().splitlines():
        rec = json.loads(line)
        (valid if rec.get("kind") == "valid" else train).append(rec)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss (label-smoothed)", lw=1)
    ax.plot([r["step"] for r in valid], [r["valid_loss"] for r in valid], "o-", label="valid loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss per token")
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    directions = sorted({name for r in valid for name in r.get("directions", {})})
    if directions:  # a multilingual run: one BLEU line per direction
        for name in directions:
            points = [
                (r["step"], r["directions"][name]["valid_bleu"])
                for r in valid
                if name in r.get("directions", {})
            ]
            ax2.plot(*zip(*points, strict=True), "s--", ms=3, label=f"valid BLEU {name}")
    else:
        ax2.plot(
            [r["step"] for r in valid],
            [r["valid_bleu"] for r in valid],
            "s--",
            color="tab:green",
            label="valid BLEU",
        )
    ax2.set_ylabel("valid BLEU (greedy)", color="tab:green")
    lines = ax.get_lines() + ax2.get_lines()
    labels = [str(line.get_label()) for line in lines]
    ax.legend(lines, labels, loc="center right")
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return labels
