"""The HTML report of ``kvspec check --html``: each trace's verdict, and for a violation a picture
of the involved blocks against time (who allocated, published, wrote, read and freed each) beside
the minimal history. Rendered from ``report.Report`` data only."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib
import matplotlib.ticker

from .report import Report

MARKERS = {
    "alloc": ("o", "tab:blue", "allocated"),
    "hit": ("D", "tab:cyan", "hit (touched)"),
    "publish": ("^", "tab:orange", "published"),
    "wrote": ("s", "tab:green", "written by a step"),
    "read": ("v", "tab:purple", "read by a step"),
    "unpublish": ("x", "tab:brown", "unpublished"),
    "evict": ("X", "tab:gray", "evicted"),
    "free": ("P", "black", "freed"),
    "dedup": ("*", "tab:pink", "deduplicated onto"),
}


def picture(report: Report) -> bytes:
    """Blocks against time (trace lines): who allocated, published, wrote, read and freed each
    involved block; the violating event is the red line. A PNG."""
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # after choosing the backend: no display needed

    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.5 * len({b for _, b, _, _ in report.timeline})))
    try:
        for kind, (marker, color, label) in MARKERS.items():
            points = [(ln, b, r) for ln, b, k, r in report.timeline if k == kind]
            if not points:
                continue
            ax.scatter([p[0] for p in points], [p[1] for p in points], marker=marker, c=color, s=60, label=label, zorder=3)  # fmt: skip
            for ln, b, r in points:
                if r is not None:
                    ax.annotate(f"r{r}", (ln, b), textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7)  # fmt: skip
        if report.line is not None:
            ax.axvline(report.line, color="red", linewidth=2, label=f"{report.invariant} (line {report.line})")  # fmt: skip
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("trace line (time)")
        ax.set_ylabel("block")
        blocks = sorted({b for _, b, _, _ in report.timeline})
        if blocks:
            ax.set_yticks(blocks)
            ax.set_ylim(min(blocks) - 0.8, max(blocks) + 0.8)
        ax.grid(True, axis="x", alpha=0.3)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
        ax.set_title(f"{report.path}: history of the blocks involved")
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        return buffer.getvalue()
    finally:
        plt.close(fig)


def write_html(reports: list[Report], path: str | Path) -> None:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvspec check</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto}.bad{color:#b00}</style>",
        "</head><body><h1>kvspec check</h1>",
    ]
    for report in reports:
        esc = html.escape
        parts.append(f"<h2>{esc(report.path)}: {esc(report.status)}</h2>")
        if report.exit_code == 2:
            parts.append(f"<p class='bad'>{esc(report.error or '')}</p>")
            continue
        parts.append(f"<p>{report.events} events checked in {report.seconds:.2f} s.</p>")
        if report.exit_code == 0:
            continue
        parts.append(
            f"<p class='bad'><b>{esc(report.invariant or '')}</b> at "
            f"<code>{esc(report.path)}:{report.line}</code>: {esc(report.message or '')}</p>"
            f"<p>Violating event: {esc(report.event or '')}</p>"
            f"<p><i>{esc(report.explanation or '')}</i></p>"
        )
        png = base64.b64encode(picture(report)).decode("ascii")
        parts.append(
            f"<img alt='history of the blocks involved' src='data:image/png;base64,{png}'>"
        )
        parts.append("<h3>Minimal history</h3><pre>")
        parts += [f"{ln:>8}  {esc(text)}\n" for ln, text in report.history]
        parts.append("</pre>")
    parts.append("</body></html>")
    Path(path).write_text("".join(parts), encoding="utf-8")
