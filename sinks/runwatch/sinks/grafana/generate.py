"""Write the dashboards' JSON files (``runwatch grafana generate``) and compare them with what is on disk."""

from __future__ import annotations

from pathlib import Path

from runwatch.sinks.grafana.dashboards import DATABASE, all_dashboards

DASHBOARD_DIR = Path("deploy") / "grafana" / "dashboards"


def write_dashboards(out: Path, db: str = DATABASE) -> list[Path]:
    """Write every dashboard to ``out`` (created if missing); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in all_dashboards(db).items():
        path = out / name
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written


def stale_files(folder: Path, db: str = DATABASE) -> list[str]:
    """The dashboard files in ``folder`` that differ from a fresh generation (missing ones too),
    and any generated-looking file there that no dashboard produces."""
    fresh = all_dashboards(db)
    stale = [
        name
        for name, text in fresh.items()
        if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text
    ]
    stale += sorted(p.name for p in folder.glob("runwatch-*.json") if p.name not in fresh)
    return stale
