//go:build !race

package router

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"runtime/debug"
	rtmetrics "runtime/metrics"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/mock/mockworker"
)

// Frame sizes differ under the race detector.

// The frames above a PD stream's wait for its first token over HTTP/1.1
// stay small enough for the collector to shrink its stack to 4 KiB: it
// halves a stack only while the frames in use plus 800 bytes are under a
// quarter of it (older code: 3,624 bytes, a 16 KiB stack). 1,168 bytes
// before the retry loop could go on in a continuation (attempts), 1,208
// since. Over h2c that wait holds no goroutine at all (firstwait.go),
// nor does the wait between tokens; the h2c wait was kept under 1,120
// bytes, for the runtime to start goroutines on 2 KiB stacks, and
// TestWaitingForTheFirstTokenHoldsNoGoroutineNorRequestCtx replaces that
// bound. Read from a GOTRACEBACK=system dump of a child process (the
// frames' sp and fp), since nothing in the runtime reports one
// goroutine's stack.
func TestWaitingStreamStackFitsIn4KiB(t *testing.T) {
	if os.Getenv("PDROUTER_STACK_DUMP") != "" {
		base, _, _, _ := h2cPDWith(t, mockworker.Config{}, mockworker.Config{PrefillDelay: 5 * time.Second, TokenDelay: time.Minute}, func(c *Config) {
			c.Manager.UpstreamHTTP2 = false
		})
		first, err := net.Dial("tcp", strings.TrimPrefix(base, "http://")) // waits for its first token
		if err != nil {
			t.Fatal(err)
		}
		defer first.Close()
		body := `{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":3}}`
		fmt.Fprintf(first, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		waitFor(t, func() bool { return countStacks(routerStacks(), "(*Server).startStream", "awaitBody") == 1 })
		syscall.Kill(os.Getpid(), syscall.SIGQUIT)
		time.Sleep(10 * time.Second)
		return
	}
	if runtime.GOOS != "linux" || runtime.GOARCH != "amd64" || testing.Short() {
		t.Skip("frame sizes measured on linux/amd64")
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestWaitingStreamStackFitsIn4KiB$")
	cmd.Env = append(os.Environ(), "PDROUTER_STACK_DUMP=1", "GOTRACEBACK=system")
	out, _ := cmd.CombinedOutput() // exits 2 on the SIGQUIT
	frame := regexp.MustCompile(`fp=(0x[0-9a-f]+) sp=(0x[0-9a-f]+)`)
	found := false
	for _, g := range strings.Split(string(out), "\n\n") {
		if !strings.Contains(g, "(*Server).startStream(") || !strings.Contains(g, "awaitBody(") {
			continue
		}
		m := frame.FindAllStringSubmatch(g, -1)
		top, _ := strconv.ParseUint(m[0][2][2:], 16, 64)
		bottom, _ := strconv.ParseUint(m[len(m)-1][1][2:], 16, 64)
		found = true
		if used := bottom - top; used+800 >= 8<<10/4 { // then its stack stays at 8 KiB
			t.Errorf("a stream waiting for its first token uses %d bytes of frames, want under %d (a 4 KiB stack): %s", used, 8<<10/4-800, g)
		}
	}
	if !found {
		t.Fatalf("no dump of the wait for the first token in:\n%s", out)
	}
}

// An open stream waiting for its first token holds a 4 KiB stack from the
// start, not only after a collection has shrunk it: nothing on the way
// there goes deeper than a 4 KiB stack holds (the HPACK table's eviction,
// on every request, did: 8 KiB; TestH2COwnValuesAreNotIndexed). With the
// collector off, stacks are what goroutines grew to. The figure includes
// the in-process engine's goroutine per stream (net/http's HTTP/2 server,
// about 8 KiB): 15.7 KiB per stream before, 12.5 after, 8.0 since a
// stream between events holds no goroutine (the engine's alone).
func TestOpenStreamStackIs4KiB(t *testing.T) {
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{TokenDelay: time.Minute})
	for range 3 { // connections up, HPACK tables filled
		if _, err := streamTokens(context.Background(), base, 1); err != nil {
			t.Fatal(err)
		}
	}
	defer debug.SetGCPercent(debug.SetGCPercent(-1))
	runtime.GC()
	before := stackBytes()
	const streams = 200
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = openStream(t, base, 3)
	}
	kib := float64(stackBytes()-before) / streams / 1024
	for _, c := range conns {
		c.Close()
	}
	t.Logf("%.1f KiB of goroutine stacks per open stream, router and engine", kib)
	if kib > 9 {
		t.Errorf("%.1f KiB of goroutine stacks per open stream (router and engine), want at most 9: the router holds a stack per open stream", kib)
	}
}

// stackBytes is the memory the runtime holds for goroutine stacks.
func stackBytes() int64 {
	s := []rtmetrics.Sample{{Name: "/memory/classes/heap/stacks:bytes"}}
	rtmetrics.Read(s)
	return int64(s[0].Value.Uint64())
}
