// Package testenv runs the project's real binaries for end-to-end tests:
// it builds them once per test process, starts them on loopback ports and
// stops them when the test ends.
package testenv

import (
	"bufio"
	"bytes"
	"cmp"
	"fmt"
	"io"
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

// Build is how BuildBinary builds a command. The zero value builds as the
// binary ships, with cgo off, plus -race when the tests run with it (which
// needs cgo), so the binary's races fail tests too.
type Build struct {
	CGO    bool // cgo on (kvproxy's ucx transport needs it)
	NoRace bool // never -race: for binaries whose speed the tests rely on
}

// Binary builds ./cmd/name with the zero Build.
func Binary(t testing.TB, name string) string { return BuildBinary(t, name, Build{}) }

// BuildBinary builds ./cmd/name once per test process and Build and
// returns its path.
func BuildBinary(t testing.TB, name string, b Build) string {
	t.Helper()
	race := raceEnabled && !b.NoRace
	cgo := "0"
	if b.CGO || race {
		cgo = "1"
	}
	key := fmt.Sprintf("%s-cgo%s-race%t", name, cgo, race)
	buildMu.Lock()
	defer buildMu.Unlock()
	if p, ok := built[key]; ok {
		return p
	}
	if buildDir == "" {
		d, err := os.MkdirTemp("", "pdrouter-e2e-")
		if err != nil {
			t.Fatal(err)
		}
		buildDir = d
	}
	out := filepath.Join(buildDir, key, name)
	args := []string{"build", "-o", out}
	if race {
		args = append(args, "-race")
	}
	cmd := exec.Command("go", append(args, "./cmd/"+name)...)
	cmd.Dir = ModuleRoot(t)
	cmd.Env = append(os.Environ(), "CGO_ENABLED="+cgo)
	if msg, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", name, err, msg)
	}
	built[key] = out
	return out
}

// Main runs the tests, then removes the binaries they built.
func Main(m *testing.M) {
	code := m.Run()
	buildMu.Lock()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	buildMu.Unlock()
	os.Exit(code)
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
	Cmd *exec.Cmd
	// Line is the ready line (Options.Ready); Addr is what follows Ready
	// on it when that is a HOST:PORT, as in "listening on HOST:PORT".
	Line string
	Addr string
	log  *SyncBuffer
	done chan struct{}
}

// SyncBuffer is a bytes.Buffer that goroutines may write at once: a
// process's output, or a logger's sink (Sync makes it a zapcore.WriteSyncer).
type SyncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *SyncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *SyncBuffer) Sync() error { return nil }

func (s *SyncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Options say how Start runs a binary.
type Options struct {
	Env []string // added to the tests' environment
	// Ready makes Start wait until a line of the binary's output (stdout
	// or stderr) contains it, failing the test after ReadyTimeout
	// (default 30 s) or if the binary exits first.
	Ready        string
	ReadyTimeout time.Duration
}

// Start runs bin with args and does not wait for it.
func Start(t testing.TB, bin string, args ...string) *Proc {
	t.Helper()
	return StartWith(t, bin, Options{}, args...)
}

// StartWith runs bin with args as o says. The process is stopped when the
// test ends and its output is logged if the test failed.
func StartWith(t testing.TB, bin string, o Options, args ...string) *Proc {
	t.Helper()
	p := &Proc{Cmd: exec.Command(bin, args...), log: &SyncBuffer{}, done: make(chan struct{})}
	p.Cmd.Env = append(childEnv(), o.Env...)
	ready := make(chan string, 1)
	var scanned sync.WaitGroup
	for _, stream := range []func() (io.ReadCloser, error){p.Cmd.StdoutPipe, p.Cmd.StderrPipe} {
		r, err := stream()
		if err != nil {
			t.Fatal(err)
		}
		scanned.Go(func() {
			sc := bufio.NewScanner(r)
			sc.Buffer(make([]byte, 64<<10), 1<<20)
			for sc.Scan() {
				line := sc.Text()
				if o.Ready != "" && strings.Contains(line, o.Ready) {
					select {
					case ready <- line:
					default: // only the first ready line counts
					}
				}
				fmt.Fprintln(p.log, line)
			}
			_, _ = io.Copy(io.Discard, r) // an overlong line: keep the pipe drained
		})
	}
	if err := p.Cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", bin, err)
	}
	go func() {
		scanned.Wait()   // Wait closes the pipes: read them to the end first
		_ = p.Cmd.Wait() // the exit status stays in Cmd.ProcessState
		close(p.done)
	}()
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("%s %s output:\n%s", filepath.Base(bin), strings.Join(args, " "), p.log.String())
		}
	})
	if o.Ready == "" {
		return p
	}
	wait := cmp.Or(o.ReadyTimeout, 30*time.Second)
	select {
	case p.Line = <-ready:
	case <-p.done:
		select {
		case p.Line = <-ready: // it printed the line, then exited
		default:
			t.Fatalf("%s exited before %q:\n%s", bin, o.Ready, p.log.String())
		}
	case <-time.After(wait):
		t.Fatalf("%s: no %q within %v:\n%s", bin, o.Ready, wait, p.log.String())
	}
	rest := strings.TrimSpace(p.Line[strings.Index(p.Line, o.Ready)+len(o.Ready):])
	if _, _, err := net.SplitHostPort(rest); err == nil && !strings.ContainsAny(rest, " \t") {
		p.Addr = rest
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
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		select {
		case <-p.done: // exited as the time ran out
		default:
			return -1
		}
	}
	return p.Cmd.ProcessState.ExitCode()
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

// Do sends req with c (nil: http.DefaultClient) and returns the reply and
// its whole body; a failed send or read fails the test.
func Do(t testing.TB, c *http.Client, req *http.Request) (*http.Response, []byte) {
	t.Helper()
	if c == nil {
		c = http.DefaultClient
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s %s: reading the reply: %v", req.Method, req.URL, err)
	}
	return resp, b
}
