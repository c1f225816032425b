#!/usr/bin/env bash
# Installs what `make deploy-check` needs from Debian's packages, when missing: Podman, runc (crun rejects
# the hybrid cgroup layout of these machines) and debootstrap (no image registry is reachable, so the base
# image is built from packages). Runs as root; deploy_check.py writes the Podman settings it runs with.
set -euo pipefail
if [[ $(id -u) != 0 ]]; then
  echo "deploy-check: run as root (Podman runs the containers as root here)" >&2
  exit 1
fi
missing=()
command -v podman >/dev/null || missing+=(podman)
[[ -x /usr/sbin/runc ]] || command -v runc >/dev/null || missing+=(runc)
command -v debootstrap >/dev/null || [[ -x /usr/sbin/debootstrap ]] || missing+=(debootstrap)
if ((${#missing[@]})); then
  echo "deploy-check: apt-get install ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
echo "deploy-check: $(podman --version), $(runc --version | head -1), debootstrap $(dpkg-query -W -f '${Version}' debootstrap)"
