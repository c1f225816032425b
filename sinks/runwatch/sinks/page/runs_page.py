"""The runs list: one self-contained page (no network but its own server), refreshed from ``/api/runs``
every 2 s. Action colours come from the action kinds' table, severities from the report's."""

from __future__ import annotations

import json

from runwatch.contract.action_kinds import ACTION_KINDS

REFRESH_MS = 2000
SEVERITY_COLORS = {"critical": "#d62728", "warning": "#ff7f0e", "info": "#7f7f7f"}
ACTION_COLORS = {name: spec.color for name, spec in ACTION_KINDS.items()}
ACTION_ORDER = sorted(ACTION_KINDS, key=lambda name: -ACTION_KINDS[name].order)

_SCRIPT = """
const SEV = __SEVERITY__, ACT = __ACTIONS__, ACT_ORDER = __ACTION_ORDER__;
function cell(tr, text, cls) {
  const td = document.createElement("td"); td.textContent = text; if (cls) td.className = cls;
  tr.appendChild(td); return td;
}
function badges(td, counts, colors, order) {
  for (const key of order.concat(Object.keys(counts).filter(k => !order.includes(k)))) {
    if (!counts[key]) continue;
    const b = document.createElement("span"); b.className = "badge"; b.dataset.key = key;
    b.style.background = colors[key] || "#555"; b.textContent = key + " " + counts[key];
    td.appendChild(b);
  }
}
function ago(iso, now) {
  const s = Math.max(0, (Date.parse(now) - Date.parse(iso)) / 1000);
  return s < 90 ? Math.round(s) + " s ago" : s < 5400 ? Math.round(s / 60) + " min ago"
       : Math.round(s / 3600) + " h ago";
}
async function refresh() {
  const state = document.getElementById("state");
  try {
    const resp = await fetch("/api/runs", {cache: "no-store"});
    if (!resp.ok) throw new Error((await resp.json()).error || resp.status);
    const data = await resp.json();
    const body = document.getElementById("runs"); body.replaceChildren();
    for (const r of data.runs) {
      const tr = document.createElement("tr"); tr.dataset.run = r.run_id;
      const a = document.createElement("a"); a.href = "/runs/" + encodeURIComponent(r.run_id);
      a.textContent = r.run_id; const td = cell(tr, ""); td.appendChild(a);
      cell(tr, r.status, "status " + r.status);
      cell(tr, r.attempt ? r.attempt.slice(0, 12) : "");
      cell(tr, r.last_step === null ? "" : String(r.last_step), "num");
      cell(tr, ago(r.last_event, data.now));
      badges(cell(tr, "", "findings"), r.findings, SEV, Object.keys(SEV));
      badges(cell(tr, "", "actions"), r.actions, ACT, ACT_ORDER);
      cell(tr, String(r.actions.rollback || 0), "num rollbacks");
      cell(tr, r.baseline_outliers ? "outlier" : "", r.baseline_outliers ? "outlier" : "");
      body.appendChild(tr);
    }
    document.getElementById("empty").hidden = data.runs.length > 0;
    state.textContent = "updated " + new Date().toLocaleTimeString(); state.className = "";
  } catch (err) {
    state.textContent = "the stack does not answer (" + err + "); retrying"; state.className = "down";
  }
}
refresh(); setInterval(refresh, __REFRESH__);
"""

RUNS_PAGE = (
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>runwatch: runs</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px system-ui, sans-serif; margin: 1.5em; color: #222; }
h1 { font-size: 1.3em; margin: 0 0 .2em; }
#state { color: #666; margin-bottom: 1em; } #state.down { color: #d62728; font-weight: bold; }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: .35em .6em; border-bottom: 1px solid #ddd; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.badge { display: inline-block; color: #fff; border-radius: 3px; padding: 0 .4em; margin: 0 .2em .1em 0; }
.status.running { color: #2ca02c; font-weight: bold; } .status.failed, .status.died { color: #d62728; }
.status.silent { color: #ff7f0e; } .outlier { color: #d62728; font-weight: bold; }
</style></head><body>
<h1>runwatch: runs</h1>
<div id="state">loading</div>
<table><thead><tr><th>run</th><th>status</th><th>attempt</th><th>last step</th><th>last event</th>
<th>findings</th><th>actions</th><th>rollbacks</th><th>baseline</th></tr></thead>
<tbody id="runs"></tbody></table>
<p id="empty" hidden>No runs stored yet: start a training loop with <code>RunWatch</code> against this
stack's broker.</p>
<script>"""
    + _SCRIPT.replace("__SEVERITY__", json.dumps(SEVERITY_COLORS))
    .replace("__ACTIONS__", json.dumps(ACTION_COLORS))
    .replace("__ACTION_ORDER__", json.dumps(ACTION_ORDER))
    .replace("__REFRESH__", str(REFRESH_MS))
    + """</script>
</body></html>
"""
)
