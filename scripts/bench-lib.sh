# Sourced by the bench scripts: a temp folder and the processes started in it, both gone at exit,
# a log prefix, and the bash-only port helpers (no curl needed).
#   bench_setup NAME: sets T (temp folder) and pids (kill these at exit), defines log.
bench_setup() {
	BENCH_NAME=$1
	T=$(mktemp -d "/tmp/$1.XXXXXX")
	pids=()
	trap bench_cleanup EXIT
	trap 'exit 130' INT TERM
}
bench_cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
	rm -rf "$T"
}
log() { echo "$BENCH_NAME: $*" >&2; }

# free_port prints a loopback port nobody listens on, below the ephemeral range so that none of
# the benchmark's own client sockets can hold it.
free_port() {
	local p lo
	read -r lo _ </proc/sys/net/ipv4/ip_local_port_range
	while :; do
		p=$((10000 + RANDOM % (lo - 10000)))
		{ (exec 3<>"/dev/tcp/127.0.0.1/$p"); } 2>/dev/null || { echo "$p"; return; }
	done
}

# http_ok PORT PATH: a GET answered 200.
http_ok() {
	{ exec 3<>"/dev/tcp/127.0.0.1/$1"; } 2>/dev/null || return 1
	printf 'GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' "$2" >&3
	local status
	read -r -t 2 status <&3 || true
	exec 3<&-
	[[ $status == *" 200"* ]]
}
