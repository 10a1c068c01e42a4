package router

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/pdrouter/pdrouter/mock/mockworker"
	"github.com/pdrouter/pdrouter/router/splice"
)

// openStream sends a streamed /generate on a raw connection to the router
// at base and returns once its first event has arrived: the stream is
// then open and waiting for its next token. The test holds no goroutine
// per stream.
func openStream(t *testing.T, base string, tokens int) net.Conn {
	t.Helper()
	c := sendStream(t, base, tokens)
	awaitFirstEvent(t, c)
	return c
}

// sendStream sends a streamed /generate of tokens tokens to the router at
// base, on a connection of its own.
func sendStream(t *testing.T, base string, tokens int) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", strings.TrimPrefix(base, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	body := fmt.Sprintf(`{"text":"a b c","stream":true,"sampling_params":{"max_new_tokens":%d}}`, tokens)
	fmt.Fprintf(c, "POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	return c
}

// awaitFirstEvent reads c up to its stream's first event.
func awaitFirstEvent(t *testing.T, c net.Conn) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	br := bufio.NewReader(c)
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("before the first event: %v", err)
		}
		if strings.HasPrefix(line, "data: ") {
			return
		}
	}
}

// routerGoroutines counts the goroutines that are not the in-process
// engine's (its connections' and handlers').
func routerGoroutines() int {
	buf := make([]byte, 64<<20)
	buf = buf[:runtime.Stack(buf, true)]
	n := 0
	for _, g := range strings.Split(string(buf), "\n\n") {
		if !strings.Contains(g, "mock/mockworker.") && !strings.Contains(g, "net/http.(*http2serverConn)") &&
			!strings.Contains(g, "net/http.(*conn).serve") && !idleFasthttpWorker(g) {
			n++
		}
	}
	return n
}

// idleFasthttpWorker tells a goroutine of fasthttp's worker pool waiting
// for its next connection (kept up to MaxIdleWorkerDuration): it serves
// no stream, and how many there are depends on how many connections
// arrived at once, more on a loaded box.
func idleFasthttpWorker(stack string) bool {
	_, frames, _ := strings.Cut(stack, "\n")
	return strings.HasPrefix(frames, "github.com/valyala/fasthttp.(*workerPool).workerFunc(")
}

// h2cStreamsOpen is what the router's h2c connections count as open.
func h2cStreamsOpen(srv *Server) (active, streams int) {
	h := srv.upstream.h2c
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, p := range h.pools {
		for _, c := range p.conns {
			c.mu.Lock()
			active += c.active
			streams += len(c.streams)
			c.mu.Unlock()
		}
	}
	return active, streams
}

// h2cClientHeap is the heap in use that the h2c client allocated (by the
// last garbage collections' memory profile).
func h2cClientHeap() int64 {
	return heapWhere(true, func(f string) bool {
		return strings.Contains(f, "pdrouter/router.(*h2c") || strings.Contains(f, "pdrouter/router.(*upstream).postH2C")
	})
}

func h2cIdle(srv *Server) bool { a, s := h2cStreamsOpen(srv); return a == 0 && s == 0 }

// An open PD stream waiting for its next token holds no router goroutine
// (one, its relay's, on the old code), and the h2c client holds about 1.2 KiB of
// heap for it: no goroutine, pipe or net/http request per stream (net/http's
// transport kept a goroutine per stream beside the router's). 1.6 KiB while
// the head was a whole fasthttp.Response and the reply not in its leg.
func TestH2COpenStreamCost(t *testing.T) {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.MemProfileRate = 1
	// Tokens far apart: the streams stay open however slowly they open.
	base, srv, _, d := h2cPD(t, mockworker.Config{}, mockworker.Config{TokenDelay: time.Minute})
	if _, err := streamTokens(context.Background(), base, 1); err != nil { // the connections are up
		t.Fatal(err)
	}
	waitFor(t, func() bool { a, _ := h2cStreamsOpen(srv); return a == 0 })
	const streams = 200
	heap := h2cClientHeap()
	goroutines := routerGoroutines()
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = openStream(t, base, 3)
	}
	perStream := float64(routerGoroutines()-goroutines) / streams
	kib := float64(h2cClientHeap()-heap) / streams / 1024
	t.Logf("per open stream: %.2f router goroutines, %.2f KiB of h2c client heap", perStream, kib)
	if perStream > 0.1 {
		t.Errorf("%.2f router goroutines per open stream, want none", perStream)
	}
	if kib > 1.5 {
		t.Errorf("the h2c client holds %.2f KiB per open stream, want at most 1.5", kib)
	}
	if active, open := h2cStreamsOpen(srv); active != streams || open != streams {
		t.Errorf("h2c counts %d active, %d open streams; want %d", active, open, streams)
	}
	// The engine going away ends every stream, and nothing stays
	// (TestH2CStreamsLeaveNothingBehind: clients going away).
	d.Close()
	for _, c := range conns {
		c.Close()
	}
	waitFor(t, func() bool { return h2cIdle(srv) })
}

// Streams that complete, are cancelled by their client, or outlive the
// idle timeout leave no stream, slot or goroutine behind, and shutdown
// closes the connections they ran on.
func TestH2CStreamsLeaveNothingBehind(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { // the last cleanup: after the router's and the engines'
		goleak.VerifyNone(t,
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.updateServerDate.func1"),
			goleak.IgnoreAnyFunction("github.com/valyala/fasthttp.(*workerPool).Start.func2"),
			ignore)
	})
	base, srv, _, d := h2cPD(t, mockworker.Config{}, mockworker.Config{TokenDelay: 20 * time.Millisecond})
	for range 10 {
		if events, err := streamTokens(context.Background(), base, 3); err != nil || len(events) != 4 {
			t.Fatalf("%d events, %v", len(events), err)
		}
	}
	var gone []net.Conn
	for range 10 {
		gone = append(gone, openStream(t, base, 1000))
	}
	for _, c := range gone {
		c.Close()
	}
	waitFor(t, func() bool { return d.Stats().ClientGone == 10 })
	waitFor(t, func() bool { a, s := h2cStreamsOpen(srv); return a == 0 && s == 0 })
	srv.Shutdown(context.Background())
	// Shut down, the client dials nothing more.
	if _, c, err := srv.upstream.h2c.reserve("127.0.0.1:1"); c != nil || err == nil {
		t.Errorf("a closed h2c client reserved a stream (%v)", err)
	}
}

// fakeH2CEngine serves h2c by hand: answer gets each request's stream on
// the connection-th connection accepted (from 0) and writes what it
// likes. It returns the engine's address and a count of connections.
func fakeH2CEngine(t *testing.T, answer func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, conn int, stream uint32)) (string, *atomic.Int32) {
	t.Helper()
	return fakeH2CEngineSeeing(t, nil, answer)
}

// fakeH2CEngineSeeing is fakeH2CEngine that also shows see (if not nil)
// each request's header fields as its HPACK decoder read them.
func fakeH2CEngineSeeing(t *testing.T, see func([]hpack.HeaderField), answer func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, conn int, stream uint32)) (string, *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	var accepted atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			n := int(accepted.Add(1)) - 1
			go func() {
				defer c.Close()
				preface := make([]byte, len(http2.ClientPreface))
				if _, err := io.ReadFull(c, preface); err != nil {
					return
				}
				var buf bytes.Buffer
				fr := http2.NewFramer(c, c)
				fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
				enc := hpack.NewEncoder(&buf)
				fr.WriteSettings()
				for {
					f, err := fr.ReadFrame()
					if err != nil {
						return
					}
					switch f := f.(type) {
					case *http2.SettingsFrame:
						if !f.IsAck() {
							fr.WriteSettingsAck()
						}
					case *http2.MetaHeadersFrame:
						if see != nil {
							see(f.Fields)
						}
					case *http2.DataFrame:
						if f.StreamEnded() {
							answer(fr, enc, &buf, n, f.StreamID)
						}
					}
				}
			}()
		}
	}()
	return ln.Addr().String(), &accepted
}

// A stream the engine never processed (GOAWAY below its id, or
// REFUSED_STREAM) is sent again, once, on a connection that takes it; the
// refusing connection takes no new streams.
func TestH2CUnprocessedStreamIsSentAgain(t *testing.T) {
	for _, refuse := range []string{"goaway", "refused_stream"} {
		t.Run(refuse, func(t *testing.T) {
			addr, accepted := fakeH2CEngine(t, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, conn int, stream uint32) {
				if conn == 0 && stream == 1 {
					if refuse == "goaway" {
						fr.WriteGoAway(0, http2.ErrCodeNo, nil)
					} else {
						fr.WriteRSTStream(stream, http2.ErrCodeRefusedStream)
					}
					return
				}
				buf.Reset()
				enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
				enc.WriteField(hpack.HeaderField{Name: "content-type", Value: "text/event-stream"})
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: buf.Bytes(), EndHeaders: true})
				fr.WriteData(stream, true, []byte("data: [DONE]\n\n"))
			})
			u := newUpstream(time.Minute)
			defer u.close()
			var sc scope
			var body splice.Body
			body.Reset([]byte(`{"text":"x"}`))
			resp, err := u.postH2C(&sc, "http://"+addr, "/generate", &body, nil, nil, nil)
			if err != nil {
				t.Fatal(err)
			}
			b, err := io.ReadAll(resp)
			resp.Close()
			if err != nil || string(b) != "data: [DONE]\n\n" || resp.StatusCode != 200 {
				t.Fatalf("status %d, body %q, %v", resp.StatusCode, b, err)
			}
			want := int32(1) // a refused stream leaves its connection up
			if refuse == "goaway" {
				want = 2
			}
			if n := accepted.Load(); n != want {
				t.Errorf("%d connections accepted, want %d", n, want)
			}
		})
	}
}

// A prefill leg waiting for its reply's body over h2c holds no copy buffer:
// its goroutine waits for the stream holding nothing, and scans each piece
// where it arrived (a 32 KiB buffer per waiting prefill before: 19 MB of
// them at 10,000 streams' ramp, bench/RESULTS.md). The transfer time the
// reply reports is still found, across pieces.
func TestH2CPrefillDrainHoldsNoBuffer(t *testing.T) {
	const legs = 64
	reply := []byte(`{"text":"x","meta_info":{"kv_transfer":{"bytes":4096,"transfer_ms":12.5}}}`)
	headed := make(chan uint32, legs)
	release := make(chan struct{})
	addr, _ := fakeH2CEngine(t, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, _ int, stream uint32) {
		buf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: buf.Bytes(), EndHeaders: true})
		headed <- stream
		if len(headed) < legs {
			return
		}
		<-release // every head is out: the bodies follow, in two pieces each
		for range legs {
			id := <-headed
			fr.WriteData(id, false, reply[:30])
			fr.WriteData(id, true, reply[30:])
		}
	})
	u := newUpstream(time.Minute)
	defer u.close()
	var body splice.Body
	body.Reset([]byte(`{"text":"x"}`))
	attempts := make([]*attempt, legs)
	replies := make([]*upstreamResponse, legs)
	for i := range attempts {
		attempts[i] = &attempt{r: &request{}}
		attempts[i].r.rec.startPD()
		resp, err := u.postH2C(&attempts[i].scope, "http://"+addr, "/generate", &body, nil, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		replies[i] = resp
	}
	runtime.GC()
	runtime.GC() // pooled buffers from earlier tests are gone
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	errs := make(chan error, legs)
	for i := range attempts {
		go func() { errs <- attempts[i].drainPrefill(replies[i]) }()
	}
	waitFor(t, func() bool { return strings.Count(allStacks(), "drainPrefill") == legs })
	runtime.GC()
	var waiting runtime.MemStats
	runtime.ReadMemStats(&waiting)
	held := (int64(waiting.HeapAlloc) - int64(before.HeapAlloc)) / legs
	close(release)
	for range legs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d bytes of heap per waiting prefill drain", held)
	if held > 2<<10 {
		t.Errorf("a prefill drain waiting for its reply holds %d bytes of heap, want at most 2 KiB (no copy buffer)", held)
	}
	for i, a := range attempts {
		if got := a.r.rec.pd[0].kvTransfer; got != 0.0125 {
			t.Errorf("drain %d: KV transfer time %v s, want 0.0125", i, got)
		}
		replies[i].Close()
	}
}

// allStacks is every goroutine's stack.
func allStacks() string {
	buf := make([]byte, 16<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

// The values that are each request's own (its id, its length) go to the
// engine as literals never indexed, the recurring ones indexed: indexing
// every request's id took a place in the HPACK table and evicted the
// oldest on every request, the deepest call of a stream's goroutine
// (TestOpenStreamStackIs4KiB).
func TestH2COwnValuesAreNotIndexed(t *testing.T) {
	seen := make(chan []hpack.HeaderField, 8)
	addr, _ := fakeH2CEngineSeeing(t, func(f []hpack.HeaderField) { seen <- f }, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, _ int, stream uint32) {
		buf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: buf.Bytes(), EndHeaders: true})
		fr.WriteData(stream, true, []byte("{}"))
	})
	u := newUpstream(time.Minute)
	defer u.close()
	var body splice.Body
	body.Reset([]byte(`{"text":"x"}`))
	for i := range 3 {
		var sc scope
		resp, err := u.postH2C(&sc, "http://"+addr, "/generate", &body, []byte(fmt.Sprintf("X-Request-Id: req-%d\r\n", i)), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		resp.Close()
		for _, f := range <-seen {
			own := f.Name == "x-request-id" || f.Name == "content-length"
			if f.Sensitive != own {
				t.Errorf("request %d: %s: %q never indexed: %v, want %v", i, f.Name, f.Value, f.Sensitive, own)
			}
		}
	}
}

// An open PD stream waiting for its next token holds no fasthttp
// RequestCtx: once its head and first event are out, fasthttp has it back
// (request.detach). It held one per stream, with its request's and
// response's buffers, about 3.5 KiB each.
func TestOpenStreamHoldsNoRequestCtx(t *testing.T) {
	held := heldPerOpenStream(t, func() []int64 { return []int64{heapFrom("fasthttp.(*Server).acquireCtx")} })[0]
	t.Logf("%.0f bytes of fasthttp RequestCtx per open stream", held)
	if held > 256 {
		t.Errorf("an open stream holds %.0f bytes of fasthttp RequestCtx, want none", held)
	}
}

// heldPerOpenStream is what heap (a reading per allocation site) grows by
// per open PD stream, over 100 h2c streams that have their first event and
// wait a minute for the next, the first token after prefill's leg has
// surely written its body (a stream whose leg is still writing keeps its
// ctx until it ends).
func heldPerOpenStream(t *testing.T, heap func() []int64) []float64 {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.MemProfileRate = 1
	base, _, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{PrefillDelay: 500 * time.Millisecond, TokenDelay: time.Minute})
	if _, err := streamTokens(context.Background(), base, 1); err != nil {
		t.Fatal(err)
	}
	const streams = 100
	before := heap()
	conns := make([]net.Conn, streams)
	for i := range conns {
		conns[i] = sendStream(t, base, 3)
	}
	for _, c := range conns {
		awaitFirstEvent(t, c)
	}
	held := make([]float64, len(before))
	for i, after := range heap() {
		held[i] = float64(after-before[i]) / streams
	}
	for _, c := range conns {
		c.Close()
	}
	return held
}

// An open PD stream keeps its request, its attempt and its h2c reply's
// stream (the h2c client's, TestH2COpenStreamCost) live until it ends, so
// each byte of them counts 10,000 times at 10,000 streams, twice at the
// peak (the collector's goal). request carried a regular-mode attempt's
// body (1,792 bytes, now 1,280), attempt padding and a pointer it had
// twice (1,280 -> 1,152), and each head was a whole fasthttp.Response (576
// bytes, then its 384-byte header): 4,630-4,790 -> 3,560-3,650 bytes per
// open stream. Both replies' heads and the fields the reader filled them
// with (onHeaders) stayed to the stream's end too, ~1 KB; they go back to
// the pool once read (packHead, releaseHead). The legs' HTTP/1.1 calls,
// unused by h2c and done once the head is in, are pooled (upCalls):
// 1,280 -> 1,152 and 1,152 -> 1,024. 3,880-4,210 -> 2,480-2,640 bytes.
func TestOpenStreamRouterHeap(t *testing.T) {
	sites := []string{"router.(*Server).newRequest", "router.(*Server).newAttempt", "router.(*upstream).postH2C", "router.(*h2cConn).onHeaders"}
	held := heldPerOpenStream(t, func() []int64 {
		in := make([]int64, len(sites))
		for i, site := range sites {
			in[i] = heapUnder(site)
		}
		return in
	})
	t.Logf("per open stream: request %.0f, attempt %.0f, h2c reply %.0f, reply head fields %.0f bytes", held[0], held[1], held[2], held[3])
	// A little over each size class: other goroutines allocate under the
	// same functions meanwhile. The h2c replies' share varies with whether
	// prefill's reply is still open.
	for i, most := range []float64{1152 + 64, 1024 + 64} {
		if held[i] > most {
			t.Errorf("an open stream holds %.0f bytes from %s, want at most %.0f", held[i], sites[i], most)
		}
	}
	if held[3] > 64 {
		t.Errorf("an open stream holds %.0f bytes of its reply head's fields, want none (given back once copied)", held[3])
	}
	if total := held[0] + held[1] + held[2] + held[3]; total > 2816 {
		t.Errorf("an open stream holds %.0f bytes of request, attempt and h2c replies, want at most 2816", total)
	}
}

// heapFrom is the heap in use that function allocated (by the last
// collections' memory profile), pools emptied.
func heapFrom(function string) int64 { return heapWhere(false, suffix(function)) }

// heapUnder is the heap in use allocated while function was on the stack
// (pools emptied): what it and its callees allocated.
func heapUnder(function string) int64 { return heapWhere(true, suffix(function)) }

func suffix(function string) func(string) bool {
	return func(f string) bool { return strings.HasSuffix(f, function) }
}

// heapWhere sums the heap in use whose allocating function (under: or any
// caller of it) matches.
func heapWhere(under bool, match func(string) bool) int64 {
	for range 4 { // a pool drops what it holds in two cycles, the profile is two more behind
		runtime.GC()
	}
	var records []runtime.MemProfileRecord
	n, _ := runtime.MemProfile(nil, true)
	for {
		records = make([]runtime.MemProfileRecord, n+64)
		var ok bool
		if n, ok = runtime.MemProfile(records, true); ok {
			records = records[:n]
			break
		}
	}
	var bytes int64
	for _, r := range records {
		frames := runtime.CallersFrames(r.Stack())
		for {
			f, more := frames.Next()
			if strings.HasPrefix(f.Function, "runtime.") && more {
				continue
			}
			if match(f.Function) {
				bytes += r.InUseBytes()
				break
			}
			if !under || !more {
				break
			}
		}
	}
	return bytes
}

// A stream cancelled before its HEADERS went out leaves the connection's
// HPACK state as the worker's: its fields were encoded (and the encoder's
// table grown) only once they would be sent, so the next request on the
// connection decodes. Encoded first, the worker's decoder met indices it
// never had and closed the connection (COMPRESSION_ERROR).
func TestH2CStreamCancelledBeforeItsHeadersKeepsHPACKInStep(t *testing.T) {
	addr, accepted := fakeH2CEngine(t, func(fr *http2.Framer, enc *hpack.Encoder, buf *bytes.Buffer, _ int, stream uint32) {
		buf.Reset()
		enc.WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
		fr.WriteHeaders(http2.HeadersFrameParam{StreamID: stream, BlockFragment: buf.Bytes(), EndHeaders: true})
		fr.WriteData(stream, true, []byte("{}"))
	})
	u := newUpstream(time.Minute)
	defer u.close()
	var body splice.Body
	body.Reset([]byte(`{"text":"x"}`))
	var guard writeGuard
	guard.writing.Lock() // the first request waits to send, its stream reserved
	var first scope
	sent := make(chan error, 1)
	go func() {
		_, err := u.postH2C(&first, "http://"+addr, "/generate", &body, nil, &guard, nil)
		sent <- err
	}()
	waitFor(t, func() bool { a, _ := h2cStreamsOpen(&Server{upstream: u}); return a == 1 })
	first.cancel(errClientGone)
	guard.writing.Unlock()
	if err := <-sent; err == nil {
		t.Fatal("a request cancelled before its send was sent")
	}
	var second scope
	resp, err := u.postH2C(&second, "http://"+addr, "/generate", &body, nil, nil, nil)
	if err != nil {
		t.Fatalf("the next request on the connection: %v", err)
	}
	b, err := io.ReadAll(resp)
	resp.Close()
	if err != nil || string(b) != "{}" {
		t.Fatalf("the next request's reply: %q, %v", b, err)
	}
	if n := accepted.Load(); n != 1 {
		t.Errorf("%d connections, want the one", n)
	}
}

// A PD stream waiting for its first token holds no reply head: its fields
// for the client are packed (packHead) and the head goes back to the pool
// for the streams still arriving. The head and the fields its reader
// filled it with (onHeaders) were held through the wait, ~0.9 KB a
// stream, at the plateau of 10,000 streams waiting together.
func TestWaitingStreamHoldsNoReplyHead(t *testing.T) {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.MemProfileRate = 1
	base, srv, _, _ := h2cPD(t, mockworker.Config{}, mockworker.Config{PrefillDelay: time.Minute})
	sites := []string{"router.(*upstream).postH2C", "router.(*h2cConn).onHeaders"}
	heap := func() []int64 { return []int64{heapUnder(sites[0]), heapUnder(sites[1])} }
	waiting := func(n int) func() bool {
		return func() bool { return parkedStreams(srv) >= n }
	}
	const streams = 100
	conns := make([]net.Conn, streams+1)
	defer func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
	}()
	conns[0] = sendStream(t, base, 3) // the engines' connections up
	waitFor(t, waiting(1))
	before := heap()
	for i := 1; i < len(conns); i++ {
		conns[i] = sendStream(t, base, 3)
	}
	waitFor(t, waiting(streams+1))
	after := heap()
	reply := float64(after[0]-before[0]) / streams
	fields := float64(after[1]-before[1]) / streams
	t.Logf("per waiting stream: h2c replies %.0f, reply head fields %.0f bytes", reply, fields)
	if fields > 64 {
		t.Errorf("a stream waiting for its first token holds %.0f bytes of its reply head's fields, want none (packed, the head pooled)", fields)
	}
	if reply > 512 {
		t.Errorf("a stream waiting for its first token holds %.0f bytes of h2c replies, want at most 512 (its stream, no head)", reply)
	}
}
