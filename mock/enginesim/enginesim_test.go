package enginesim

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/sidecar"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// proxy runs a kvproxy in process.
func proxy(t *testing.T, role string) *sidecar.Sidecar {
	t.Helper()
	s, err := sidecar.Start(sidecar.Config{Role: role, Transport: "tcp", Host: "127.0.0.1",
		Control: filepath.Join(t.TempDir(), role+".sock"), Heartbeat: time.Second, WaitingTimeout: 500 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func opts(sock string) Options {
	return Options{Control: sock, Layers: 2, BuffersPerLay: 2, BytesPerToken: 64, PageSize: 16,
		PoolTokens: 1024, ChunkTokens: 64, AuxSlots: 8, QueueTimeout: 200 * time.Millisecond}
}

// sims is a prefill and a decode Sim on their kvproxies.
type sims struct {
	p, d   *Sim
	pe, de *rooms.Rooms
	boot   *net.TCPAddr // the prefill kvproxy's bootstrap API
}

func pair(t *testing.T) *sims {
	ps, ds := proxy(t, "prefill"), proxy(t, "decode")
	c := connect(t, ps, ds)
	c.pe, c.de = ps.Rooms(), ds.Rooms()
	return c
}

// connect starts a mock engine on each kvproxy, closed at the test's end.
func connect(t *testing.T, ps, ds *sidecar.Sidecar) *sims {
	c := &sims{}
	var err error
	if c.p, err = New(context.Background(), opts(ps.Addrs().Control)); err != nil {
		t.Fatal(err)
	}
	if c.d, err = New(context.Background(), opts(ds.Addrs().Control)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.p.Close(); c.d.Close() })
	if c.boot, err = net.ResolveTCPAddr("tcp", ps.Addrs().Bootstrap); err != nil {
		t.Fatal(err)
	}
	return c
}

func (c *sims) req(room uint64, prompt string, tokens int) mockworker.KVRequest {
	return mockworker.KVRequest{Room: room, BootstrapHost: c.boot.IP.String(), BootstrapPort: c.boot.Port, Prompt: []byte(prompt), PromptTokens: tokens}
}

func run(p, d *Sim, pr, dr mockworker.KVRequest) (pres, dres *mockworker.KVResult, perr, derr error) {
	return runCtx(context.Background(), p, d, pr, dr)
}

func runCtx(ctx context.Context, p, d *Sim, pr, dr mockworker.KVRequest) (pres, dres *mockworker.KVResult, perr, derr error) {
	var wg sync.WaitGroup
	wg.Go(func() { pres, perr = p.Prefill(ctx, pr) })
	wg.Go(func() { dres, derr = d.Decode(ctx, dr) })
	wg.Wait()
	return
}

func TestPrefillToDecodeVerified(t *testing.T) {
	c := pair(t)
	p, d := c.p, c.d
	for i, tokens := range []int{0, 1, 16, 17, 300, 1024} {
		r := c.req(uint64(1000+i), strings.Repeat("x", i+1), tokens)
		pres, dres, perr, derr := run(p, d, r, r)
		if perr != nil || derr != nil {
			t.Fatalf("%d tokens: prefill %v decode %v", tokens, perr, derr)
		}
		pages := int64((tokens + 15) / 16)
		wantBytes := pages*4*16*64 + auxItem
		if !dres.ChecksumOK || dres.Pages != pages || dres.Bytes != wantBytes || dres.Transport != "tcp" || pres.Bytes != wantBytes {
			t.Fatalf("%d tokens: decode %+v prefill %+v, want %d pages %d bytes", tokens, dres, pres, pages, wantBytes)
		}
	}
	if p.FreePages() != 64 || d.FreePages() != 64 {
		t.Fatalf("pages leaked: prefill %d decode %d free of 64", p.FreePages(), d.FreePages())
	}
}

func TestMismatchIsAnError(t *testing.T) {
	c := pair(t)
	// The decode side derives other bytes from another prompt: the check must catch it.
	_, _, perr, derr := run(c.p, c.d, c.req(5, "hello", 40), c.req(5, "hellO", 40))
	if perr != nil || derr == nil || !strings.Contains(derr.Error(), "checksum mismatch") {
		t.Fatalf("prefill %v decode %v", perr, derr)
	}
}

func TestPoolExhaustionQueuesThen503(t *testing.T) {
	c := pair(t)
	d, de := c.d, c.de
	// Hold the whole decode pool with a room whose prefill never comes.
	held := make(chan error, 1)
	go func() { _, err := d.Decode(context.Background(), c.req(1, "a", 1024)); held <- err }()
	for de.ActiveRooms() == 0 {
		time.Sleep(time.Millisecond)
	}
	_, err := d.Decode(context.Background(), c.req(2, "b", 16))
	var hs interface{ HTTPStatus() int }
	if !errors.Is(err, ErrPoolExhausted) || !errors.As(err, &hs) || hs.HTTPStatus() != 503 {
		t.Fatalf("second decode: %v", err)
	}
	if err := <-held; err == nil || !strings.Contains(err.Error(), "waiting timeout") {
		t.Fatalf("held room: %v", err)
	}
}

func TestClientGoneAbortsBothRooms(t *testing.T) {
	c := pair(t)
	d, pe, de := c.d, c.pe, c.de
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { _, err := d.Decode(ctx, c.req(9, "z", 64)); errc <- err }()
	for pe.ActiveRooms() == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-errc; !errors.Is(err, context.Canceled) {
		t.Fatalf("decode: %v", err)
	}
	st, err := pe.Poll(9)
	for ; err == nil && !st.State.Terminal(); st, err = pe.Poll(9) {
		time.Sleep(time.Millisecond)
	}
	if err != nil || !strings.Contains(st.Reason, "client disconnected") || de.ActiveRooms() != 0 {
		t.Fatalf("prefill room %+v %v; decode rooms %d", st, err, de.ActiveRooms())
	}
}

func TestSplitArgs(t *testing.T) {
	kv, rest := SplitArgs([]string{"--role", "decode", "--kvproxy", "/s", "--kv-layers=4", "-kv-page-size", "8", "--port", "1"})
	if strings.Join(kv, " ") != "--kvproxy /s --kv-layers=4 -kv-page-size 8" || strings.Join(rest, " ") != "--role decode --port 1" {
		t.Fatalf("kv %q rest %q", kv, rest)
	}
}

// restart stops a kvproxy and starts one like it on the same control socket
// (and, for prefill, bootstrap and peer port), as a process manager would.
func restart(t *testing.T, old *sidecar.Sidecar, role string) *sidecar.Sidecar {
	t.Helper()
	cfg := sidecar.Config{Role: role, Transport: "tcp", Host: "127.0.0.1", Control: old.Addrs().Control,
		Heartbeat: time.Second, WaitingTimeout: 500 * time.Millisecond}
	if role == "prefill" {
		_, port, _ := net.SplitHostPort(old.Addrs().Bootstrap)
		cfg.BootstrapPort, _ = strconv.Atoi(port)
		_, port, _ = net.SplitHostPort(old.Addrs().Peer)
		cfg.PeerPort, _ = strconv.Atoi(port)
	}
	if err := old.Close(); err != nil {
		t.Fatal(err)
	}
	s, err := sidecar.Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// A restarted kvproxy serves the same Sims again: the next request
// registers the pool anew, without restarting the engine.
func TestRestartedKVProxyServesAgain(t *testing.T) {
	for _, role := range []string{"prefill", "decode"} {
		t.Run(role, func(t *testing.T) {
			ps, ds := proxy(t, "prefill"), proxy(t, "decode")
			c := connect(t, ps, ds)
			sim, victim := c.d, ds
			if role == "prefill" {
				sim, victim = c.p, ps
			}
			if _, _, perr, derr := run(c.p, c.d, c.req(1, "a", 100), c.req(1, "a", 100)); perr != nil || derr != nil {
				t.Fatalf("before: prefill %v decode %v", perr, derr)
			}
			// Down: the engine answers a retryable 503 at once.
			if err := victim.Close(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			var err error
			if role == "prefill" {
				_, err = sim.Prefill(context.Background(), c.req(2, "b", 100))
			} else {
				_, err = sim.Decode(context.Background(), c.req(2, "b", 100))
			}
			var hs interface{ HTTPStatus() int }
			if !errors.Is(err, ErrKVProxyDown) || !errors.As(err, &hs) || hs.HTTPStatus() != 503 || time.Since(start) > 2*time.Second {
				t.Fatalf("kvproxy down: %v after %v", err, time.Since(start))
			}
			restart(t, victim, role)
			// Back within the redial interval (plus scheduling).
			restarted := time.Now()
			for room := uint64(100); ; room++ {
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				_, _, perr, derr := runCtx(ctx, c.p, c.d, c.req(room, "c", 100), c.req(room, "c", 100))
				cancel()
				if perr == nil && derr == nil {
					break
				}
				if time.Since(restarted) > 3*time.Second {
					t.Fatalf("not serving 3 s after the restart: prefill %v decode %v", perr, derr)
				}
				time.Sleep(50 * time.Millisecond)
			}
			t.Logf("serving again %v after the restart", time.Since(restarted).Round(time.Millisecond))
			for i := range 5 {
				r := c.req(uint64(10+i), "c", 100+i)
				if _, dres, perr, derr := run(c.p, c.d, r, r); perr != nil || derr != nil || !dres.ChecksumOK {
					t.Fatalf("after restart, request %d: prefill %v decode %v", i, perr, derr)
				}
			}
			if sim.Links() != 2 {
				t.Fatalf("%d control connections, want 2 (one reconnect)", sim.Links())
			}
		})
	}
}
