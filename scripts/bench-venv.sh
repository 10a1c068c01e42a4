#!/usr/bin/env bash
# Makes (once) and prints the path of a cached venv holding the routers pdrouter is measured
# against in `make bench`: sglang-router 0.3.2 (python -m sglang_router.launch_router) and its
# successor, the gateway smg 1.13.0 (smg launch). Keyed by the pins and the Python version, so a
# second run installs nothing.
#   prints: <venv dir>
set -euo pipefail
pins=(sglang-router==0.3.2 smg==1.13.0)
py=${PYTHON:-python3}
key=$( (printf '%s\n' "${pins[@]}"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
venv=${PDROUTER_BENCH_VENV_CACHE:-$HOME/.cache/pdrouter-bench-venv}/$key
if [ ! -e "$venv/.complete" ]; then
	echo "bench-venv: installing ${pins[*]} into $venv (first run: about a minute)" >&2
	rm -rf "$venv"
	mkdir -p "$(dirname "$venv")"
	$py -m venv "$venv"
	"$venv/bin/pip" install -q --disable-pip-version-check "${pins[@]}" >&2
	touch "$venv/.complete"
fi
echo "$venv"
