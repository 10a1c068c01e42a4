package enginesim

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/internal/mockworker"
	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/sidecar"
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
	pe, de *kvtransfer.Engine
	boot   *net.TCPAddr // the prefill kvproxy's bootstrap API
}

func pair(t *testing.T) *sims {
	ps, ds := proxy(t, "prefill"), proxy(t, "decode")
	c := &sims{pe: ps.Engine(), de: ds.Engine()}
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
	var wg sync.WaitGroup
	wg.Go(func() { pres, perr = p.Prefill(context.Background(), pr) })
	wg.Go(func() { dres, derr = d.Decode(context.Background(), dr) })
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
