#!/usr/bin/env bash
# make devbench-bundle: what scripts/devbench-run.sh needs on the GPU machine (16 cores, Python
# 3.12, no Go, no network, no nginx or pip index), in bin/devbench (ignored; carried by the
# device tool, whose limit is 64 MiB with the working tree):
#   tools.tar.xz  static Go builds (CGO_ENABLED=0) of pdrouter, mockworker, stubengine, pdbench
#                 and kvproxy (tcp and shm transports: its ucx and CUDA paths need cgo), and
#                 Debian's nginx with the libraries it links (libc aside) behind a wrapper that
#                 sets LD_LIBRARY_PATH for nginx alone. xz: the Go binaries are ~60 MiB raw.
#   wheels/       vllm-router 0.1.17 and everything it imports at run time, resolved by pip for
#                 CPython $DEVBENCH_PY (3.12) on manylinux x86_64: the whole closure, so that the
#                 install there depends on no package the machine happens to have.
#   MANIFEST      the commit, the wheels, the sizes.
# Knobs: DEVBENCH_DIR (bin/devbench), DEVBENCH_PY (3.12; 3.11 for a rehearsal on this box's
# Python), BASE_REF (none: a git ref whose pdrouter goes in as pdrouter-base, for bench-vllm.sh's
# BASE= on the device).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${DEVBENCH_DIR:-bin/devbench}
pyver=${DEVBENCH_PY:-3.12}
pin=vllm-router==0.1.17
budget_mib=56 # what may go beside the ~3 MiB working tree under the tool's 64 MiB
stage=$(mktemp -d /tmp/devbench-bundle.XXXXXX)
trap 'rm -rf "$stage"' EXIT
rm -rf "$out"
mkdir -p "$out/wheels" "$stage/bin" "$stage/lib/nginx" "$stage/libexec"

echo "devbench-bundle: Go binaries" >&2
for p in cmd/pdrouter cmd/mockworker bench/stubengine cmd/pdbench cmd/kvproxy; do
	CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$stage/bin/$(basename "$p")" "./$p"
done
if [ -n "${BASE_REF:-}" ]; then
	mkdir "$stage/base"
	git archive "$BASE_REF" | tar -x -C "$stage/base"
	(cd "$stage/base" && CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$stage/bin/pdrouter-base" ./cmd/pdrouter)
fi

echo "devbench-bundle: nginx from Debian" >&2
mkdir -m 777 "$stage/apt" # apt-get downloads as the user _apt
chmod 755 "$stage"
(cd "$stage/apt" && apt-get download -q nginx >/dev/null)
dpkg -x "$stage"/apt/nginx_*.deb "$stage/deb"
cp "$stage/deb/usr/sbin/nginx" "$stage/libexec/nginx"
# The libraries ldd resolves, glibc's own aside (every Linux has those, and they must match
# the machine's loader).
ldd "$stage/libexec/nginx" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
	grep -Ev '/(libc|libm|libdl|libpthread|librt|ld-linux[^/]*)\.so' |
	while read -r lib; do cp -L "$lib" "$stage/lib/nginx/"; done
cat >"$stage/bin/nginx" <<'SH'
#!/bin/sh
# Debian's nginx with its libraries beside it; -e: its compiled-in error log may not exist here.
here=$(dirname "$(readlink -f "$0")")
LD_LIBRARY_PATH=$here/../lib/nginx exec "$here/../libexec/nginx" -e stderr "$@"
SH
chmod +x "$stage/bin/nginx"
"$stage/bin/nginx" -v

echo "devbench-bundle: compressing" >&2
tar -C "$stage" -cf - bin lib libexec | xz -T0 -6 >"$out/tools.tar.xz"

echo "devbench-bundle: $pin and its closure for CPython $pyver" >&2
python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
	--python-version "$pyver" --implementation cp --abi "cp${pyver/./}" \
	--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
	--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
	-d "$out/wheels" "$pin"

{
	echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
	echo "python $pyver"
	(cd "$out/wheels" && ls)
	(cd "$stage" && ls -l bin libexec lib/nginx)
} >"$out/MANIFEST"
du -sh "$out"/* >&2
size=$(du -sm "$out" | cut -f1)
echo "devbench-bundle: $out is $size MiB (tree: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes)" >&2
[ "$size" -le "$budget_mib" ] || { echo "devbench-bundle: $size MiB is over the $budget_mib MiB budget" >&2; exit 1; }
