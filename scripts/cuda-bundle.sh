#!/usr/bin/env bash
# make cuda-bundle: kvproxy, ucxbench, mockworker and the GPU test binaries
# (cuda, ucx, kvtransfer) built against UCX 1.22 with CUDA from PyPI's
# libucx-cu13 wheel (Debian's UCX 1.13 stays the default build), plus the
# trimmed UCX libraries they run with, in
# bin/cuda (under 64 MiB: what the device tool carries). No CUDA toolkit is
# needed: UCX's CUDA transports and cuda load the driver at run time.
# Run there with: bin/cuda/env.sh <command> (sets LD_LIBRARY_PATH and PATH).
set -euo pipefail
cd "$(dirname "$0")/.."
ver=1.22.0
cache=${PDROUTER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdrouter}/libucx-cu13-$ver
out=bin/cuda
mkdir -p "$cache"
whl=$(ls "$cache"/libucx_cu13-$ver-*.whl 2>/dev/null | head -1 || true)
if [ -z "$whl" ]; then
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 -d "$cache" "libucx-cu13==$ver"
	whl=$(ls "$cache"/libucx_cu13-$ver-*.whl | head -1)
fi
if [ ! -f "$cache/w/libucx/lib/libucp.so.0" ]; then
	rm -rf "$cache/w"
	python3 -m zipfile -e "$whl" "$cache/w"
fi
prefix=$(cd "$cache/w/libucx" && pwd)
mkdir -p "$cache/pc"
for pc in "$prefix"/lib/pkgconfig/ucx*.pc; do
	sed "s|^prefix = .*|prefix = $prefix|" "$pc" >"$cache/pc/$(basename "$pc")"
done
export PKG_CONFIG_PATH=$cache/pc CGO_ENABLED=1
got=$(pkg-config --modversion ucx)
[ "$got" = "$ver" ] || { echo "pkg-config found UCX $got, want $ver" >&2; exit 1; }

rm -rf "$out" && mkdir -p "$out/bin" "$out/lib/ucx"
# The binaries find the bundle's libraries through their rpath.
export CGO_LDFLAGS='-Wl,-rpath,$ORIGIN/../lib'
go build -ldflags '-s -w' -o "$out/bin/kvproxy" ./cmd/kvproxy
go build -ldflags '-s -w' -o "$out/bin/ucxbench" ./cmd/ucxbench
go build -ldflags '-s -w' -o "$out/bin/mockworker" ./cmd/mockworker
go test -c -ldflags '-s -w' -o "$out/bin/ucx.test" ./ucx
go test -c -ldflags '-s -w' -o "$out/bin/cuda.test" ./cuda
go test -c -ldflags '-s -w' -o "$out/bin/kvtransfer.test" ./kvtransfer

# The libraries that run: UCP and its dependencies, the CUDA and CMA
# transport modules, and ucx_perftest with its CUDA memory module. Debug
# information goes (the wheel ships it: 54 MiB of modules alone).
lib=$prefix/lib
for f in libucp.so.0 libucs.so.0 libuct.so.0 libucm.so.0 libucs_signal.so.0; do
	strip --strip-debug -o "$out/lib/$f" "$lib/$f"
done
for m in libuct_cuda libucm_cuda libuct_cma libucx_perftest_cuda; do
	strip --strip-debug -o "$out/lib/ucx/$m.so.0" "$lib/ucx/$m.so.0"
	ln -s "$m.so.0" "$out/lib/ucx/$m.so"
done
for f in "$prefix"/../libucx_cu13.libs/*.so*; do
	strip --strip-debug -o "$out/lib/$(basename "$f")" "$f"
done
strip --strip-debug -o "$out/bin/ucx_perftest" "$prefix/bin/ucx_perftest"
strip --strip-debug -o "$out/bin/ucx_info" "$prefix/bin/ucx_info"
chmod +x "$out"/bin/*
cat >"$out/env.sh" <<'SH'
#!/usr/bin/env bash
# Runs a command with the bundle's UCX: bin/cuda/env.sh ucx_perftest ...
here=$(cd "$(dirname "$0")" && pwd)
export LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH} PATH=$here/bin:$PATH
exec "$@"
SH
chmod +x "$out/env.sh"
du -sh "$out"
size=$(du -sm "$out" | cut -f1)
[ "$size" -lt 60 ] || { echo "bundle is $size MiB: over the 60 MiB budget" >&2; exit 1; }
