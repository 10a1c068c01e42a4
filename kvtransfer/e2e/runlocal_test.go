package e2e

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// runLocal starts scripts/run-local.sh (make run) on free ports with the
// binaries the tests built, a small pool, and the given extra environment.
func runLocal(t *testing.T, ready string, env ...string) (*testenv.Proc, map[string]int) {
	t.Helper()
	bin := t.TempDir()
	for _, name := range []string{"pdrouter", "mockworker", "kvproxy"} {
		path := testenv.BuildBinary(t, name, testenv.Build{CGO: name == "kvproxy"})
		if err := os.Symlink(path, filepath.Join(bin, name)); err != nil {
			t.Fatal(err)
		}
	}
	ports := map[string]int{}
	vars := []string{"BIN=" + bin, "KV_POOL_TOKENS=1024", "READY_TIMEOUT=60"}
	for _, v := range []string{"PREFILL_PORT", "DECODE_PORT", "BOOTSTRAP_PORT", "ROUTER_PORT", "ROUTER_METRICS_PORT", "KVP_METRICS_PORT", "KVD_METRICS_PORT"} {
		ports[v] = testenv.FreePort(t)
		vars = append(vars, fmt.Sprintf("%s=%d", v, ports[v]))
	}
	for _, e := range env {
		k, v, _ := strings.Cut(e, "=")
		if n, err := strconv.Atoi(v); err == nil {
			ports[k] = n
		}
	}
	script := filepath.Join(testenv.ModuleRoot(t), "scripts", "run-local.sh")
	p := testenv.StartWith(t, script, testenv.Options{Env: append(vars, env...), Ready: ready, ReadyTimeout: 90 * time.Second})
	return p, ports
}

// TestMakeRunMovesKV: make run says ready only once the router is, its
// streamed reply ends with a verified kv_transfer over the transport asked
// for, and when one of its processes dies it says which and exits non-zero.
func TestMakeRunMovesKV(t *testing.T) {
	for _, transport := range []string{"shm", "tcp"} {
		t.Run(transport, func(t *testing.T) {
			p, ports := runLocal(t, "pdrouter ready", "KV_TRANSPORT="+transport)
			router := fmt.Sprintf("http://127.0.0.1:%d", ports["ROUTER_PORT"])
			resp, err := http.Get(router + "/readiness")
			if err != nil || resp.StatusCode != 200 {
				t.Fatalf("readiness once make run said ready: %v %v", resp, err)
			}
			resp.Body.Close()
			body := `{"model":"mock","messages":[{"role":"user","content":"hi"}],"stream":true}`
			resp, err = http.Post(router+"/v1/chat/completions", "application/json", strings.NewReader(body))
			if err != nil {
				t.Fatal(err)
			}
			var last string
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if line := sc.Text(); strings.Contains(line, "kv_transfer") {
					last = line
				}
			}
			resp.Body.Close()
			if !strings.Contains(last, `"checksum_ok":true`) || !strings.Contains(last, `"transport":"`+transport+`"`) {
				t.Fatalf("no verified kv_transfer over %s in the stream: %q", transport, last)
			}
			// The decode engine dies: make run names it and fails.
			pid := child(t, p.Cmd.Process.Pid, fmt.Sprintf("--port\x00%d\x00", ports["DECODE_PORT"]))
			if err := syscall.Kill(pid, syscall.SIGKILL); err != nil {
				t.Fatal(err)
			}
			if code := p.Wait(10 * time.Second); code != 1 {
				t.Fatalf("make run exited 0 after its decode engine died:\n%s", p.Output())
			}
			if !strings.Contains(p.Output(), "decode engine exited (status 137)") {
				t.Fatalf("make run did not say which process exited:\n%s", p.Output())
			}
		})
	}
}

// child returns the pid of the child of parent whose command line holds
// arg (NUL-separated).
func child(t *testing.T, parent int, arg string) int {
	t.Helper()
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		stat, err1 := os.ReadFile(d + "/stat")
		cmd, err2 := os.ReadFile(d + "/cmdline")
		if err1 != nil || err2 != nil {
			continue
		}
		// stat: pid (comm) state ppid ...
		f := strings.Fields(string(stat[strings.LastIndexByte(string(stat), ')')+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(parent) && strings.Contains(string(cmd), arg) {
			pid, _ := strconv.Atoi(filepath.Base(d))
			return pid
		}
	}
	t.Fatalf("no child of %d with %q", parent, arg)
	return 0
}

// TestMakeRunPortTaken: a taken port fails make run at once, naming it.
func TestMakeRunPortTaken(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	port := ln.Addr().(*net.TCPAddr).Port
	p, _ := runLocal(t, "", fmt.Sprintf("ROUTER_METRICS_PORT=%d", port))
	if code := p.Wait(30 * time.Second); code != 1 {
		t.Fatalf("exit status %d, want 1:\n%s", code, p.Output())
	}
	if want := fmt.Sprintf("port %d (router metrics) is taken", port); !strings.Contains(p.Output(), want) {
		t.Fatalf("output lacks %q:\n%s", want, p.Output())
	}
}
