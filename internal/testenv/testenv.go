// Package testenv runs the project's real binaries for end-to-end tests:
// it builds them once per test process, starts them on loopback ports and
// stops them when the test ends.
package testenv

import (
	"bufio"
	"bytes"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildMu  sync.Mutex
	buildDir string
	built    = map[string]string{}
)

// ModuleRoot is the directory holding go.mod.
func ModuleRoot(t testing.TB) string {
	t.Helper()
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil || len(bytes.TrimSpace(out)) == 0 {
		t.Fatalf("go env GOMOD: %v", err)
	}
	return filepath.Dir(string(bytes.TrimSpace(out)))
}

// Binary builds ./cmd/name once per test process and returns its path. It is
// built with -race when the tests are, so the binary's races fail tests too.
func Binary(t testing.TB, name string) string {
	t.Helper()
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[name]; ok {
		return p
	}
	if buildDir == "" {
		d, err := os.MkdirTemp("", "pdrouter-e2e-")
		if err != nil {
			t.Fatal(err)
		}
		buildDir = d
	}
	out := filepath.Join(buildDir, name)
	args := []string{"build", "-o", out}
	if raceEnabled {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, "./cmd/"+name)...)
	cmd.Dir = ModuleRoot(t)
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", name, err, msg)
	}
	built[name] = out
	return out
}

// FreePort returns a loopback port that was free a moment ago, for a
// binary that must be told its port. It comes from below the ephemeral
// range: a port from inside it (what listening on :0 gives) can be taken,
// before the binary binds it, by any outgoing connection of the tests
// running in parallel, and the binary then dies with "address already in
// use". Ports handed out once are not handed out again.
func FreePort(t testing.TB) int {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		fmt.Sscan(string(b), &low)
	}
	portsMu.Lock()
	defer portsMu.Unlock()
	for range 1000 {
		p := 10000 + rand.IntN(low-10000)
		if portsGiven[p] {
			continue
		}
		ln, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", p))
		if err != nil {
			continue
		}
		ln.Close()
		portsGiven[p] = true
		return p
	}
	t.Fatal("no free loopback port below the ephemeral range")
	return 0
}

var (
	portsMu    sync.Mutex
	portsGiven = map[int]bool{}
)

// Proc is a running binary.
type Proc struct {
	Cmd  *exec.Cmd
	Addr string // from a "listening on HOST:PORT" first line, if the binary prints one
	log  *syncBuffer
	done chan struct{}
	err  error
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Start runs bin with args; the process is killed when the test ends and
// its output is logged if the test failed.
func Start(t testing.TB, bin string, args ...string) *Proc {
	t.Helper()
	p := &Proc{Cmd: exec.Command(bin, args...), log: &syncBuffer{}, done: make(chan struct{})}
	p.Cmd.Env = childEnv()
	stdout, err := p.Cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	p.Cmd.Stderr = p.log
	if err := p.Cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	first := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stdout)
		sent := false
		for sc.Scan() {
			if !sent {
				first <- sc.Text()
				sent = true
			}
			fmt.Fprintln(p.log, sc.Text())
		}
		if !sent {
			close(first)
		}
	}()
	go func() {
		p.err = p.Cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("%s %s output:\n%s", filepath.Base(bin), strings.Join(args, " "), p.log.String())
		}
	})
	if strings.HasSuffix(bin, "mockworker") {
		select {
		case line := <-first:
			addr, ok := strings.CutPrefix(line, "listening on ")
			if !ok {
				t.Fatalf("%s: first line %q, output:\n%s", bin, line, p.log.String())
			}
			p.Addr = addr
		case <-time.After(30 * time.Second):
			t.Fatalf("%s did not start:\n%s", bin, p.log.String())
		}
	}
	return p
}

// childEnv is the environment of started binaries. A -race binary sleeps
// 1 s at exit by default (GORACE atexit_sleep_ms) to catch late races; the
// tests stop every process they start, so that second would be paid once
// per process and dominate the run time. Races are still reported.
func childEnv() []string {
	env := os.Environ()
	if !raceEnabled {
		return env
	}
	gorace := os.Getenv("GORACE")
	if strings.Contains(gorace, "atexit_sleep_ms") {
		return env
	}
	return append(env, "GORACE="+strings.TrimSpace(gorace+" atexit_sleep_ms=0"))
}

// URL is http://Addr.
func (p *Proc) URL() string { return "http://" + p.Addr }

// Output is what the process wrote so far.
func (p *Proc) Output() string { return p.log.String() }

// Signal sends sig to the process.
func (p *Proc) Signal(sig os.Signal) error { return p.Cmd.Process.Signal(sig) }

// Wait waits up to d for the process to exit and returns its exit code
// (-1 if it is still running).
func (p *Proc) Wait(d time.Duration) int {
	select {
	case <-p.done:
		return p.Cmd.ProcessState.ExitCode()
	case <-time.After(d):
		return -1
	}
}

// Stop ends the process: SIGTERM, then SIGKILL after 5 s.
func (p *Proc) Stop() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(5 * time.Second):
		_ = p.Cmd.Process.Kill()
		<-p.done
	}
}

// WaitStatus polls url until it answers want, or fails the test after d.
func WaitStatus(t testing.TB, url string, want int, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		resp, err := http.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == want {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not answer %d within %v (last: %v)", url, want, d, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
