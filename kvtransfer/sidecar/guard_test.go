package sidecar

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"
)

// fromIP is an HTTP client whose connections come from the loopback
// address ip (a peer of its own), one connection per request.
func fromIP(ip string) *http.Client {
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}}
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DialContext: d.DialContext, DisableKeepAlives: true}}
}

// A flood of connections that send nothing, redialled as soon as they are
// closed, holds the bootstrap port at its connection cap. A decode
// kvproxy that asked /route before is still answered, every time; a peer
// new to the port is answered 503, not dropped.
func TestBootstrapFloodStillAnswersKnownPeers(t *testing.T) {
	const limit = 32
	p := start(t, "prefill", "tcp", func(c *Config) { c.bootstrapMaxConns = limit })
	connect(t, p) // registers the pool, so /route answers 200
	addr := p.Addrs().Bootstrap
	route := "http://" + addr + "/route?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1"
	get := func(c *http.Client) (int, error) {
		resp, err := c.Get(route)
		if err != nil {
			return 0, err
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return resp.StatusCode, nil
	}
	peer := fromIP("127.0.0.1")
	if code, err := get(peer); code != 200 {
		t.Fatalf("GET /route before the flood: %d %v", code, err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	held := make(chan struct{}, limit)
	flood := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.2")}}
	for range limit {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				c, err := flood.DialContext(ctx, "tcp", addr)
				if err != nil {
					continue
				}
				stop := context.AfterFunc(ctx, func() { c.Close() })
				_ = c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
				if _, err := c.Read(make([]byte, 1)); errors.Is(err, os.ErrDeadlineExceeded) {
					select { // admitted: held open by the server
					case held <- struct{}{}:
					default:
					}
					_ = c.SetReadDeadline(time.Time{})
					_, _ = io.Copy(io.Discard, c) // until the server closes it
				}
				stop()
				c.Close()
			}
		}()
	}
	defer func() {
		cancel()
		wg.Wait()
	}()
	for range limit - limit/4 { // the strangers' share is full
		<-held
	}
	for i := range 40 {
		if code, err := get(peer); code != 200 {
			t.Fatalf("GET /route %d from a known peer under the flood: %d %v", i, code, err)
		}
	}
	if code, err := get(fromIP("127.0.0.3")); code != http.StatusServiceUnavailable {
		t.Fatalf("GET /route from a new peer under the flood: %d %v, want 503", code, err)
	}
}

// When every connection is busy with a request, one more is answered 503
// (not dropped), and served again once a request ends.
func TestGuardAnswersBusyWith503(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := newConnGuard(ln, 2, nil)
	release := make(chan struct{})
	entered := make(chan struct{}, 2)
	srv := &http.Server{ConnState: g.track, Handler: g.vouch(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/slow" {
			entered <- struct{}{}
			<-release
		}
	}))}
	go srv.Serve(g)
	defer srv.Close()
	url := "http://" + ln.Addr().String()
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if resp, err := client.Get(url + "/slow"); err == nil {
				resp.Body.Close()
			}
		}()
	}
	<-entered
	<-entered
	resp, err := client.Get(url + "/fast")
	if err != nil {
		t.Fatalf("with every connection busy: %v, want a 503", err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("with every connection busy: %d, want 503", resp.StatusCode)
	}
	close(release)
	wg.Wait()
	deadline := time.Now().Add(5 * time.Second)
	for {
		resp, err := client.Get(url + "/fast")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("not served once the busy requests ended: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
