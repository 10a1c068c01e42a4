package router

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// rawChunk frames payload as one HTTP chunk.
func rawChunk(payload string) string {
	return strconv.FormatInt(int64(len(payload)), 16) + "\r\n" + payload + "\r\n"
}

// streamClient sends a streamed /generate to base on a connection of its
// own and returns a reader at the start of the response body.
func streamClient(t *testing.T, base string) (net.Conn, *bufio.Reader) {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	body := `{"text":"x","stream":true}`
	fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	br := bufio.NewReader(c)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != 200 || len(resp.TransferEncoding) == 0 || resp.TransferEncoding[0] != "chunked" {
		t.Fatalf("status %d, transfer encoding %v", resp.StatusCode, resp.TransferEncoding)
	}
	return c, br
}

// readRawChunk reads one HTTP chunk of the router's reply as framed.
func readRawChunk(t *testing.T, c net.Conn, br *bufio.Reader, within time.Duration) string {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(within))
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("chunk size line: %v", err)
	}
	size, err := strconv.ParseInt(strings.TrimSpace(line), 16, 32)
	if err != nil {
		t.Fatalf("chunk size line %q: %v", line, err)
	}
	b := make([]byte, size+2)
	if _, err := io.ReadFull(br, b); err != nil {
		t.Fatalf("chunk of %d bytes: %v", size, err)
	}
	return string(b[:size])
}

// twoWriteWorker is a worker that answers a stream in two writes of its
// raw chunked body: the head and first, then rest once release is closed.
func twoWriteWorker(t *testing.T, first, rest string) (url string, release chan struct{}) {
	release = make(chan struct{})
	url = legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		c, buf, err := w.(http.Hijacker).Hijack()
		if err != nil {
			panic(err)
		}
		defer c.Close()
		buf.WriteString("HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + first)
		buf.Flush()
		select {
		case <-release:
		case <-time.After(10 * time.Second): // the test failed before releasing it
			return
		}
		buf.WriteString(rest)
		buf.Flush()
	})
	return url, release
}

// readRest reads the router's chunks up to the last one and returns their
// bytes.
func readRest(t *testing.T, c net.Conn, br *bufio.Reader) string {
	t.Helper()
	var rest strings.Builder
	for {
		ch := readRawChunk(t, c, br, 5*time.Second)
		if ch == "" {
			return rest.String()
		}
		rest.WriteString(ch)
	}
}

// The events a worker's connection holds together reach the client as one
// chunk, but a chunk still arriving is not waited for: what came before it
// goes out at once.
func TestStreamRelaysWhatHasArrivedInOneChunk(t *testing.T) {
	events := []string{"data: {\"text\":\"a\"}\n\n", "data: {\"text\":\"ab\"}\n\n", "data: {\"text\":\"abc\"}\n\n"}
	last := rawChunk("data: {\"text\":\"abcd\"}\n\n")
	done := "data: [DONE]\n\n"
	// The first write ends inside the fourth event's data.
	worker, release := twoWriteWorker(t, rawChunk(events[0])+rawChunk(events[1])+rawChunk(events[2])+last[:8],
		last[8:]+rawChunk(done)+"0\r\n\r\n")
	e := startLegEnv(t, legRegularConfig(worker))
	c, br := streamClient(t, e.base)
	// Released only once the first chunk is in: a relay that waited for
	// the fourth event would time out here.
	first := readRawChunk(t, c, br, 5*time.Second)
	close(release)
	if want := strings.Join(events, ""); first != want {
		t.Fatalf("first chunk %q, want the three events that had arrived, %q", first, want)
	}
	if rest, want := readRest(t, c, br), "data: {\"text\":\"abcd\"}\n\n"+done; rest != want {
		t.Fatalf("rest of the stream %q, want %q", rest, want)
	}
	e.settle(t)
}

// A chunk cut inside its size line is not waited for either, and a chunk
// larger than the relay's buffer is relayed whole across reads.
func TestStreamRelaysAroundACutSizeLine(t *testing.T) {
	big := "data: {\"text\":\"" + strings.Repeat("x", 40<<10) + "\"}\n\n"
	framed := rawChunk(big)
	worker, release := twoWriteWorker(t, rawChunk("data: 1\n\n")+framed[:2], framed[2:]+"0\r\n\r\n")
	e := startLegEnv(t, legRegularConfig(worker))
	c, br := streamClient(t, e.base)
	if first := readRawChunk(t, c, br, 5*time.Second); first != "data: 1\n\n" {
		t.Fatalf("first chunk %q", first)
	}
	close(release)
	if rest := readRest(t, c, br); rest != big {
		t.Fatalf("rest of the stream: %d bytes, want the %d-byte event", len(rest), len(big))
	}
	e.settle(t)
}

// A stream waiting for its first event holds no relay buffer: N PD streams
// whose decode worker has sent only its reply head cost about 31 KiB each
// in this process, the in-process workers' share included, and 62 KiB when
// each held the 32 KiB buffer of the relay's first read.
func TestStreamWaitingForItsFirstEventHoldsNoBuffer(t *testing.T) {
	if perStream := heapPerWaitingStream(t, ""); perStream > 48<<10 {
		t.Fatalf("%d KiB of heap per stream waiting for its first event, want about 31 (no 32 KiB relay buffer among it)", perStream>>10)
	}
}

// Nor does a stream between two events: its chunks are framed in pooled
// buffers, not in a copy buffer or connection writer of its own (21-30 KiB
// per stream here, 38-42 through a copy buffer).
func TestStreamBetweenEventsHoldsNoBuffer(t *testing.T) {
	// The lesser of two runs: a process's first one also pays for pools
	// filling up (21-25 KiB per stream after it, up to 30 in it).
	first := "data: {\"text\":\"a\"}\n\n"
	if perStream := min(heapPerWaitingStream(t, first), heapPerWaitingStream(t, first)); perStream > 33<<10 {
		t.Fatalf("%d KiB of heap per stream between events, want about 24 (38-42 with a copy buffer per stream)", perStream>>10)
	}
}

// heapPerWaitingStream opens PD streams whose decode worker sends its head
// and first, then waits, and returns the heap each costs meanwhile.
func heapPerWaitingStream(t *testing.T, first string) int64 {
	const streams = 200
	var arrived atomic.Int32
	var release atomic.Pointer[chan struct{}]
	open := make(chan struct{})
	close(open)
	release.Store(&open)
	worker := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		io.WriteString(w, first)
		w.(http.Flusher).Flush()
		arrived.Add(1)
		select {
		case <-*release.Load():
		case <-r.Context().Done():
		}
		io.WriteString(w, "data: [DONE]\n\n")
	})
	// PD mode, whose client connections keep no read buffer while they
	// stream (ReduceMemoryUsage).
	e := startLegEnv(t, legPDConfig(legWorker(t, answer(200)), worker))
	c, br := streamClient(t, e.base) // one stream first, so that pools are warm
	readRest(t, c, br)
	held := make(chan struct{})
	release.Store(&held)
	defer close(held)
	arrived.Store(0)
	before := heapInUse()
	for range streams {
		c, err := net.Dial("tcp", strings.TrimPrefix(e.base, "http://"))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		body := `{"text":"x","stream":true}`
		fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	}
	waitFor(t, func() bool { return arrived.Load() == streams })
	time.Sleep(50 * time.Millisecond) // for the first events to be relayed
	return (heapInUse() - before) / streams
}

// heapInUse is the heap in use once pooled buffers are freed too (a GC
// moves a sync.Pool's contents to its victim cache, the next frees them).
func heapInUse() int64 {
	runtime.GC()
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapInuse)
}

// Issue 26 item 9: a stream with no HTTP framing that the worker ends by
// closing its connection before [DONE] reached the client as a clean end.
// The client now gets an SSE error event instead.
func TestUnframedStreamClosedEarlyIsAnError(t *testing.T) {
	e := startLegEnv(t, legRegularConfig(legWorker(t, sseUnframed)))
	status, body, err := e.post(t, t.Context(), `{"text":"x","stream":true}`)
	if err != nil || status != 200 || !strings.Contains(body, `data: {"text":"a"}`) || !strings.Contains(body, `"code":"regular_stream_error"`) {
		t.Fatalf("status %d err %v: %q; want the event, then an SSE error", status, err, body)
	}
}

// Issue 26 item 9: a stream still open when the shutdown grace period ends
// got an SSE error blaming the worker ("Upstream stream ended early:
// context canceled"); it now says the router is shutting down.
func TestStreamCutByShutdownSaysSo(t *testing.T) {
	cfg := legRegularConfig(legWorker(t, sseThenHang))
	cfg.Policy = "round_robin"
	cfg.Manager.Health.Disabled = true
	srv, err := New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	base := serveOnLoopback(t, srv)
	waitFor(t, srv.manager.Ready)
	resp, err := http.Post(base+"/generate", "application/json", strings.NewReader(`{"text":"x","stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	if _, err := br.ReadString('\n'); err != nil { // the first event
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	srv.Shutdown(ctx) //nolint:errcheck // the grace period ends with the stream open
	rest, _ := io.ReadAll(br)
	if !strings.Contains(string(rest), `"code":"server_shutting_down"`) || strings.Contains(string(rest), "stream_error") {
		t.Fatalf("stream ended with %q; want an SSE error naming the shutdown", rest)
	}
}

// Issue 26: the stream idle timeout did not cover the wait for the first
// event, so a worker that sent its stream's head and then nothing held the
// request until the request timeout. It now ends it at the idle timeout.
func TestStreamIdleTimeoutCoversTheFirstEvent(t *testing.T) {
	headOnly := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200)
		w.(http.Flusher).Flush()
		<-r.Context().Done()
	}
	cfg := legRegularConfig(legWorker(t, headOnly))
	cfg.StreamIdleTimeout = 200 * time.Millisecond
	e := startLegEnv(t, cfg)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	status, body, err := e.post(t, ctx, `{"text":"x","stream":true}`)
	if err != nil || status != 504 || !strings.Contains(body, `"code":"stream_idle_timeout"`) {
		t.Fatalf("status %d err %v: %q; want a 504 stream_idle_timeout", status, err, body)
	}
}
