"""The HTML report of ``kvspec check --html``: each trace's verdict; where the report carries its
trace's timeline (``Report.lanes``, ``trace_events.timeline``), an interactive timeline drawn as
inline SVG with a little inline JavaScript (one file, no server, no network): the same lanes as
the Perfetto export (steps, one per request, one per block), each mark's details on hover or
click, a filter on lane names, the finding as a red line, the partial writes, preemptions and the
witness read in their own colours; a holding trace gets a summary of what it exercised. For a
violation also a static picture of the involved blocks against time beside the minimal history.
Rendered from ``report.Report`` data only."""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path

import matplotlib
import matplotlib.ticker

from .report import Report
from .trace_events import BLOCKS, REQUESTS, Timeline

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
    "snapshot": ("h", "tab:olive", "a state cached (slot group)"),
    "track": ("d", "tab:olive", "a state tracked (slot group's track slot)"),
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


COLOURS = {
    "arrive": "#888", "schedule": "#4a90d9", "hit": "#17becf", "alloc": "#1f77b4",
    "publish": "#ff7f0e", "free": "#333", "evict": "#999", "unpublish": "#8c564b",
    "preempt": "#d62728", "abort": "#d62728", "finish": "#2ca02c", "write-full": "#2ca02c",
    "write-partial": "#bcbd22", "read": "#9467bd", "witness": "#e0007f", "submit": "#aaa",
    "execute": "#555", "dedup": "#e377c2", "snapshot": "#8c8c00", "load_failed": "#d62728",
}  # fmt: skip
"""The colour of each kind of mark (``trace_events.Mark.kind``)."""

SCRIPT = """
function kvFilter(box){var q=box.value.toLowerCase();
 document.querySelectorAll('g.lane').forEach(function(g){
  g.style.display=(!q||g.dataset.name.toLowerCase().indexOf(q)>=0)?'':'none';});}
function kvShow(el){document.getElementById('kv-detail').textContent=el.dataset.info;}
"""


def timeline_svg(line: Timeline) -> str:
    """The timeline as inline SVG: a row per lane, spans as bars, marks as ticks coloured by
    kind (``COLOURS``), each with its details (hover: a tooltip; click: the detail box)."""
    esc = html.escape
    lanes = sorted(line.lanes.values(), key=lambda lane: (lane.pid, lane.tid))
    step = max(4.0, min(18.0, 1400.0 / max(1, line.length)))
    left, row = 90, 20
    width = int(left + step * (line.length + 1) + 10)
    height = row * len(lanes) + 30
    out = [f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='{height}' "
           "font-family='sans-serif' font-size='11'>"]  # fmt: skip
    for n, lane in enumerate(lanes):
        y = 20 + n * row
        out.append(f"<g class='lane' data-name='{esc(lane.title)}'>")
        out.append(f"<text x='2' y='{y + 13}'>{esc(lane.title)}</text>")
        out.append(f"<line x1='{left}' x2='{width}' y1='{y + row - 1}' y2='{y + row - 1}' stroke='#eee'/>")  # fmt: skip
        for start, end, title in lane.spans:
            x = left + start * step
            w = max(2.0, (end - start) * step)
            out.append(f"<rect x='{x:.1f}' y='{y + 3}' width='{w:.1f}' height='{row - 6}' fill='#dde8f5' rx='3'><title>{esc(title)}</title></rect>")  # fmt: skip
        for mark in lane.marks:
            x = left + mark.at * step + step / 2
            colour = COLOURS.get(mark.kind, "#444")
            extra = ", ".join(f"{k} {v}" for k, v in mark.args.items())
            info = f"event {mark.at}: {lane.title}: {mark.name}" + (f" ({extra})" if extra else "")
            big = mark.kind in ("preempt", "witness", "write-partial", "publish")
            r = 5 if big else 3.5
            out.append(f"<circle class='mark {esc(mark.kind)}' cx='{x:.1f}' cy='{y + row / 2}' r='{r}' fill='{colour}' data-info='{esc(info)}' onclick='kvShow(this)'><title>{esc(info)}</title></circle>")  # fmt: skip
        out.append("</g>")
    if line.finding_at is not None:
        x = left + line.finding_at * step + step / 2
        out.append(f"<line class='violation' x1='{x:.1f}' x2='{x:.1f}' y1='12' y2='{height}' stroke='red' stroke-width='2'><title>{esc(str(line.finding_name))}: {esc(str(line.finding_message))}</title></line>")  # fmt: skip
        out.append(f"<text x='{x + 3:.1f}' y='11' fill='red'>{esc(str(line.finding_name))} (event {line.finding_at})</text>")  # fmt: skip
    out.append("</svg>")
    return "".join(out)


def legend() -> str:
    return " ".join(
        f"<span style='color:{c}'>&#9679;</span> {html.escape(k)}" for k, c in COLOURS.items()
    )


def summary(line: Timeline) -> str:
    """A holding trace's summary: what its events exercised."""
    counts: dict[str, int] = {}
    for lane in line.lanes.values():
        if lane.pid != BLOCKS:
            for mark in lane.marks:
                counts[mark.kind] = counts.get(mark.kind, 0) + 1
        else:
            for mark in lane.marks:
                if mark.kind.startswith("write") or mark.kind == "read":
                    counts[mark.kind] = counts.get(mark.kind, 0) + 1
    requests = sum(1 for lane in line.lanes.values() if lane.pid == REQUESTS)
    blocks = sum(1 for lane in line.lanes.values() if lane.pid == BLOCKS)
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>" for k, v in sorted(counts.items())
    )
    return (
        f"<p>{requests} requests over {blocks} blocks. What the trace exercised:</p>"
        f"<table class='summary'><tr><th>event</th><th>count</th></tr>{rows}</table>"
    )


def interactive(line: Timeline) -> str:
    return (
        "<h3>Timeline</h3><p><input placeholder='filter lanes (r3, block 4, step)' "
        "oninput='kvFilter(this)'> <span id='kv-detail' class='detail'>click a mark for its "
        f"details</span></p><p class='legend'>{legend()}</p>"
        f"<div class='timeline'>{timeline_svg(line)}</div>"
    )


def write_html(reports: list[Report], path: str | Path) -> None:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>kvspec check</title>",
        "<style>body{font-family:sans-serif;max-width:90em;margin:2em auto}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto}.bad{color:#b00}"
        ".timeline{overflow-x:auto;border:1px solid #ddd}.detail{font-family:monospace}"
        ".legend{font-size:80%}circle.mark{cursor:pointer}</style>",
        f"<script>{SCRIPT}</script>",
        "</head><body><h1>kvspec check</h1>",
    ]
    for report in reports:
        esc = html.escape
        parts.append(f"<h2>{esc(report.path)}: {esc(report.status)}</h2>")
        if report.exit_code == 2:
            parts.append(f"<p class='bad'>{esc(report.error or '')}</p>")
            continue
        parts.append(f"<p>{report.events} events checked in {report.seconds:.2f} s.</p>")
        lanes = getattr(report, "lanes", None)
        if report.exit_code == 0:
            if lanes is not None:
                parts.append(summary(lanes) + interactive(lanes))
            continue
        parts.append(
            f"<p class='bad'><b>{esc(report.invariant or '')}</b> at "
            f"<code>{esc(report.path)}:{report.line}</code>: {esc(report.message or '')}</p>"
            f"<p>Violating event: {esc(report.event or '')}</p>"
            f"<p><i>{esc(report.explanation or '')}</i></p>"
        )
        if lanes is not None:
            parts.append(interactive(lanes))
        png = base64.b64encode(picture(report)).decode("ascii")
        parts.append(
            f"<img alt='history of the blocks involved' src='data:image/png;base64,{png}'>"
        )
        parts.append("<h3>Minimal history</h3><pre>")
        parts += [f"{ln:>8}  {esc(text)}\n" for ln, text in report.history]
        parts.append("</pre>")
    parts.append("</body></html>")
    Path(path).write_text("".join(parts), encoding="utf-8")
