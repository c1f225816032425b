"""The commits between two runs, from a local git repository (``git log``), for the baseline gate
and the change-point scan. I/O at the edge: the detectors get the answer as data."""

from __future__ import annotations

import subprocess
from datetime import datetime
from pathlib import Path

from runwatch.detectors.baselines.check import Commit, CommitRange

GIT_TIMEOUT_S = 30


class GitError(Exception):
    """The repository cannot be read (not a git repository, git missing)."""


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise GitError("git is not installed (or not on PATH)") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"git {' '.join(args)} in {repo} took more than {GIT_TIMEOUT_S} s") from None


def check_repo(repo: str | Path) -> Path:
    """``repo`` as a path, if it is a git repository; else ``GitError`` saying why."""
    path = Path(repo)
    if not path.is_dir():
        raise GitError(f"{path} is not a directory")
    done = _git(path, "rev-parse", "--git-dir")
    if done.returncode != 0:
        raise GitError(f"{path} is not a git repository: {done.stderr.strip() or 'git rev-parse failed'}")
    return path


def has_commit(repo: Path, sha: str) -> bool:
    return _git(repo, "cat-file", "-e", f"{sha}^{{commit}}").returncode == 0


def commit_range(repo: str | Path, from_sha: str | None, to_sha: str | None) -> CommitRange:
    """``git log A..B`` (newest first) between the last normal run's commit and this run's; a
    missing or unknown sha gives an empty list with a note saying so. Raises ``GitError`` when
    ``repo`` is no git repository."""
    path = check_repo(repo)
    result = CommitRange(from_sha=from_sha, to_sha=to_sha)
    if to_sha is None:
        result.note = "this run has no git sha"
        return result
    if from_sha is None:
        result.note = "no last normal run in the history: no range to show"
        return result
    unknown = [sha for sha in (from_sha, to_sha) if not has_commit(path, sha)]
    if unknown:
        result.note = (
            f"{', '.join(unknown)} unknown to the repository at {path} (not fetched, or another repository?)"
        )
        return result
    done = _git(path, "log", "--no-decorate", "--format=%H %s", f"{from_sha}..{to_sha}")
    if done.returncode != 0:
        result.note = f"git log failed: {done.stderr.strip()}"
        return result
    for line in done.stdout.splitlines():
        sha, _, subject = line.partition(" ")
        result.commits.append(Commit(sha=sha, subject=subject))
    if not result.commits:
        result.note = "no commits in between (the same commit, or this run's commit is older)"
    return result


def commit_info(repo: Path, sha: str) -> tuple[datetime, str] | None:
    """(committer time, subject) of ``sha``, or None when the repository does not have it."""
    done = _git(repo, "show", "-s", "--format=%cI %s", sha)
    if done.returncode != 0 or not done.stdout.strip():
        return None
    stamp, _, subject = done.stdout.strip().partition(" ")
    try:
        return datetime.fromisoformat(stamp), subject
    except ValueError:
        return None
