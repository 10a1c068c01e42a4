package router

import (
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// countingServer counts the connections it accepts.
func countingServer(t *testing.T, h http.HandlerFunc) (*httptest.Server, *atomic.Int32) {
	t.Helper()
	var conns atomic.Int32
	srv := httptest.NewUnstartedServer(h)
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, &conns
}

func TestUpstreamReusesConnections(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		if r.Header.Get("X-Test") != "1" || r.Header.Get("Content-Type") != "application/json" {
			w.WriteHeader(400)
		}
		if strings.Contains(r.URL.Path, "chunked") {
			w.(http.Flusher).Flush() // forces chunked framing
		}
		w.Write(b)
	})
	u := newUpstream()
	defer u.closeIdle()
	for i, path := range []string{"/a", "/chunked", "/b", "/chunked", "/c"} {
		resp, err := u.post(&scope{}, srv.URL, path, []byte(`{"i":1}`), []byte("X-Test: 1\r\n"))
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, err := io.ReadAll(resp)
		resp.Close()
		if err != nil || resp.StatusCode != 200 || string(body) != `{"i":1}` {
			t.Fatalf("request %d: %d %q %v", i, resp.StatusCode, body, err)
		}
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("5 sequential requests used %d connections, want 1", n)
	}
}

func TestUpstreamRetriesAConnectionClosedWhileIdle(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	u := newUpstream()
	defer u.closeIdle()
	for i := range 2 {
		resp, err := u.post(&scope{}, srv.URL, "/", nil, nil)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		io.Copy(io.Discard, resp)
		resp.Close()
		srv.CloseClientConnections() // the worker drops its idle keep-alive connection
		time.Sleep(20 * time.Millisecond)
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("want a fresh connection after the idle one was closed: %d", n)
	}
}

func TestUpstreamCancelEndsAWaitAndDropsTheConnection(t *testing.T) {
	release := make(chan struct{})
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	})
	defer close(release)
	u := newUpstream()
	defer u.closeIdle()
	ctx := &scope{}
	cause := errors.New("other leg failed")
	time.AfterFunc(50*time.Millisecond, func() { ctx.cancel(cause) })
	start := time.Now()
	_, err := u.post(ctx, srv.URL, "/", nil, nil)
	if !errors.Is(err, cause) || time.Since(start) > 2*time.Second {
		t.Fatalf("err %v after %v, want the cancel cause at once", err, time.Since(start))
	}
	resp, err := u.post(&scope{}, srv.URL+"x", "/", nil, nil)
	if err == nil {
		resp.Close()
		t.Fatal("a malformed URL must fail")
	}
	if n := conns.Load(); n != 1 {
		t.Errorf("connections %d", n)
	}
	if len(u.idle) != 0 && len(u.idle[strings.TrimPrefix(srv.URL, "http://")]) != 0 {
		t.Error("a cancelled connection went back to the pool")
	}
}

func TestUpstreamHalfReadBodyIsNotReused(t *testing.T) {
	srv, conns := countingServer(t, func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, strings.Repeat("x", 100000))
	})
	u := newUpstream()
	defer u.closeIdle()
	for range 2 {
		resp, err := u.post(&scope{}, srv.URL, "/", nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 10)
		resp.Read(buf)
		resp.Close()
	}
	if n := conns.Load(); n != 2 {
		t.Errorf("a connection with unread body was reused: %d connections", n)
	}
}

func TestHostPort(t *testing.T) {
	for in, want := range map[string][3]string{
		"http://10.0.0.1:30000":   {"10.0.0.1:30000", "10.0.0.1:30000", ""},
		"http://[::1]:8000":       {"[::1]:8000", "[::1]:8000", ""},
		"http://worker":           {"worker:80", "worker", ""},
		"https://w.example/base":  {"w.example:443", "w.example", "w.example"},
		"https://[fe80::1]:8443/": {"[fe80::1]:8443", "[fe80::1]:8443", "fe80::1"},
	} {
		addr, host, tlsHost, err := hostPort(in)
		if err != nil || [3]string{addr, host, tlsHost} != want {
			t.Errorf("%s: %q %q %q %v, want %q", in, addr, host, tlsHost, err, want)
		}
	}
	if _, _, _, err := hostPort("ftp://x"); err == nil {
		t.Error("ftp accepted")
	}
}
