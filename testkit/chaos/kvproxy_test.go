package chaos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// kvproxy's bootstrap port closes a connection that sends no head within
// its ReadHeaderTimeout (sidecar.newHTTPServer: 10 s); reapBound adds
// room for a loaded 2-core box and the accept backoff (at most 1 s).
const (
	bootstrapHeaderTimeout = 10 * time.Second
	reapBound              = bootstrapHeaderTimeout + 10*time.Second
)

// Row 8: idle connections flooding a prefill kvproxy's bootstrap port.
// "rooms": below the port's connection limit, the bootstrap API keeps
// answering, PD requests through pdrouter keep moving their KV, and the
// server closes the idle connections at its header timeout. "fds": with
// 256 fds (prlimit), a larger flood runs kvproxy out of descriptors while
// an engine dials the control socket (the accept that used to exit it);
// kvproxy stays up and serves the bootstrap API and the control socket
// again once the timeout frees fds.
func TestKVProxyBootstrapFlood(t *testing.T) {
	if _, err := exec.LookPath("prlimit"); err != nil {
		t.Fatal("needs prlimit (util-linux) to lower kvproxy's fd limit")
	}
	t.Run("rooms", func(t *testing.T) { t.Parallel(); bootstrapFloodRooms(t) })
	t.Run("fds", func(t *testing.T) { t.Parallel(); bootstrapFloodFDs(t) })
}

var kvReady = testenv.Options{Ready: "kvproxy ready", ReadyTimeout: 30 * time.Second}

func kvproxyArgs(role, sock string, bootPort int) []string {
	return []string{"--role", role, "--transport", "tcp", "--control", sock, "--bootstrap-port", strconv.Itoa(bootPort),
		"--peer-port", "0", "--metrics-port", "0", "--log-level", "warn"}
}

func alive(t *testing.T, p *testenv.Proc, when string) {
	t.Helper()
	if code := p.Wait(0); code != -1 {
		t.Fatalf("kvproxy exited (%d) %s", code, when)
	}
}

// timedStatus is status(url) and how long it took.
func timedStatus(url string) (int, time.Duration) {
	start := time.Now()
	code := status(url)
	return code, time.Since(start)
}

// pdOverKV is a PD deployment of mock workers whose KV moves through a
// prefill and a decode kvproxy (tcp), behind pdrouter.
type pdOverKV struct {
	prefillKV *testenv.Proc
	router    string
	bootAddr  string // the prefill kvproxy's bootstrap port
	route     string // GET /route for the topology, as SGLang's decode asks
}

// startPDOverKV starts one and waits until the bootstrap port answers the
// topology (the prefill engine registered its pool).
func startPDOverKV(t *testing.T) pdOverKV {
	dir := t.TempDir()
	kv := testenv.BuildBinary(t, "kvproxy", testenv.Build{CGO: true})
	mock := testenv.Binary(t, "mockworker")
	workerFlags := []string{"--port", "0", "--tokens", "4", "--kv-layers", "2", "--kv-bytes-per-token", "64",
		"--kv-pool-tokens", "4096", "--kv-chunk-tokens", "256"}
	boot := testenv.FreePort(t)
	d := pdOverKV{prefillKV: testenv.StartWith(t, kv, kvReady, kvproxyArgs("prefill", filepath.Join(dir, "p.sock"), boot)...)}
	testenv.StartWith(t, kv, kvReady, kvproxyArgs("decode", filepath.Join(dir, "d.sock"), -1)...)
	prefill := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "},
		append([]string{"--role", "prefill", "--kvproxy", filepath.Join(dir, "p.sock")}, workerFlags...)...)
	decode := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "},
		append([]string{"--role", "decode", "--kvproxy", filepath.Join(dir, "d.sock")}, workerFlags...)...)
	port := testenv.FreePort(t)
	d.router = "http://127.0.0.1:" + strconv.Itoa(port)
	testenv.Start(t, testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-port", "0", "--log-level", "warn", "--pd-disaggregation",
		"--prefill", prefill.URL(), strconv.Itoa(boot), "--decode", decode.URL())
	testenv.WaitStatus(t, d.router+"/readiness", 200, 30*time.Second)
	d.bootAddr = "127.0.0.1:" + strconv.Itoa(boot)
	d.route = "http://" + d.bootAddr + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
	testenv.WaitStatus(t, d.route, 200, 30*time.Second)
	return d
}

// rooms sends n PD requests through the router; each must move its KV intact.
func (d pdOverKV) rooms(t *testing.T, n int, when string) {
	t.Helper()
	for i := range n {
		body := fmt.Sprintf(`{"text":"flood %d","sampling_params":{"max_new_tokens":4}}`, i)
		resp, err := client.Post(d.router+"/generate", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("room %d %s: %v", i, when, err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !bytes.Contains(out, []byte(`"checksum_ok":true`)) {
			t.Fatalf("room %d %s: %d %.300s", i, when, resp.StatusCode, out)
		}
	}
}

func bootstrapFloodRooms(t *testing.T) {
	d := startPDOverKV(t)
	prefillKV, bootAddr, route := d.prefillKV, d.bootAddr, d.route

	// Below the port's 1,024-connection limit: a flood over it is refused
	// at accept, and so are engines until the header timeout frees slots.
	flood := dialMany(t, bootAddr, size(300, 1000), "")
	floodStart := time.Now()
	if len(flood) < size(300, 1000)*9/10 {
		t.Fatalf("only %d flood connections", len(flood))
	}
	var worst time.Duration
	for _, url := range []string{"http://" + bootAddr + "/health", route} {
		code, took := timedStatus(url) // bounded by client's 5 s timeout
		if code != 200 {
			t.Fatalf("%s during the flood: %d (0: no answer within 5 s)", url, code)
		}
		worst = max(worst, took)
	}
	// The first PD requests since start: the decode kvproxy resolves the
	// prefill through this bootstrap port now, during the flood.
	rooms := size(10, 50)
	d.rooms(t, rooms, "during the flood")
	roomsTook := time.Since(floodStart)
	if roomsTook > bootstrapHeaderTimeout/2 {
		t.Errorf("checks and rooms took %v: the flood may have been reaped before they ran", roomsTook)
	}
	alive(t, prefillKV, "during the flood")

	// Every idle connection is closed by the server (EOF), not by our
	// deadline, within the header timeout plus slack.
	var open int
	for _, c := range flood {
		_ = c.SetReadDeadline(floodStart.Add(reapBound))
		if _, err := c.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) {
			open++
		}
	}
	reaped := time.Since(floodStart)
	if open > 0 {
		t.Fatalf("%d of %d idle connections still open %v after the flood began", open, len(flood), reapBound)
	}
	if reaped < bootstrapHeaderTimeout-time.Second {
		t.Errorf("idle connections closed after %v, before the %v header timeout: refused, not timed out?", reaped, bootstrapHeaderTimeout)
	}
	alive(t, prefillKV, "after the flood")
	t.Logf("%d idle connections: bootstrap answered within %v; %d KV rooms ok in %v; all closed by the server %v after the flood began",
		len(flood), worst.Round(time.Millisecond), rooms, roomsTook.Round(time.Millisecond), reaped.Round(time.Millisecond))
}

func bootstrapFloodFDs(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kv.sock")
	kv := testenv.BuildBinary(t, "kvproxy", testenv.Build{CGO: true})
	// kvproxy raises its soft fd limit to the hard one: lower both.
	p := testenv.StartWith(t, "prlimit", kvReady, append([]string{"--nofile=256:256", kv}, kvproxyArgs("prefill", sock, 0)...)...)
	line := regexp.MustCompile(`bootstrap=(\S+)`).FindStringSubmatch(p.Line)
	bootAddr := line[1]
	health := "http://" + bootAddr + "/health"

	// Not scaled by CHAOS_FULL: 400 already exhausts 256 fds, and each
	// further 200 or so queued in the backlog waits one more header timeout.
	flood := dialMany(t, bootAddr, 400, "")
	floodStart := time.Now()
	// The flood's connects return once the kernel queued them, before
	// kvproxy accepted them: wait until its bootstrap accept is out of fds,
	// or the engine's connection below could take one of the last.
	waitLogged(t, p, "accept failed", "the bootstrap port's accept to run out of fds", floodStart)
	// An engine connects while no fd is left: accept fails with EMFILE.
	eng, err := control.Dial(sock)
	if err != nil {
		t.Fatal(err)
	}
	defer eng.Close()
	waitLogged(t, p, "control socket accept failed", "the control socket's accept to run out of fds", floodStart)
	alive(t, p, "out of fds")

	// Once the header timeout closes the flood's connections, the
	// bootstrap API and the control socket serve again.
	for status(health) != 200 {
		if time.Since(floodStart) > reapBound {
			t.Fatalf("bootstrap /health does not answer %v after the flood began", reapBound)
		}
		alive(t, p, "waiting for fds")
		time.Sleep(100 * time.Millisecond)
	}
	served := time.Since(floodStart)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, _, err := eng.Hello(ctx); err != nil {
		t.Fatalf("control socket after the flood: %v", err)
	}
	alive(t, p, "after the flood")
	t.Logf("%d idle connections at --nofile 256: kvproxy ran out of fds, stayed up, bootstrap answered again %v after the flood began",
		len(flood), served.Round(time.Millisecond))
}

// waitLogged waits for a log line of p that holds both msg and EMFILE's
// text, within the header timeout that would end the flood.
func waitLogged(t *testing.T, p *testenv.Proc, msg, what string, floodStart time.Time) {
	t.Helper()
	for !slices.ContainsFunc(strings.Split(p.Output(), "\n"), func(line string) bool {
		return strings.Contains(line, msg) && strings.Contains(line, "too many open files")
	}) {
		if time.Since(floodStart) > bootstrapHeaderTimeout-time.Second {
			t.Fatalf("waited %v for %s", time.Since(floodStart).Round(time.Millisecond), what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
