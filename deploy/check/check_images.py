"""The deploy check's images: a Debian base from packages (no registry), the Dockerfile's image built on it,
and the stand-ins image's requirements (the ``embedded`` extra)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path

from check_shell import REPO, Failed, podman, run, say

IMAGE = "localhost/runwatch:local"  # what `podman build -t runwatch:local .` names it
STANDINS = "localhost/runwatch-standins:local"
# The base: what the Dockerfile's python:3.11-slim gives it (Python 3.11, pip, a shell, useradd), from Debian.
SUITE = "bookworm"  # Python 3.11, as the Dockerfile's FROM
# python-is-python3: compose's worker healthcheck calls `python`
PACKAGES = ("python3", "python3-venv", "python3-pip", "python-is-python3", "ca-certificates")
MIRROR = os.environ.get("DEPLOY_CHECK_MIRROR", "http://deb.debian.org/debian")
IMPORT_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)
PRUNED = ("var/cache/apt/archives/*.deb", "var/lib/apt/lists/*")  # ~95 MB the image never needs


def dockerfile_base() -> str:
    """The Dockerfile's FROM as Podman names it locally (python:3.11-slim -> docker.io/library/python:...)."""
    froms = re.findall(r"^FROM\s+(\S+)", (REPO / "Dockerfile").read_text(), re.MULTILINE)
    if len(froms) != 1 or not re.fullmatch(r"(docker\.io/)?(library/)?python:3\.11[-.\w]*", froms[0]):
        raise Failed(f"the Dockerfile's FROM is {froms}: the base built here is Debian {SUITE}'s Python 3.11")
    name = froms[0].removeprefix("docker.io/").removeprefix("library/")
    return f"docker.io/library/{name}"


def base_image(work: Path) -> tuple[float, bool]:
    """The Debian base, built unless an image of this recipe exists; tagged as the Dockerfile's FROM."""
    recipe = json.dumps([SUITE, PACKAGES, MIRROR, IMPORT_CHANGES, PRUNED, "no EXTERNALLY-MANAGED"])
    tag = f"localhost/runwatch-base:{SUITE}-{hashlib.sha256(recipe.encode()).hexdigest()[:12]}"
    start = time.monotonic()
    cached = subprocess.run(["podman", "image", "exists", tag]).returncode == 0
    if not cached:
        say(f"base image: debootstrap {SUITE} ({', '.join(PACKAGES)}) from {MIRROR}")
        root = Path(tempfile.mkdtemp(prefix="runwatch-base-", dir="/var/tmp"))
        try:
            run(
                [
                    "debootstrap",
                    "--variant=minbase",
                    f"--include={','.join(PACKAGES)}",
                    SUITE,
                    str(root),
                    MIRROR,
                ],
                timeout=900,
                log=work / "debootstrap.log",
                what="debootstrap",
            )
            # Debian's pip refuses system-wide installs (PEP 668); the Dockerfile's `pip install` is one.
            (root / "usr/lib/python3.11/EXTERNALLY-MANAGED").unlink()
            for pattern in PRUNED:
                for path in root.glob(pattern):
                    if path.is_file():
                        path.unlink()
            changes = [arg for change in IMPORT_CHANGES for arg in ("--change", change)]
            tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
            importer = subprocess.Popen(
                ["podman", "import", *changes, "-", tag],
                stdin=tar.stdout,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            assert tar.stdout is not None
            tar.stdout.close()  # (importer's: tar gets SIGPIPE if it stops reading)
            _, err = importer.communicate(timeout=600)
            if tar.wait() or importer.returncode:
                raise Failed(f"podman import of the base failed: {err.strip()[-300:]}")
        finally:
            shutil.rmtree(root, ignore_errors=True)
    podman("tag", tag, dockerfile_base())
    seconds = time.monotonic() - start
    say(f"base image {tag}: {'cached' if cached else f'built in {seconds:.1f} s'}")
    return seconds, cached


def build(what: str, args: Sequence[str], tag: str, context: Path, work: Path) -> float:
    start = time.monotonic()
    podman(
        "build",
        "--pull=never",
        "--network=host",
        # TLS inside a container verifies only against the host's CA store here.
        "-v",
        "/etc/ssl/certs:/etc/ssl/certs:ro",
        *args,
        "-t",
        tag,
        str(context),
        timeout=1200,
        log=work / f"build-{tag.rsplit('/', 1)[-1].replace(':', '-')}.log",
        what=f"building {what}",
    )
    seconds = time.monotonic() - start
    say(f"{what}: {tag} built in {seconds:.1f} s ({image_mb(tag):.0f} MB)")
    return seconds


def image_id(tag: str) -> str | None:
    found = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", tag], capture_output=True, text=True
    )
    return found.stdout.strip() if found.returncode == 0 else None


def image_mb(tag: str) -> float:
    return int(podman("image", "inspect", "--format", "{{.Size}}", tag).strip()) / 1e6


def embedded_requirements() -> str:
    """The `embedded` extra's requirements, from pyproject.toml (its broker and ClickHouse engine)."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return " ".join(extras["embedded"])
