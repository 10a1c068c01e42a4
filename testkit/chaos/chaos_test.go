// Package chaos runs issue 13's attack scenarios against the real binaries
// and asserts their outcomes. `go test` runs a short pass; `make chaos`
// sets CHAOS_FULL=1 for the sizes.
package chaos

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

// size is n in the short pass, full under CHAOS_FULL=1.
func size(n, full int) int {
	if os.Getenv("CHAOS_FULL") == "1" {
		return full
	}
	return n
}

var client = &http.Client{Timeout: 5 * time.Second}

func status(url string) int {
	resp, err := client.Get(url)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func dialMany(t *testing.T, addr string, n int, first string) []net.Conn {
	t.Helper()
	var cs []net.Conn
	for range n {
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			continue
		}
		if first != "" {
			_, _ = io.WriteString(c, first)
		}
		cs = append(cs, c)
	}
	t.Cleanup(func() {
		for _, c := range cs {
			c.Close()
		}
	})
	return cs
}

// Rows 1 and 2: at --nofile 1024, idle connections and slowloris heads
// never stop the router; heads are closed at the header timeout and the
// router serves again right after.
func TestRouterUnderConnectionFlood(t *testing.T) {
	if _, err := exec.LookPath("prlimit"); err != nil {
		t.Fatal("needs prlimit (util-linux) to lower the router's fd limit")
	}
	port := testenv.FreePort(t)
	addr := "127.0.0.1:" + strconv.Itoa(port)
	p := testenv.Start(t, "prlimit", "--nofile=1024:1024", testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1",
		"--port", strconv.Itoa(port), "--prometheus-port", "0", "--policy", "round_robin", "--header-read-timeout-secs", "2")
	testenv.WaitStatus(t, "http://"+addr+"/health", 200, 30*time.Second)
	idle := dialMany(t, addr, size(1200, 5000), "")
	slow := dialMany(t, addr, size(200, 1000), "GET /health HTTP/1.1\r\nHost: x\r\n")
	start := time.Now()
	for _, c := range slow {
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.Copy(io.Discard, c)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("slowloris heads closed after %v, want within the 2 s header timeout (+ scheduling)", d)
	}
	deadline := time.Now().Add(5 * time.Second)
	for status("http://"+addr+"/health") != 200 {
		if time.Now().After(deadline) {
			t.Fatal("router does not serve /health after the flood")
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("%d idle + %d slowloris connections; serving again %v after", len(idle), len(slow), time.Since(start).Round(time.Millisecond))
	if p.Cmd.ProcessState != nil || strings.Contains(p.Output(), "router stopped") {
		t.Fatal("router exited")
	}
}

// Row 4: invented methods add no series.
func TestRouterMetricsUnderInventedMethods(t *testing.T) {
	port, prom := testenv.FreePort(t), testenv.FreePort(t)
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	metrics := "http://127.0.0.1:" + strconv.Itoa(prom) + "/metrics"
	testenv.Start(t, testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(prom), "--policy", "round_robin")
	testenv.WaitStatus(t, base+"/health", 200, 30*time.Second)
	series := func() int {
		resp, err := client.Get(metrics)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		n := 0
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "smg_") {
				n++
			}
		}
		return n
	}
	invent := func(n int, tag string) {
		c, err := net.Dial("tcp", "127.0.0.1:"+strconv.Itoa(port))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		br := bufio.NewReader(c)
		for i := range n {
			fmt.Fprintf(c, "X%s%d /health HTTP/1.1\r\nHost: x\r\n\r\n", tag, i)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatal(err)
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 405 {
				t.Fatalf("invented method: %d, want 405", resp.StatusCode)
			}
		}
	}
	invent(10, "warm")
	before := series()
	invent(size(2000, 10000), "x")
	if after := series(); after != before {
		t.Fatalf("smg_* samples %d -> %d", before, after)
	}
}

var vmRSS = regexp.MustCompile(`VmRSS:\s+(\d+) kB`)

func rssMiB(t *testing.T, pid int) float64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	m := vmRSS.FindSubmatch(b)
	kb, _ := strconv.Atoi(string(m[1]))
	return float64(kb) / 1024
}

// Row 3: a HELLO flood on the peer port (MEM_HELLOs claiming 4 MiB, and
// MEM_HELLOs of 200 KiB sent half-way) costs kvproxy at most 64 MiB, and
// it keeps serving.
func TestKVProxyHelloFlood(t *testing.T) {
	dir := t.TempDir()
	mport := testenv.FreePort(t)
	bin := testenv.BuildBinary(t, "kvproxy", testenv.Build{CGO: true})
	p := testenv.StartWith(t, bin, testenv.Options{Ready: "kvproxy ready", ReadyTimeout: 30 * time.Second}, "--role", "prefill",
		"--transport", "tcp", "--control", filepath.Join(dir, "kv.sock"), "--bootstrap-port", "0", "--peer-port", "0",
		"--metrics-port", strconv.Itoa(mport), "--log-level", "error")
	peer := regexp.MustCompile(`peer=(\S+)`).FindStringSubmatch(p.Line)[1]
	health := "http://127.0.0.1:" + strconv.Itoa(mport) + "/health"
	before := rssMiB(t, p.Cmd.Process.Pid)
	// Frame headers (wire format: "KV", version 2, type, length): MEM_HELLO
	// is type 7.
	hello := func(typ byte, n uint32) []byte {
		return []byte{'K', 'V', 2, typ, byte(n), byte(n >> 8), byte(n >> 16), byte(n >> 24)}
	}
	n := 300
	claim := dialMany(t, peer, size(100, 300), string(hello(7, 4<<20))+strings.Repeat("x", 4<<20-1))
	half := dialMany(t, peer, n, string(hello(7, 200<<10))+strings.Repeat("y", 100<<10))
	time.Sleep(time.Second)
	peak := rssMiB(t, p.Cmd.Process.Pid)
	if status(health) != 200 {
		t.Error("kvproxy /health does not answer during the flood")
	}
	for _, c := range append(claim, half...) {
		c.Close()
	}
	t.Logf("kvproxy RSS %.1f MiB -> %.1f MiB under %d+%d HELLO connections", before, peak, len(claim), len(half))
	if peak-before > 64 {
		t.Errorf("RSS grew %.1f MiB, want <= 64", peak-before)
	}
	if status(health) != 200 {
		t.Fatal("kvproxy /health does not answer after the flood")
	}
}
