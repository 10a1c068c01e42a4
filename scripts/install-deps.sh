#!/usr/bin/env bash
# Installs the Debian packages a target needs, only when they are missing.
#   test : libucx-dev, ucx-utils (the ucx package and ucx_perftest)
#   bench: the above plus nginx and wrk
set -euo pipefail
want=(libucx-dev ucx-utils pkg-config)
[ "${1:-test}" = bench ] && want+=(nginx wrk)
missing=()
for p in "${want[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" -ne 0 ]; then
	echo "missing packages: ${missing[*]}; install them as root: apt-get install ${missing[*]}" >&2
	exit 1
fi
echo "installing ${missing[*]}" >&2
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
