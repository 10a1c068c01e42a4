package router

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// Issue 26: an abort started by a request cancelled at shutdown could
// outlive Shutdown. Here the stream's client stops reading, so its relay
// is stuck writing when the shutdown cancels it and its leg closes only at
// the write timeout, long after Shutdown returned: no abort may start then.
func TestNoAbortOutlivesShutdown(t *testing.T) {
	var shutDown, late atomic.Int32
	worker := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/abort_request" {
			if shutDown.Load() == 1 {
				late.Add(1)
			}
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		event := "data: {\"text\":\"" + strings.Repeat("x", 64<<10) + "\"}\n\n"
		for range 256 { // 16 MiB: more than the sockets between hold
			if _, err := io.WriteString(w, event); err != nil {
				return
			}
		}
		<-r.Context().Done()
	})
	cfg := legRegularConfig(worker)
	cfg.RequestTimeout = 2 * time.Second // the client's write times out at 4 s
	cfg.AbortTimeout = 300 * time.Millisecond
	base, srv := serveInProcess(t, cfg)
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	body := `{"text":"x","stream":true}`
	io.WriteString(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: 26\r\n\r\n"+body)
	if _, err := http.ReadResponse(bufio.NewReader(c), nil); err != nil { // the head, then no more reading
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	srv.Shutdown(ctx) //nolint:errcheck // the stream is still open
	shutDown.Store(1)
	time.Sleep(4 * time.Second) // past the write timeout
	if late.Load() > 0 {
		t.Fatalf("%d engine aborts started after Shutdown returned", late.Load())
	}
}
