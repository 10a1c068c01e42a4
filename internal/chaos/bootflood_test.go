package chaos

import (
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"testing"
	"time"
)

// Row 14 (issue 26 item 4): a reconnecting flood of silent connections
// from another address holds the bootstrap port at its 1,024-connection
// cap. Engines and kvproxies that asked /route before are still answered
// every time, PD requests keep moving their KV, and a caller new to the
// port is refused at once.
func TestKVProxyBootstrapFloodAtCap(t *testing.T) {
	d := startPDOverKV(t) // 127.0.0.1 is a known peer from now on: it asked /route
	route := d.route

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex
	held := 0
	from := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	for range 1100 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := from.DialContext(ctx, "tcp", d.bootAddr)
				if err != nil {
					time.Sleep(10 * time.Millisecond)
					continue
				}
				stop := context.AfterFunc(ctx, func() { c.Close() })
				mu.Lock()
				held++
				mu.Unlock()
				_, _ = io.Copy(io.Discard, c) // until kvproxy closes it
				mu.Lock()
				held--
				mu.Unlock()
				stop()
				c.Close()
			}
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
	}()
	time.Sleep(2 * time.Second) // the flood fills the strangers' share and keeps redialling
	mu.Lock()
	flooding := held
	mu.Unlock()

	known := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	defer known.CloseIdleConnections()
	for i := range 40 {
		resp, err := known.Get(route)
		if err != nil {
			t.Fatalf("GET /route %d from a known peer under the flood: %v", i, err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("GET /route %d from a known peer under the flood: %d", i, resp.StatusCode)
		}
	}
	d.rooms(t, size(10, 50), "during the flood")
	// A caller new to the port is refused at once: a 503 when a refusal
	// slot is free, else a closed connection (the flood's own refusals wait
	// for request heads that never come), never a hang.
	newcomer := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
	stranger := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: newcomer.DialContext, DisableKeepAlives: true}}
	outcome := "503"
	resp, err := stranger.Get(route)
	switch {
	case err != nil && isTimeout(err):
		t.Errorf("GET /route from a new caller under the flood hung: %v", err)
	case err != nil:
		outcome = "closed: " + err.Error()
	default:
		resp.Body.Close()
		if resp.StatusCode != http.StatusServiceUnavailable {
			t.Errorf("GET /route from a new caller under the flood: %d, want 503", resp.StatusCode)
		}
	}
	alive(t, d.prefillKV, "under the flood")
	t.Logf("%d flood connections held open: 40 /route calls from a known peer answered 200, a new caller: %s", flooding, outcome)
}
