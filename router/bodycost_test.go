package router

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"
)

// Issue 26 item 9: a Content-Length over the limit is refused before the
// client sends the body: no 100 Continue first.
func TestExpectContinueRefusedByContentLength(t *testing.T) {
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, `{}`) }))
	defer d.Close()
	cfg := DefaultConfig()
	cfg.WorkerURLs = []string{d.URL}
	cfg.MaxPayloadSize = 1 << 20
	base, srv := serveInProcess(t, cfg)
	defer shutdown(t, srv)
	conn, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n", 2<<20)
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	reply, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 413 || !strings.Contains(string(reply), `"code":"payload_too_large"`) {
		t.Fatalf("status %d: %s", resp.StatusCode, reply)
	}
}
