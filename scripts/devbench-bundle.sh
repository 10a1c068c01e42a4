#!/usr/bin/env bash
# make devbench-bundle: what scripts/devbench-run.sh needs on the GPU machine (16 cores, Python
# 3.12, no Go, no network, no nginx or pip index), in an ignored folder that the device tool
# carries (its limit: 64 MiB with the ~3 MiB working tree, so each bundle goes in a call of its
# own). Static Go builds (CGO_ENABLED=0, stripped: the Go binaries are ~60 MiB raw) go in xz tars.
#   scripts/devbench-bundle.sh [vllm]: bin/devbench, for bench-vllm.sh
#     tools.tar.xz  pdrouter, mockworker, stubengine, pdbench, and Debian's nginx with the
#                   libraries it links (glibc's aside) behind a wrapper that points nginx alone at
#                   them where the machine lacks one
#     wheels/       vllm-router 0.1.17 and everything it imports at run time, resolved by pip for
#                   CPython $DEVBENCH_PY on manylinux x86_64: the whole closure, so that the
#                   install there depends on no package the machine happens to have
#   scripts/devbench-bundle.sh kv: bin/devbench-kv, for python/harness/small_write_ab.py
#     kv.tar.xz     kvproxy (without cgo: tcp and shm, no ucx) and Mooncake's TransferEngine
#                   (mooncake-transfer-engine-non-cuda, as scripts/sglang-venv.sh pins it) for
#                   CPython $DEVBENCH_PY: its Python package and engine.so with what engine.so
#                   loads, debug sections stripped; the system libraries it links (libcurl,
#                   libibverbs, libnuma and theirs, glibc's and the C++ runtime's aside) beside
#                   its own, where its rpath finds them; the wheel's tools and store are left out
#   MANIFEST        the commit and what went in.
# Knobs: DEVBENCH_DIR (bin/devbench, bin/devbench-kv), DEVBENCH_PY (3.12; 3.11 for a rehearsal on
# this box's Python), BASE_REF (none: a git ref whose pdrouter goes in as pdrouter-base, for
# bench-vllm.sh's BASE= there).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-vllm}
pyver=${DEVBENCH_PY:-3.12}
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
	--platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
budget_mib=56 # beside the working tree, under the tool's 64 MiB
case $what in
vllm) out=${DEVBENCH_DIR:-bin/devbench} ;;
kv) out=${DEVBENCH_DIR:-bin/devbench-kv} ;;
*) echo "usage: $0 [vllm|kv]" >&2; exit 2 ;;
esac
stage=$(mktemp -d /tmp/devbench-bundle.XXXXXX)
trap 'rm -rf "$stage"' EXIT
rm -rf "$out"
mkdir -p "$out" "$stage/bin"
gobuild() { # DIR OUTPUT
	CGO_ENABLED=0 go build -trimpath -ldflags '-s -w' -o "$2" "./$1"
}
# libs_of FILE DEST: copies the libraries ldd resolves for FILE to DEST, except glibc's and the
# C++ runtime's (every machine that runs Python has those, and glibc's must match its loader)
libs_of() {
	if ldd "$1" | grep -q 'not found'; then
		echo "devbench-bundle: $1 links libraries this box lacks:" >&2
		ldd "$1" | grep 'not found' >&2
		exit 1
	fi
	ldd "$1" | awk '$2 == "=>" && $3 ~ /^\// {print $3}' |
		grep -Ev '/(libc|libm|libdl|libpthread|librt|libresolv|libstdc\+\+|libgcc_s|ld-linux[^/]*)\.so' |
		while read -r lib; do [ -e "$2/$(basename "$lib")" ] || cp -L "$lib" "$2/"; done
}

if [ "$what" = vllm ]; then
	echo "devbench-bundle: Go binaries" >&2
	for p in cmd/pdrouter cmd/mockworker bench/stubengine cmd/pdbench; do gobuild "$p" "$stage/bin/$(basename "$p")"; done
	if [ -n "${BASE_REF:-}" ]; then
		mkdir "$stage/base"
		git archive "$BASE_REF" | tar -x -C "$stage/base"
		(cd "$stage/base" && gobuild cmd/pdrouter "$stage/bin/pdrouter-base")
	fi

	echo "devbench-bundle: nginx from Debian" >&2
	mkdir -m 777 "$stage/apt" # apt-get downloads as the user _apt
	chmod 755 "$stage"
	(cd "$stage/apt" && apt-get download -q nginx >/dev/null)
	dpkg -x "$stage"/apt/nginx_*.deb "$stage/deb"
	mkdir -p "$stage/libexec" "$stage/lib/nginx"
	cp "$stage/deb/usr/sbin/nginx" "$stage/libexec/nginx"
	libs_of "$stage/libexec/nginx" "$stage/lib/nginx"
	cat >"$stage/bin/nginx" <<-'SH'
	#!/bin/sh
	# Debian's nginx: on the machine's libraries when it has them all (they match its glibc; the
	# bundled libcrypt needs glibc 2.36), else on those beside it. -e: its compiled-in error log
	# may not exist here.
	here=$(dirname "$(readlink -f "$0")")
	! ldd "$here/../libexec/nginx" | grep -q 'not found' || export LD_LIBRARY_PATH=$here/../lib/nginx
	exec "$here/../libexec/nginx" -e stderr "$@"
	SH
	chmod +x "$stage/bin/nginx"
	"$stage/bin/nginx" -v

	echo "devbench-bundle: compressing" >&2
	tar -C "$stage" -cf - bin lib libexec | xz -T0 -6 >"$out/tools.tar.xz"

	pin=vllm-router==0.1.17
	echo "devbench-bundle: $pin and its closure for CPython $pyver" >&2
	python3 -m pip download -q --disable-pip-version-check --only-binary=:all: \
		--python-version "$pyver" --implementation cp --abi "cp${pyver/./}" "${platforms[@]}" -d "$out/wheels" "$pin"
	listing=("$out/wheels")
else
	echo "devbench-bundle: kvproxy" >&2
	gobuild cmd/kvproxy "$stage/bin/kvproxy"

	mooncake_req=$(sed -n 's/^mooncake_req="\(.*\)"$/\1/p' scripts/sglang-venv.sh)
	[ -n "$mooncake_req" ] || { echo "devbench-bundle: no mooncake_req in scripts/sglang-venv.sh" >&2; exit 1; }
	echo "devbench-bundle: $mooncake_req for CPython $pyver" >&2
	python3 -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version "$pyver" --implementation cp --abi "cp${pyver/./}" "${platforms[@]}" -d "$stage/whl" "$mooncake_req"
	python3 -m zipfile -e "$stage"/whl/*.whl "$stage/whl/x"
	src=$stage/whl/x
	mc=$stage/mooncake
	libs=$(cd "$src" && ls -d mooncake_transfer_engine_non_cuda.libs)
	mkdir -p "$mc/mooncake" "$mc/$libs"
	(cd "$src/mooncake" && find . -name '*.py' -exec cp --parents {} "$mc/mooncake/" \;)
	# engine.so and the libraries it names from the wheel, by name; then the system's
	for f in engine.so libasio.so libetcd_wrapper.so; do strip --strip-debug -o "$mc/mooncake/$f" "$src/mooncake/$f"; done
	for f in $(readelf -d "$src/mooncake/engine.so" "$src/$libs"/libglog-* | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort -u); do
		[ ! -e "$src/$libs/$f" ] || strip --strip-debug -o "$mc/$libs/$f" "$src/$libs/$f"
	done
	libs_of "$src/mooncake/engine.so" "$mc/$libs"
	rm -f "$mc/$libs"/libasio* "$mc/$libs"/libetcd_wrapper* # mooncake/ holds those
	if [ "$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')" = "$pyver" ]; then
		PYTHONPATH=$mc python3 -c 'from mooncake.engine import TransferEngine' # what is left loads
	fi

	echo "devbench-bundle: compressing" >&2
	tar -C "$stage" -cf - bin mooncake | xz -T0 -6 >"$out/kv.tar.xz"
	listing=("$stage/whl"/*.whl "$mc/$libs")
fi

{
	echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD || echo ' (with uncommitted changes)')"
	echo "python $pyver"
	ls -l "$stage/bin" "${listing[@]}"
} >"$out/MANIFEST"
du -sh "$out"/* >&2
size=$(du -sm "$out" | cut -f1)
echo "devbench-bundle: $out is $size MiB (the working tree: $(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes)" >&2
[ "$size" -le "$budget_mib" ] || { echo "devbench-bundle: $size MiB is over the $budget_mib MiB budget" >&2; exit 1; }
if [ -z "${DEVBENCH_DIR:-}" ] && [ -d bin/devbench ] && [ -d bin/devbench-kv ]; then
	both=$(( ($(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1) + $(du -cb bin/devbench bin/devbench-kv | tail -1 | cut -f1)) / 1048576 ))
	echo "devbench-bundle: bin/devbench and bin/devbench-kv with the working tree: $both MiB ($( [ "$both" -lt 63 ] && echo 'one call can carry both' || echo 'too much for one call: carry them in two'))" >&2
fi
