#!/usr/bin/env bash
# Makes (once) and prints the path of a cached venv holding SGLang 0.5.23's
# KV-transfer code with its import-time deps, pdrouter's python/ package, and
# Mooncake's real TransferEngine, NIXL (PyPI's, UCX 1.23 inside) and SGLang
# 0.5.20 in folders of their own (selected per process with PYTHONPATH). Keyed by a hash of the
# pinned requirements and python/, so a second run only re-installs python/
# when it changed.
#   prints: VENV=<dir> MOONCAKE=<dir> NIXL=<dir> SGLANG_OLD=<dir>
set -euo pipefail
cd "$(dirname "$0")/.."
req=python/harness/requirements-sglang.txt
mooncake_req="mooncake-transfer-engine-non-cuda==0.3.13.post1"
# The meta package picks nixl_cu13 for the venv's CUDA 13 torch.
nixl_req=(nixl==1.5.1 nixl-cu13==1.5.1)
# The last SGLang whose nixl backend completes by NIXL notifications, run on
# the venv's other packages; server_args imports xgrammar there (0.5.23 does
# so lazily), at the version 0.5.20 pins.
old_sglang=0.5.20
old_sglang_req=(sglang==$old_sglang xgrammar==0.2.1)
uv_version=0.13.9
py=${PYTHON:-python3}
key=$( (cat "$req"; echo "$mooncake_req" "$uv_version"; $py -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)
root=${PDROUTER_VENV_CACHE:-$HOME/.cache/pdrouter-venv}/$key
venv=$root/venv
if [ ! -e "$root/.complete" ]; then
	echo "sglang-venv: installing into $root (first run: about 2-3 minutes, ~6 GB with torch's CUDA wheels)" >&2
	rm -rf "$root"
	mkdir -p "$root"
	$py -m venv "$venv"
	# uv fetches the ~5 GB of wheels in parallel: 1m50s here against pip's 6m40s.
	"$venv/bin/pip" install -q uv==$uv_version >&2
	uv() { UV_CACHE_DIR=$root/uv-cache "$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps "$@" >&2; }
	uv -r "$req"
	uv --target "$root/mooncake" "$mooncake_req"
	rm -rf "$root/uv-cache"
	touch "$root/.complete"
fi
# NIXL and SGLang 0.5.20 came later than the venv: folders of their own, so
# that adding them left the venv's key (and the venv) as it was.
folder() { # folder NAME SIZE REQUIREMENT...
	local dir=$root/$1 size=$2
	shift 2
	[ -e "$dir/.complete" ] && return
	echo "sglang-venv: installing $* into $dir ($size)" >&2
	rm -rf "$dir"
	UV_CACHE_DIR=$root/uv-cache "$venv/bin/uv" pip install -q --python "$venv/bin/python" --no-deps --target "$dir" "$@" >&2
	rm -rf "$root/uv-cache"
	touch "$dir/.complete"
}
folder nixl "~60 MB" "${nixl_req[@]}"
folder "sglang-$old_sglang" "~210 MB" "${old_sglang_req[@]}"
# Bytecode, once: where PYTHONDONTWRITEBYTECODE is set (as on the machines
# this was measured on), every harness process otherwise compiles torch,
# transformers and SGLang again: 27-31 s of CPU to import SGLang's KV code,
# 13-14 s with bytecode. Files that do not compile (test data) only stay slow.
if [ ! -e "$root/.bytecode" ]; then
	echo "sglang-venv: compiling bytecode (once, ~1-2 minutes)" >&2
	"$venv/bin/python" -m compileall -qq -j 0 "$venv/lib" "$root/mooncake" "$root/nixl" "$root/sglang-$old_sglang" >&2 || true
	touch "$root/.bytecode"
fi
# python/ changes with the tree: install it when its hash moved.
pkg=$(find python/pdrouter_kv python/mooncake python/nixl python/pyproject.toml -type f -name '*.py' -o -name pyproject.toml | sort | xargs cat | sha256sum | cut -c1-16)
if [ "$(cat "$root/.pkg" 2>/dev/null)" != "$pkg" ]; then
	"$venv/bin/pip" install -q --no-deps --force-reinstall ./python >&2
	echo "$pkg" > "$root/.pkg"
fi
echo "VENV=$venv MOONCAKE=$root/mooncake NIXL=$root/nixl SGLANG_OLD=$root/sglang-$old_sglang"
