"""The report as one self-contained HTML file: the panels drawn by plotly.js, inlined once, and the
findings, actions and baseline verdicts as tables. Nothing is fetched when it is opened.

plotly.js (4.8 MB minified) is inlined gzip-compressed and base64-encoded (about 2 MB), and unpacked
in the browser with the standard ``DecompressionStream`` (Chromium 80+, Firefox 113+, Safari 16.4+):
that leaves room under the 5 MB budget for the data of a long run.
"""

from __future__ import annotations

import base64
import gzip
import html
import math
from datetime import datetime
from functools import lru_cache
from typing import Any

import orjson

from runwatch.sinks.report.data import ReportData
from runwatch.sinks.report.figures import Panel, finite


@lru_cache(maxsize=1)
def plotly_js_gzip_b64() -> str:
    """plotly.js as shipped with the plotly package, gzip-compressed (reproducibly: no timestamp), base64."""
    from plotly.offline import get_plotlyjs

    return base64.b64encode(gzip.compress(get_plotlyjs().encode(), 9, mtime=0)).decode("ascii")


def plotly_version() -> str:
    import plotly

    return str(plotly.__version__)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _num(value: Any) -> str:
    if value is None:
        return ""
    f = finite(value)
    if f is None:
        return "non-finite" if isinstance(value, float) else _e(value)
    return f"{f:.4g}"


def _time(ts: datetime | None) -> str:
    return ts.strftime("%Y-%m-%d %H:%M:%S UTC") if ts is not None else ""


def _table(headers: list[str], rows: list[list[str]], css: str = "") -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f'<table class="{css}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _facts(data: ReportData) -> str:
    start, info = data.run_start, data.info
    status = (data.run_end or {}).get("status", "running (no run_end stored)")
    facts = [
        ("status", status),
        ("baseline key", start.get("baseline_key") or "none"),
        (
            "git sha",
            ((start.get("git_sha") or "")[:12] + (" (dirty)" if start.get("git_dirty") else "")) or "unknown",
        ),
        ("host", start.get("host")),
        ("world size", start.get("world_size", 1)),
        ("ranks reporting", info["ranks"]),
        ("last step", info["last_step"]),
        ("events stored", info["events"]),
        ("first event", _time(info["first_ts"])),
        ("last event", _time(info["last_ts"])),
        ("torch", start.get("torch_version")),
        ("GPUs", ", ".join(start.get("gpu_names") or []) or "none"),
        ("tags", ", ".join(f"{k}={v}" for k, v in (start.get("tags") or {}).items())),
    ]
    return (
        '<dl class="facts">'
        + "".join(f"<div><dt>{_e(k)}</dt><dd>{_e(v)}</dd></div>" for k, v in facts if v not in (None, ""))
        + "</dl>"
    )


def findings_table(data: ReportData) -> str:
    if not data.anomalies:
        return '<p class="note">No findings: the detectors raised nothing for this run.</p>'
    rows = [
        [
            _e(a["step"]),
            _e(a.get("onset_step")),
            _e(a["rank"]),
            f'<span class="sev-{_e(a["severity"])}">{_e(a["severity"])}</span>',
            _e(a["detector"]),
            _e(a["metric"]),
            _num(a["value"]),
            _num(a["threshold"]),
            _e(a["message"]),
        ]
        for a in data.anomalies
    ]
    return _table(
        ["step", "since step", "rank", "severity", "detector", "metric", "value", "threshold", "message"],
        rows,
        "findings",
    )


def goodput_section(data: ReportData) -> str:
    """Where the run's wall time went (docs/goodput.md): a stacked bar and a table of each category's
    seconds and share; then the job's hosts that keep failing."""
    from runwatch.sinks.goodput import CATEGORIES

    g = data.goodput
    if g is None or g.wall_s <= 0:
        body = '<p class="note">No goodput: no steps or no time stored for this run.</p>'
    else:
        seconds = g.seconds()
        colours = dict(zip(CATEGORIES, GOODPUT_COLOURS, strict=True))
        bar = "".join(
            f'<span class="gp-{_e(name)}" title="{_e(name)} {v:.1f}s" style="display:inline-block;'
            f'height:14px;width:{100 * v / g.wall_s:.3f}%;background:{colours[name]}"></span>'
            for name, v in seconds.items()
            if v > 0
        )
        rows = [
            [_e(name.replace("_", " ")), f"{v:.2f}", f"{100 * v / g.wall_s:.1f}%"]
            for name, v in seconds.items()
        ]
        rows.append(["wall time", f"{g.wall_s:.2f}", "100%"])
        body = (
            f"<p>goodput <b>{100 * (g.goodput or 0):.1f}%</b>: productive step time over wall time "
            f"({g.attempts} attempt(s), {g.steps} steps of rank 0, {g.steps_lost} undone by a rollback)</p>"
            f'<div class="goodput-bar" style="width:100%;background:#eee">{bar}</div>'
            + _table(["time", "seconds", "share"], rows, "goodput")
        )
    if data.job:
        if data.lemon_hosts:
            hosts = _table(
                ["host", "runs", "findings", "crashes", "run ids"],
                [
                    [_e(h.host), _e(len(h.run_ids)), _e(h.findings), _e(h.crashes), _e(", ".join(h.run_ids))]
                    for h in data.lemon_hosts
                ],
                "lemon-hosts",
            )
        else:
            hosts = f'<p class="note">No host of job {_e(data.job)} keeps failing.</p>'
        body += f"<h3>Hosts that keep failing (job {_e(data.job)})</h3>{hosts}"
    body += "".join(f'<p class="note">{_e(n)}</p>' for n in data.notes)
    return "<h2>Goodput</h2>" + body


# productive, then the lost categories (goodput.CATEGORIES' order)
GOODPUT_COLOURS = (
    "#2ca02c",
    "#d62728",
    "#ff7f0e",
    "#1f77b4",
    "#9467bd",
    "#8c564b",
    "#7f7f7f",
    "#17becf",
    "#bcbd22",
)


def stacks_section(data: ReportData) -> str:
    """The Python stacks that hung-rank and stall findings carry (evidence ``stacks``): per finding, each
    rank's frame and its innermost frames, as escaped text in ``<pre>`` (never markup, never run); "" when no
    finding has any."""
    blocks = []
    for a in data.anomalies:
        evidence = a.get("evidence")
        stacks = evidence.get("stacks") if isinstance(evidence, dict) else None
        if not isinstance(stacks, dict) or not stacks:
            continue
        ranks = []
        for rank, stack in stacks.items():
            if not isinstance(stack, dict):
                continue
            frames = stack.get("frames")
            lines = [str(f) for f in frames] if isinstance(frames, list) else []
            if stack.get("frames_dropped"):
                lines.insert(0, f"... {stack['frames_dropped']} outer frames not kept")
            if stack.get("code"):
                lines.append(f"    {stack['code']}")
            recorder = stack.get("flight_recorder") or stack.get("flight_recorder_status")
            if recorder:
                lines.append(f"flight recorder: {recorder}")
            ranks.append(
                f"<details{' open' if str(rank) == str(a.get('rank')) else ''}><summary>rank {_e(rank)}"
                f" ({_e(stack.get('thread'))}): waits in {_e(stack.get('waits_in'))}</summary>"
                f'<pre class="stack">{_e(chr(10).join(lines))}</pre></details>'
            )
        if ranks:
            blocks.append(
                f'<div class="stacks"><h3>{_e(a["detector"])} · rank {_e(a["rank"])} · step '
                f"{_e(a['step'])}</h3>{''.join(ranks)}</div>"
            )
    return "<h2>Stacks</h2>" + "".join(blocks) if blocks else ""


def actions_table(data: ReportData) -> str:
    if not data.actions:
        return '<p class="note">No actions were taken.</p>'
    rows = []
    for a in data.actions:
        target = a["to_step"] if a["to_step"] is not None else a["target_step"]
        rows.append(
            [
                _e(a["step"]),
                f'<span class="act-{_e(a["kind"])}">{_e(a["kind"])}</span>',
                _e(a["outcome"] or "no answer"),
                _e(a["ack_step"]),
                _e(target),
                _e(a["reason"]),
            ]
        )
    return _table(
        ["issued at step", "action", "trainer", "taken at step", "rollback to step", "reason"],
        rows,
        "actions",
    )


def verdicts_table(data: ReportData) -> str:
    report = data.baseline
    note = f'<p class="note baseline-note">{_e(data.baseline_note)}</p>' if data.baseline_note else ""
    if report is None:
        return note
    head = (
        f"<p>Judged as <code>runwatch baseline check</code> judges it: {report.history_size} run(s) of "
        f"<code>{_e(report.baseline_key)}</code> on <code>{_e(report.fingerprint)}</code> in the "
        f"{report.window_days:g} days before it (a verdict needs {report.min_runs}). "
        f"Outliers: {_e(', '.join(report.outliers) or 'none')}.</p>"
    )
    rows = []
    for c in report.comparisons:
        band = f"{_num(c.low)} – {_num(c.high)}" if c.low is not None and c.high is not None else ""
        change = f"{c.change:+.1%}" if c.change is not None and math.isfinite(c.change) else ""
        rows.append(
            [
                _e(c.metric),
                _num(c.value),
                _num(c.median),
                band,
                change,
                _e(c.n),
                f'<span class="verdict-{_e(c.verdict)}">{_e(c.verdict)}</span>',
                _e(c.reason),
            ]
        )
    return (
        note
        + head
        + _table(
            ["metric", "this run", "baseline median", "band", "change", "n", "verdict", "reason"],
            rows,
            "verdicts",
        )
    )


def _panel_divs(panels: list[Panel]) -> str:
    return "".join(
        f'<div class="panel" id="panel-{_e(p.id)}" data-panel="{_e(p.id)}" data-section="{_e(p.section)}">'
        "</div>"
        for p in panels
    )


def _script_json(value: Any) -> str:
    # inside <script>: "</" must not appear (it would end the element)
    return orjson.dumps(value).decode().replace("</", "<\\/")


STYLE = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0 auto;\
max-width:1500px;padding:16px 24px;
color:#222;background:#fafafa}
h1{font-size:22px;margin:0 0 4px}\
h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd;padding-bottom:4px}
.sub{color:#666;font-size:13px}.note{color:#555;font-style:italic}
.facts{display:grid;grid-template-columns:repeat(auto-fill,minmax(200px,1fr));\
gap:4px 16px;font-size:13px;margin:12px 0}
.facts dt{font-weight:600;color:#555}.facts dd{margin:0}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(620px,1fr));gap:12px}
.panel{background:#fff;border:1px solid #e3e3e3;border-radius:4px;min-height:300px}
table{border-collapse:collapse;font-size:13px;background:#fff;width:100%}
th,td{border:1px solid #e3e3e3;padding:4px 8px;text-align:left;vertical-align:top}th{background:#f0f0f0}
.sev-critical,.verdict-OUTLIER,.verdict-INVALID,.act-rollback,.act-stop{color:#c00;font-weight:600}
.sev-warning,.act-alert{color:#c60}
#status{color:#c00;font-weight:600}
.stacks h3{font-size:14px;margin:12px 0 4px}
pre.stack{font-size:12px;background:#fff;border:1px solid #e3e3e3;padding:6px;overflow-x:auto;\
margin:2px 0 8px}
"""

LOADER = """
(async () => {
  const status = document.getElementById('status');
  try {
    if (typeof DecompressionStream === 'undefined') \
throw new Error('this browser has no DecompressionStream');
    const packed = atob(document.getElementById('plotly-js-gzip').textContent.trim());
    const bytes = new Uint8Array(packed.length);
    for (let i = 0; i < packed.length; i++) bytes[i] = packed.charCodeAt(i);
    const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
    const code = document.createElement('script');
    code.textContent = await new Response(stream).text();
    document.head.appendChild(code);
    const panels = JSON.parse(document.getElementById('runwatch-panels').textContent);
    for (const p of panels) {
      await Plotly.newPlot('panel-' + p.id, p.figure.data, p.figure.layout,
                           {responsive: true, displaylogo: false});
    }
    document.body.dataset.drawn = String(panels.length);
  } catch (err) {
    status.textContent = 'The report could not be drawn: ' + err;
    document.body.dataset.error = String(err);
    console.error(err);
  }
})();
"""


def render(data: ReportData, panels: list[Panel]) -> str:
    """The whole HTML document."""
    run_panels = [p for p in panels if p.section == "run"]
    band_panels = [p for p in panels if p.section == "baselines"]
    generated = f" · generated {_time(data.generated_at)}" if data.generated_at else ""
    # (the reason, when there is one, is the verdicts' note just above: said once)
    band_note = (
        ""
        if band_panels
        else '<p class="note">No baseline band'
        + ("." if data.baseline_note else ": no earlier runs to draw one from.")
        + "</p>"
    )
    multi = (
        (
            f'<p class="note">A run of {data.info["ranks"]} ranks: '
            "the curves are rank 0's; step time per rank is "
            "drawn below.</p>"
        )
        if data.info["ranks"] > 1
        else ""
    )
    payload = [{"id": p.id, "title": p.title, "figure": p.figure} for p in panels]
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">\
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>runwatch report: {_e(data.run_id)}</title><style>{STYLE}</style></head>
<body data-run-id="{_e(data.run_id)}" data-panels="{len(panels)}">
<h1>runwatch report: {_e(data.run_id)}</h1>
<div class="sub">drawn with plotly.js {_e(plotly_version())}, inlined{generated}</div>
<div id="status"></div>
{_facts(data)}
<h2>Findings</h2>{findings_table(data)}
{stacks_section(data)}
<h2>Actions</h2>{actions_table(data)}
{goodput_section(data)}
<h2>Run</h2>{multi}<div class="grid">{_panel_divs(run_panels)}</div>
<h2>Baselines</h2>{verdicts_table(data)}{band_note}<div class="grid">{_panel_divs(band_panels)}</div>
<script id="plotly-js-gzip" type="application/octet-stream">{plotly_js_gzip_b64()}</script>
<script id="runwatch-panels" type="application/json">{_script_json(payload)}</script>
<script>{LOADER}</script>
</body></html>
"""
