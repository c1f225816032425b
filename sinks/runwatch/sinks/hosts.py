"""Hosts that keep failing (issue 39): over a job's history in ClickHouse, the machines that recur in
findings about one rank, or in crashes, across runs (the "lemon" nodes of Meta's reports), and the
exclude list of a restart that leaves them out.

A finding names a host when it names a rank (``straggler``, ``hung_rank``, ``stall``, ``non_finite``,
``replica_divergence`` with a rank, ``crash``): the rank's host is the one its run said (rank 0's
``run_start``, every rank's first heartbeat), or the finding's own evidence ``host`` (a crash says where
it happened). A host is named when such findings point at it in at least ``min_runs`` distinct runs of the
job within the window, with three guards against blaming a machine for being there:

* a job that ran on one host only names nothing (every finding would point at it);
* a detector that named ranks on two or more hosts in one run found something about the run, not a host
  (a run-wide stall fires on every rank): that run's findings of that detector are not counted (crashes
  are: each says where it happened);
* findings about the run as a whole (no rank) are never counted, so the host of rank 0, which is in every
  run, is named only when findings about its own ranks recur.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runwatch.sinks.clickhouse import ClickHouseSink

HOST_DETECTORS = ("straggler", "hung_rank", "stall", "non_finite", "replica_divergence", "crash")
CRASH_DETECTOR = "crash"
DEFAULT_WINDOW_DAYS = 30.0
DEFAULT_MIN_RUNS = 3


@dataclass(frozen=True)
class LemonHost:
    """A host that findings or crashes keep pointing at: the runs (oldest first) and how many of each."""

    host: str
    run_ids: list[str] = field(default_factory=list)
    findings: int = 0
    crashes: int = 0


# One row per counted finding: (job, run, started, detector, host). The host map covers only the runs
# that have such findings; the job is rank 0's run_start's job_id ('' when it said none).
_FINDINGS_SQL = """
WITH
    raw AS (
        SELECT run_id, rank, detector, JSONExtractString(evidence, 'host') AS said
        FROM {db}.anomalies FINAL
        WHERE detector IN %(detectors)s
          AND ts >= now64(3) - toIntervalSecond(%(window_s)s)
          AND (rank IS NOT NULL OR said != '')
    ),
    starts AS (
        SELECT run_id, argMin(JSONExtractString(payload, 'job_id'), ts) AS job, min(ts) AS started
        FROM {db}.telemetry FINAL
        WHERE kind = 'run_start' AND rank = 0 AND run_id IN (SELECT run_id FROM raw)
        GROUP BY run_id
    ),
    rank_hosts AS (
        SELECT run_id, rank, argMin(JSONExtractString(payload, 'host'), ts) AS host
        FROM {db}.telemetry FINAL
        WHERE kind IN ('run_start', 'heartbeat') AND run_id IN (SELECT run_id FROM raw)
          AND JSONExtractString(payload, 'host') != ''
        GROUP BY run_id, rank
    )
SELECT s.job, r.run_id, s.started, r.detector, if(r.said != '', r.said, h.host) AS host
FROM raw AS r
INNER JOIN starts AS s ON r.run_id = s.run_id
LEFT JOIN rank_hosts AS h ON r.run_id = h.run_id AND ifNull(r.rank, 4294967295) = h.rank
WHERE (%(job)s = '' OR s.job = %(job)s) AND host != ''
"""

# Every host each job ran on in the window (rank 0's run_start and every rank's first heartbeat): a job of
# one host names nothing.
_JOB_HOSTS_SQL = """
WITH jobs AS (
    SELECT run_id, argMin(JSONExtractString(payload, 'job_id'), ts) AS job
    FROM {db}.telemetry FINAL
    WHERE kind = 'run_start' AND rank = 0 AND ts >= now64(3) - toIntervalSecond(%(window_s)s)
    GROUP BY run_id
)
SELECT j.job, uniqExact(JSONExtractString(t.payload, 'host')) AS hosts
FROM {db}.telemetry AS t FINAL
INNER JOIN jobs AS j ON t.run_id = j.run_id
WHERE t.kind IN ('run_start', 'heartbeat') AND JSONExtractString(t.payload, 'host') != ''
  AND (%(job)s = '' OR j.job = %(job)s)
GROUP BY j.job
"""


def lemon_hosts(
    client: ClickHouseSink,
    *,
    job: str | None,
    window_days: float = DEFAULT_WINDOW_DAYS,
    min_runs: int = DEFAULT_MIN_RUNS,
) -> list[LemonHost]:
    """The hosts that findings naming one of their ranks, or crashes, point at in at least ``min_runs``
    distinct runs of ``job`` (None: of any job) that started within ``window_days`` (see the module doc);
    the most runs first."""
    if min_runs < 1:
        raise ValueError("min_runs must be at least 1")
    params: dict[str, Any] = {
        "detectors": HOST_DETECTORS,
        "window_s": int(window_days * 86400),
        "job": job or "",
    }
    rows = client.query(_FINDINGS_SQL, params)
    job_hosts = {str(j): int(n) for j, n in client.query(_JOB_HOSTS_SQL, params)}
    return count_lemons(rows, job_hosts, min_runs)


def count_lemons(rows: Iterable[Sequence[Any]], job_hosts: dict[str, int], min_runs: int) -> list[LemonHost]:
    """The lemon hosts of ``rows`` (job, run, started, detector, host), each a finding that names a host;
    ``job_hosts``: how many hosts each job ran on. Pure (the rules of the module doc)."""
    rows = [(str(j), str(r), s, str(d), str(h)) for j, r, s, d, h in rows]
    spread: dict[tuple[str, str], set[str]] = {}  # (run, detector) -> the hosts it named
    for _, run, _, detector, host in rows:
        spread.setdefault((run, detector), set()).add(host)
    runs: dict[str, dict[str, Any]] = {}  # host -> {run: started}
    findings: dict[str, int] = {}
    crashes: dict[str, int] = {}
    for job, run, started, detector, host in rows:
        if job_hosts.get(job, 0) < 2:
            continue  # one host ran the whole job: nothing tells it from the others
        if detector != CRASH_DETECTOR and len(spread[(run, detector)]) > 1:
            continue  # the run's problem, found on ranks of several hosts
        runs.setdefault(host, {})[run] = started
        if detector == CRASH_DETECTOR:
            crashes[host] = crashes.get(host, 0) + 1
        else:
            findings[host] = findings.get(host, 0) + 1
    named = [
        LemonHost(
            host=host,
            run_ids=[r for r, _ in sorted(by_run.items(), key=lambda kv: (kv[1], kv[0]))],
            findings=findings.get(host, 0),
            crashes=crashes.get(host, 0),
        )
        for host, by_run in runs.items()
        if len(by_run) >= min_runs
    ]
    named.sort(key=lambda h: (-len(h.run_ids), h.host))
    return named


def exclude_list(
    client: ClickHouseSink,
    job: str | None,
    crash_hosts: Iterable[str],
    *,
    window_days: float = DEFAULT_WINDOW_DAYS,
    min_runs: int = DEFAULT_MIN_RUNS,
) -> list[str]:
    """The hosts a restart of ``job`` leaves out: ``crash_hosts`` (the crash's own, as the restart action
    says them) and then the job's lemon hosts, each once, in that order. Where the history cannot be read,
    the crash's hosts alone (a restart must not wait on ClickHouse)."""
    hosts = list(dict.fromkeys(h for h in crash_hosts if h))
    try:
        lemons = lemon_hosts(client, job=job, window_days=window_days, min_runs=min_runs)
    except Exception:  # noqa: BLE001 - the history is a help, not a precondition
        return hosts
    return list(dict.fromkeys([*hosts, *(h.host for h in lemons)]))
