#!/usr/bin/env bash
# Installs the Debian packages a target needs, only when they are missing.
#   test : libucx-dev, ucx-utils (the ucx package and ucx_perftest)
#   bench: the above plus nginx and wrk
#   sglang: the SGLang harness's cached Python venv (prints VENV=... MOONCAKE=... NIXL=...)
set -euo pipefail
if [ "${1:-test}" = sglang ]; then
	# python/sglang: SGLang 0.5.23 and Mooncake's TransferEngine in a cached
	# venv (scripts/sglang-venv.sh; prints VENV=... MOONCAKE=... NIXL=...).
	if ! python3 -c 'import ensurepip, venv' 2>/dev/null; then
		[ "$(id -u)" -eq 0 ] || { echo "python3 lacks venv: apt-get install python3-venv" >&2; exit 1; }
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
	fi
	exec "$(dirname "$0")/sglang-venv.sh"
fi
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
