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

# The zero-delay workers of the wrk scripts, chosen by WORKER: stubengine (fixed replies, a fraction
# of a router's cost per request, so that a router change shows) or mockworker (SGLang's behaviour
# in more detail, dearer than the router). Uses BIN, T and pids.
#   check_worker: exits unless WORKER names one of them and BIN holds it.
#   start_wrk_worker VAR ROLE: starts one, waits up to 30 s for its /health and sets VAR to its port.
check_worker() {
	case $WORKER in
	stubengine | mockworker) ;;
	*) log "WORKER must be stubengine or mockworker"; exit 2 ;;
	esac
	[ -x "$BIN/$WORKER" ] || { log "$BIN/$WORKER missing (make bench builds it)"; exit 1; }
}
start_wrk_worker() {
	local port
	port=$(free_port)
	if [ "$WORKER" = stubengine ]; then
		"$BIN/stubengine" --role "$2" --port "$port" --tokens 8 >"$T/w-$port.log" 2>&1 &
	else
		"$BIN/mockworker" --role "$2" --port "$port" --tokens 8 --token-delay 0 --record-requests -1 >"$T/w-$port.log" 2>&1 &
	fi
	pids+=($!)
	for _ in $(seq 300); do
		if http_ok "$port" /health; then
			printf -v "$1" %s "$port"
			return
		fi
		sleep 0.1
	done
	log "$WORKER --role $2 never answered /health; its log:"
	tail -n 20 "$T/w-$port.log" >&2
	exit 1
}

# start_nginx LISTEN_PORT=BACKEND_PORT...: nginx as a keep-alive reverse proxy (unbuffered, so
# that streams pass as they come), one server per pair, under $T/nginx; sets NGINX_PID. Callers
# wait for its ports themselves.
start_nginx() {
	local pair servers=""
	mkdir -p "$T/nginx"
	for pair in "$@"; do
		servers+="
	upstream up${pair%%=*} { server 127.0.0.1:${pair#*=}; keepalive 256; }
	server {
		listen 127.0.0.1:${pair%%=*};
		location / {
			proxy_pass http://up${pair%%=*};
			proxy_http_version 1.1;
			proxy_set_header Connection \"\";
			proxy_buffering off;
		}
	}"
	done
	cat >"$T/nginx/nginx.conf" <<-CONF
	user $(id -un);
	daemon off;
	worker_processes auto;
	pid $T/nginx/nginx.pid;
	error_log $T/nginx/error.log warn;
	events { worker_connections 8192; }
	http {
		access_log off;
		client_body_temp_path $T/nginx/body;
		proxy_temp_path $T/nginx/proxy;
		fastcgi_temp_path $T/nginx/fastcgi;
		uwsgi_temp_path $T/nginx/uwsgi;
		scgi_temp_path $T/nginx/scgi;$servers
	}
	CONF
	nginx -p "$T/nginx" -c "$T/nginx/nginx.conf" >"$T/nginx/stdout.log" 2>&1 &
	NGINX_PID=$!
	pids+=("$NGINX_PID")
}
