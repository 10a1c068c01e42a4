package netutil

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	if os.Getenv("NETUTIL_EMFILE_CHILD") == "1" {
		os.Exit(emfileChild())
	}
	goleak.VerifyTestMain(m)
}

// TestAcceptSurvivesEMFILE runs emfileChild in a process of its own, whose
// fd limit it lowers: accept must hit EMFILE, pause, and serve again once
// descriptors are free.
func TestAcceptSurvivesEMFILE(t *testing.T) {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "NETUTIL_EMFILE_CHILD=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

func emfileChild() int {
	fail := func(format string, args ...any) int {
		os.Stderr.WriteString("child: " + format + "\n")
		for _, a := range args {
			os.Stderr.WriteString("  " + a.(error).Error() + "\n")
		}
		return 1
	}
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &syscall.Rlimit{Cur: 48, Max: 48}); err != nil {
		return fail("setrlimit", err)
	}
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return fail("listen", err)
	}
	var pauses atomic.Int32
	ln := Listen(raw, Options{OnAcceptError: func(err error, _ time.Duration) {
		if errors.Is(err, syscall.EMFILE) {
			pauses.Add(1)
		}
	}})
	acceptErr := make(chan error, 1)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				acceptErr <- err
				return
			}
			go func() { _, _ = io.Copy(c, c); _ = c.Close() }()
		}
	}()
	var clients []net.Conn
	for range 60 { // more than the limit holds, with their accepted ends
		c, err := net.DialTimeout("tcp", raw.Addr().String(), time.Second)
		if err == nil {
			clients = append(clients, c)
		}
	}
	deadline := time.Now().Add(3 * time.Second)
	for pauses.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if pauses.Load() == 0 {
		return fail("accept never ran out of descriptors")
	}
	for _, c := range clients {
		_ = c.Close()
	}
	// Served again: a fresh connection echoes.
	var c net.Conn
	for until := time.Now().Add(5 * time.Second); time.Now().Before(until); {
		if c, err = net.DialTimeout("tcp", raw.Addr().String(), time.Second); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		return fail("dial after", err)
	}
	_ = c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Write([]byte("x")); err != nil {
		return fail("write", err)
	}
	var b [1]byte
	if _, err := io.ReadFull(c, b[:]); err != nil {
		return fail("echo after EMFILE", err)
	}
	select {
	case err := <-acceptErr:
		return fail("accept returned", err)
	default:
	}
	_ = ln.Close()
	if err := <-acceptErr; !errors.Is(err, net.ErrClosed) {
		return fail("accept after close", err)
	}
	os.Stdout.WriteString("EMFILE pauses: ok\n")
	return 0
}

func TestMaxConnsRefusesAndRecovers(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusal := []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	ln := Listen(raw, Options{MaxConns: 2, Refusal: refusal})
	accepted := make(chan net.Conn, 4)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	dial := func() net.Conn {
		c, err := net.Dial("tcp", raw.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		return c
	}
	dial()
	dial()
	s1, s2 := <-accepted, <-accepted
	if ln.Open() != 2 {
		t.Fatalf("open %d, want 2", ln.Open())
	}
	third := dial()
	_, _ = third.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	_ = third.SetReadDeadline(time.Now().Add(5 * time.Second))
	got, err := io.ReadAll(third)
	if err != nil || string(got) != string(refusal) {
		t.Fatalf("refused conn read %q, %v", got, err)
	}
	if ln.Refused() != 1 {
		t.Fatalf("refused %d, want 1", ln.Refused())
	}
	_ = s1.Close()
	_ = s1.Close() // counted once
	dial()
	select {
	case s3 := <-accepted:
		_ = s3.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("no connection accepted after one closed")
	}
	_ = s2.Close()
	if ln.Open() != 0 {
		t.Fatalf("open %d after closing all, want 0", ln.Open())
	}
	_ = ln.Close()
	<-done
}

// serveAccepts accepts on ln in workers goroutines, writing "ok" to each
// accepted connection and handing it to accepted, until ln closes.
func serveAccepts(t *testing.T, ln *Listener, workers int, accepted chan<- net.Conn) {
	var wg sync.WaitGroup
	for range workers {
		wg.Go(func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				_, _ = c.Write([]byte("ok"))
				accepted <- c
			}
		})
	}
	t.Cleanup(func() {
		_ = ln.Close()
		wg.Wait()
	})
}

// knock dials addr, sends a request head and reports whether the
// listener accepted ("ok") or refused (the refusal) the connection.
func knock(t *testing.T, addr string, refusal []byte) bool {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_, _ = c.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 2)
	if _, err := io.ReadFull(c, buf); err != nil {
		t.Fatalf("read %q: %v", buf, err)
	}
	if string(buf) == "ok" {
		return true
	}
	rest, err := io.ReadAll(c)
	if got := string(buf) + string(rest); err != nil || got != string(refusal) {
		t.Fatalf("neither accepted nor refused: read %q, %v", got, err)
	}
	return false
}

func TestSetMaxConnsRaisesAndLowers(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusal := []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	ln := Listen(raw, Options{MaxConns: 1, Refusal: refusal})
	accepted := make(chan net.Conn, 16)
	serveAccepts(t, ln, 1, accepted)
	addr := raw.Addr().String()
	expect := func(step string, want bool) {
		t.Helper()
		if got := knock(t, addr, refusal); got != want {
			t.Fatalf("%s: accepted %v, want %v (limit %d, open %d)", step, got, want, ln.MaxConns(), ln.Open())
		}
		if want {
			t.Cleanup(func() { _ = (<-accepted).Close() })
		}
	}
	expect("first under 1", true)
	expect("second over 1", false)
	ln.SetMaxConns(3)
	if ln.MaxConns() != 3 {
		t.Fatalf("MaxConns %d after SetMaxConns(3)", ln.MaxConns())
	}
	expect("second under 3", true)
	expect("third under 3", true)
	expect("fourth over 3", false)
	ln.SetMaxConns(1)
	if ln.Open() != 3 {
		t.Fatalf("lowering the limit left %d open, want the 3 already open", ln.Open())
	}
	expect("over a lowered limit", false)
	if ln.Refused() != 3 {
		t.Fatalf("refused %d, want 3", ln.Refused())
	}
	ln.SetMaxConns(0)
	for i := range 5 {
		expect(fmt.Sprintf("unlimited #%d", i), true)
	}
}

// Accepts in several goroutines while the limit moves between 4 and 8:
// no connection is let in over the highest limit, every dial is either
// accepted or refused, and the counts agree.
func TestSetMaxConnsUnderConcurrentAccepts(t *testing.T) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refusal := []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
	ln := Listen(raw, Options{MaxConns: 4, Refusal: refusal})
	const dials = 48
	accepted := make(chan net.Conn, dials)
	serveAccepts(t, ln, 4, accepted)
	stop := make(chan struct{})
	var toggler sync.WaitGroup
	toggler.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
				ln.SetMaxConns(4 + 4*(i%2))
				time.Sleep(100 * time.Microsecond)
			}
		}
	})
	var in, out atomic.Int64
	var clients sync.WaitGroup
	for range dials {
		clients.Go(func() {
			if knock(t, raw.Addr().String(), refusal) {
				in.Add(1)
			} else {
				out.Add(1)
			}
		})
	}
	clients.Wait()
	close(stop)
	toggler.Wait()
	if in.Load() > 8 || in.Load() < 4 {
		t.Errorf("%d accepted, want 4..8 (no connection is closed, the limit moved between 4 and 8)", in.Load())
	}
	if in.Load()+out.Load() != dials || int64(ln.Refused()) != out.Load() || int64(ln.Open()) != in.Load() {
		t.Errorf("accepted %d + refused %d of %d dials; listener counts %d open, %d refused", in.Load(), out.Load(), dials, ln.Open(), ln.Refused())
	}
	for range in.Load() {
		_ = (<-accepted).Close()
	}
}

func TestTemporary(t *testing.T) {
	for _, c := range []struct {
		err  error
		want bool
	}{
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", syscall.EMFILE)}, true},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", syscall.ENFILE)}, true},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", syscall.ECONNABORTED)}, true},
		{net.ErrClosed, false},
		{&net.OpError{Op: "accept", Err: os.NewSyscallError("accept4", syscall.EBADF)}, false},
	} {
		if got := Temporary(c.err); got != c.want {
			t.Errorf("Temporary(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}

func TestRaiseFileLimit(t *testing.T) {
	soft, hard, err := RaiseFileLimit()
	if err != nil || soft != hard || soft == 0 {
		t.Fatalf("soft %d hard %d err %v", soft, hard, err)
	}
}
