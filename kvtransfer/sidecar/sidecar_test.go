package sidecar

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/kvtransfer/rooms"
	"github.com/pdrouter/pdrouter/kvtransfer/shm"
	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func start(t *testing.T, role, transport string, tweak ...func(*Config)) *Sidecar {
	t.Helper()
	cfg := Config{Role: role, Transport: transport, Host: "127.0.0.1",
		Control: filepath.Join(t.TempDir(), role+".sock"), Heartbeat: 500 * time.Millisecond}
	for _, f := range tweak {
		f(&cfg)
	}
	s, err := Start(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// withTransports runs f once per transport of this build (ucx over tcp
// and over shared memory).
func withTransports(t *testing.T, f func(t *testing.T, transport string)) {
	transports := []string{"tcp", "shm"}
	if ucxBuilt {
		transports = append(transports, "ucx")
	}
	for _, tr := range transports {
		if tr != "ucx" {
			t.Run(tr, func(t *testing.T) { f(t, tr) })
			continue
		}
		for _, tls := range []string{"tcp", "posix,cma,tcp"} {
			t.Run(tr+"/"+tls, func(t *testing.T) {
				t.Setenv("UCX_TLS", tls)
				t.Setenv("UCX_NET_DEVICES", "lo")
				f(t, tr)
			})
		}
	}
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET %s: %d %v %s", url, resp.StatusCode, err, b)
	}
	return string(b)
}

func TestStartAndClose(t *testing.T) {
	withTransports(t, func(t *testing.T, transport string) {
		for _, role := range []string{"prefill", "decode"} {
			t.Run(role, func(t *testing.T) {
				s := start(t, role, transport)
				a := s.Addrs()
				if s.TransportName() != transport {
					t.Fatalf("transport %q, want %q", s.TransportName(), transport)
				}
				if got := get(t, "http://"+a.Metrics+"/health"); got != "OK rooms_active=0 peers=0 regions=0 layout_registered=false\n" {
					t.Fatalf("/health: %q", got)
				}
				if m := get(t, "http://"+a.Metrics+"/metrics"); !strings.Contains(m, "kvproxy_peers 0") || !strings.Contains(m, "go_goroutines") {
					t.Fatalf("/metrics lacks the engine's or the Go series:\n%s", m)
				}
				listens := []string{a.Metrics}
				if role == "prefill" {
					if a.Peer == "" || a.Bootstrap == "" {
						t.Fatalf("prefill addrs %+v", a)
					}
					if got := get(t, "http://"+a.Bootstrap+"/health"); got != "OK" {
						t.Fatalf("bootstrap /health: %q", got)
					}
					listens = append(listens, a.Peer, a.Bootstrap)
				} else if a.Peer == "" || a.Bootstrap != "" {
					t.Fatalf("decode addrs %+v: want a peer port (engine memory) and no bootstrap", a)
				} else {
					listens = append(listens, a.Peer)
				}
				if _, err := os.Stat(a.Control); err != nil {
					t.Fatalf("control socket: %v", err)
				}
				if err := s.Close(); err != nil {
					t.Fatal(err)
				}
				select {
				case <-s.Done():
					t.Fatal("Done closed by a clean Close")
				default:
				}
				if _, err := os.Stat(a.Control); !os.IsNotExist(err) {
					t.Fatalf("control socket left behind: %v", err)
				}
				for _, addr := range listens {
					if c, err := net.Dial("tcp", addr); err == nil {
						c.Close()
						t.Fatalf("%s still accepts after Close", addr)
					}
				}
				if err := s.Close(); err != nil {
					t.Fatalf("second Close: %v", err)
				}
			})
		}
	})
}

func TestStartFails(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	busyPort := busy.Addr().(*net.TCPAddr).Port
	sock := filepath.Join(t.TempDir(), "k.sock")
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"role", Config{Role: "both", Transport: "tcp", Control: sock}, `role "both"`},
		{"transport", Config{Role: "decode", Transport: "pigeon", Control: sock}, `transport "pigeon" not available`},
		{"metrics-port-taken", Config{Role: "decode", Transport: "tcp", Host: "127.0.0.1", MetricsPort: busyPort, Control: sock}, "address already in use"},
		{"bootstrap-port-taken", Config{Role: "prefill", Transport: "tcp", Host: "127.0.0.1", BootstrapPort: busyPort, Control: sock}, "address already in use"},
		{"control-dir-missing", Config{Role: "prefill", Transport: "tcp", Host: "127.0.0.1", Control: "/nonexistent/k.sock"}, "/nonexistent/k.sock"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := Start(tc.cfg)
			if err == nil {
				s.Close()
				t.Fatal("started")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want %q", err, tc.want)
			}
		})
	}
}

const (
	pages = 16
	item  = 256
)

// engine is a fake inference engine on a sidecar's control socket: it
// allocates a pool of two KV buffers and registers it and its layout.
type engine struct {
	cl  *control.Client
	mem []byte
}

func connect(t *testing.T, s *Sidecar) *engine {
	t.Helper()
	cl, err := control.Dial(s.Addrs().Control)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cl.Close() })
	seg, err := shm.Create("engine", 2*pages*item)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = seg.Close() })
	base := uint64(uintptr(unsafe.Pointer(unsafe.SliceData(seg.Mem))))
	l := control.RoomLayout{PageSize: 16, Dtype: "bf16", Bufs: []control.RoomBuf{
		{Kind: wire.KindKV, Addr: base, ItemLen: item, Items: pages},
		{Kind: wire.KindKV, Addr: base + pages*item, ItemLen: item, Items: pages},
	}}
	ctx := context.Background()
	if err := cl.RegisterMemory(ctx, base, uint64(len(seg.Mem)), seg.Fd()); err != nil {
		t.Fatal(err)
	}
	if err := cl.RoomLayout(ctx, l); err != nil {
		t.Fatal(err)
	}
	return &engine{cl: cl, mem: seg.Mem}
}

func TestTransferBetweenSidecars(t *testing.T) {
	withTransports(t, func(t *testing.T, transport string) {
		p, d := start(t, "prefill", transport), start(t, "decode", transport)
		pe, de := connect(t, p), connect(t, d)
		for i := range 2 * pages * item {
			pe.mem[i] = byte(i*7 + i/item)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		const room = 77
		if err := de.cl.Expect(ctx, room, p.Addrs().Bootstrap, []uint32{5, 6, 9}, -1); err != nil {
			t.Fatal(err)
		}
		if err := pe.cl.Send(ctx, room, []uint32{1, 2, 3}, true, -1); err != nil {
			t.Fatal(err)
		}
		if st, err := de.cl.Wait(ctx, room); err != nil || st.State != rooms.Success || st.Pages != 3 {
			t.Fatalf("decode: %+v %v", st, err)
		}
		if st, err := pe.cl.Wait(ctx, room); err != nil || st.State != rooms.Success {
			t.Fatalf("prefill: %+v %v", st, err)
		}
		for b := 0; b < 2; b++ {
			for i, pair := range [][2]int{{1, 5}, {2, 6}, {3, 9}} {
				src := pe.mem[b*pages*item+pair[0]*item:][:item]
				dst := de.mem[b*pages*item+pair[1]*item:][:item]
				if !bytes.Equal(src, dst) {
					t.Fatalf("buffer %d page %d did not land", b, i)
				}
			}
		}
		if h := get(t, "http://"+d.Addrs().Metrics+"/health"); h != "OK rooms_active=0 peers=1 regions=1 layout_registered=true\n" {
			t.Fatalf("decode /health: %q", h)
		}
		m := get(t, "http://"+p.Addrs().Metrics+"/metrics")
		if !strings.Contains(m, `kvproxy_rooms_total{role="prefill",state="Success"} 1`) {
			t.Fatalf("prefill metrics lack the room:\n%s", m)
		}
		for _, name := range dashboardSeries(t) {
			if !strings.Contains(m, "\n"+name) {
				t.Errorf("/metrics lacks %s, which the Grafana dashboard reads", name)
			}
		}
	})
}

// dashboardSeries lists the kvproxy series deploy/'s Grafana dashboard
// queries.
func dashboardSeries(t *testing.T) []string {
	b, err := os.ReadFile("../../deploy/grafana/pdrouter.json")
	if err != nil {
		t.Fatal(err)
	}
	names := regexp.MustCompile(`kvproxy_[a-z_]+`).FindAllString(string(b), -1)
	if len(names) == 0 {
		t.Fatal("the dashboard queries no kvproxy series")
	}
	slices.Sort(names)
	return slices.Compact(names)
}

// TestCloseEndsOpenRooms: closing a sidecar with an engine connected and a
// room matched fails the room on the other side too, and the engine's
// pending Wait returns instead of hanging.
func TestCloseEndsOpenRooms(t *testing.T) {
	withTransports(t, func(t *testing.T, transport string) {
		p, d := start(t, "prefill", transport), start(t, "decode", transport)
		pe, de := connect(t, p), connect(t, d)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := de.cl.Expect(ctx, 5, p.Addrs().Bootstrap, []uint32{1, 2}, -1); err != nil {
			t.Fatal(err)
		}
		for {
			st, err := pe.cl.Poll(ctx, 5)
			if err == nil && st.State == rooms.WaitingForInput {
				break
			}
			if ctx.Err() != nil {
				t.Fatalf("prefill room never matched: %+v %v", st, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
		waited := make(chan struct{})
		go func() {
			defer close(waited)
			_, _ = de.cl.Wait(context.Background(), 5)
		}()
		if err := d.Close(); err != nil {
			t.Fatal(err)
		}
		select {
		case <-waited:
		case <-time.After(5 * time.Second):
			t.Fatal("the engine's Wait hangs after Close")
		}
		if st, err := pe.cl.Wait(ctx, 5); err != nil || st.State != rooms.Failed {
			t.Fatalf("prefill room after its peer closed: %+v %v", st, err)
		}
		if n := p.Rooms().ActiveRooms(); n != 0 {
			t.Fatalf("%d rooms left on the prefill", n)
		}
	})
}

// TestControlSocketOfARunningSidecar: a second kvproxy started on the same
// control path (both roles default to one) fails instead of unlinking the
// socket of the one running, whose engine could then no longer reach it;
// a socket file left by a kvproxy that died is still replaced.
func TestControlSocketOfARunningSidecar(t *testing.T) {
	first := start(t, "prefill", "tcp")
	sock := first.Addrs().Control
	if s, err := Start(Config{Role: "decode", Transport: "tcp", Host: "127.0.0.1", Control: sock}); err == nil {
		s.Close()
		t.Fatal("a second sidecar started on the control socket of a running one")
	} else if !strings.Contains(err.Error(), "in use") {
		t.Fatalf("second sidecar: %v", err)
	}
	connect(t, first) // its engine still reaches it

	stale := filepath.Join(t.TempDir(), "stale.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: stale, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close() // as if its kvproxy was killed: the file stays, nobody listens
	start(t, "decode", "tcp", func(c *Config) { c.Control = stale })
}

// A sidecar that stops by itself says so: Done closes and Close returns
// the first reason, not a later one.
func TestStoppedByItself(t *testing.T) {
	s := start(t, "decode", "tcp")
	s.stop(errors.New("first failure"))
	s.stop(errors.New("second failure"))
	select {
	case <-s.Done():
	default:
		t.Fatal("Done open after the sidecar stopped")
	}
	if err := s.Close(); err == nil || err.Error() != "first failure" {
		t.Fatalf("Close: %v, want the first failure", err)
	}
}
