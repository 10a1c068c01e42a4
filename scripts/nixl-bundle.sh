#!/usr/bin/env bash
# make nixl-bundle: PyPI's NIXL 1.5.1 for CUDA 13 (cp312, UCX 1.23 inside)
# trimmed to what a UCX agent on GPU memory loads, in bin/nixl, so that it
# rides beside bin/cuda's kvproxy in one device call (the wheel is 56 MiB,
# the carry limit 64). Kept: the nixl_cu13 package, libnixl and its
# dependencies, the UCX plugin, UCX's cuda and cma modules, debug
# information stripped; the other plugins (GDS, object stores, GPUNETIO) and
# nixl_ep go. Import it as nixl_cu13 (the meta package `nixl` would clash
# with python/nixl, the look-alike) with NIXL_PLUGIN_DIR set to
# bin/nixl/.nixl_cu13.mesonpy.libs/plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
ver=1.5.1
# The device runs Python 3.12; NIXL_PY=3.11 makes a bundle to try here.
py=${NIXL_PY:-3.12}
tag=cp${py/./}
cache=${PDROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdrouter}/nixl-cu13-$ver
out=bin/nixl
mkdir -p "$cache"
whl=$(ls "$cache"/nixl_cu13-$ver-$tag-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
		--platform manylinux_2_28_x86_64 -d "$cache" "nixl-cu13==$ver"
	whl=$(ls "$cache"/nixl_cu13-$ver-$tag-*.whl | head -1)
fi
w=$cache/w-$tag
if [ ! -f "$w/nixl_cu13/_api.py" ]; then
	rm -rf "$w"
	python3 -m zipfile -e "$whl" "$w"
fi
rm -rf "$out" && mkdir -p "$out"
# The shared objects the agent loads: the closure of NEEDED entries from the
# bindings, the UCX plugin and UCX's cuda and cma modules, within the wheel
# (the host gives libc, libstdc++, libssl, libz, libcuda, libnvidia-ml).
python3 - "$w" "$out" <<'PY'
import os, subprocess, sys
w, out = sys.argv[1], sys.argv[2]
dirs = [".nixl_cu13.mesonpy.libs", "nixl_cu13.libs", ".nixl_cu13.mesonpy.libs/plugins", "nixl_cu13.libs/ucx"]
index = {}
for d in dirs:
    for f in os.listdir(os.path.join(w, d)):
        if ".so" in f and os.path.isfile(os.path.join(w, d, f)):
            index.setdefault(f, os.path.join(d, f))
roots = [os.path.join("nixl_cu13", f) for f in os.listdir(os.path.join(w, "nixl_cu13")) if f.endswith(".so")]
roots += [".nixl_cu13.mesonpy.libs/plugins/libplugin_UCX.so"]
roots += ["nixl_cu13.libs/ucx/%s.so.0.0.0" % m for m in ("libuct_cuda", "libucm_cuda", "libuct_cma")]
seen, todo = set(), list(roots)
while todo:
    p = todo.pop()
    if p in seen:
        continue
    seen.add(p)
    dyn = subprocess.run(["readelf", "-d", os.path.join(w, p)], capture_output=True, text=True, check=True).stdout
    todo += [index[n] for n in (l.split("[", 1)[1].split("]", 1)[0] for l in dyn.splitlines() if "(NEEDED)" in l) if n in index]
for p in sorted(seen):
    os.makedirs(os.path.join(out, os.path.dirname(p)), exist_ok=True)
    subprocess.run(["strip", "--strip-debug", "-o", os.path.join(out, p), os.path.join(w, p)], check=True)
print("nixl-bundle: %d shared objects" % len(seen))
PY
# UCX looks for its modules by their unversioned names.
for m in "$out"/nixl_cu13.libs/ucx/*.so.0.0.0; do ln -sf "$(basename "$m")" "${m%.0.0}"; ln -sf "$(basename "$m")" "${m%.0.0.0}"; done
cp "$w"/nixl_cu13/*.py "$out/nixl_cu13/"
du -sh "$out"
size=$(du -sm "$out" | cut -f1)
[ "$size" -lt 40 ] || { echo "nixl bundle is $size MiB: over its 40 MiB share of the carry" >&2; exit 1; }
