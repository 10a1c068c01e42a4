package sidecar

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer"
	"github.com/pdrouter/pdrouter/kvtransfer/control"
	"github.com/pdrouter/pdrouter/testkit/kvtest"
)

// TestEngineOwnedMemory: two kvproxies as cmd/kvproxy runs them; each
// engine registers memory it owns (a memfd mapping) and the prefill engine
// writes into the decode engine's by address, Mooncake-style, while the
// prefill kvproxy also serves rooms on the same peer port.
func TestEngineOwnedMemory(t *testing.T) {
	withTransports(t, func(t *testing.T, transport string) {
		p, d := start(t, "prefill", transport), start(t, "decode", transport)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		const size = 1 << 20
		pcl, src := engineMemory(t, ctx, p, size)
		dcl, dst := engineMemory(t, ctx, d, size)
		for i := range src {
			src[i] = byte(i*31 + 7)
		}
		peer, tr, err := dcl.Hello(ctx)
		if err != nil || peer != d.Addrs().Peer || tr != transport {
			t.Fatalf("decode hello: %q %q %v", peer, tr, err)
		}
		// SGLang's shape: per layer and page, consecutive pages merge.
		var ts []control.Triple
		for layer := range 4 {
			for pg := range 16 {
				off := uint64(layer*64+pg) * 4096
				ts = append(ts, control.Triple{Src: addr(src) + off, Dst: addr(dst) + off + 8*4096, Len: 4096})
			}
		}
		if err := pcl.Write(ctx, peer, ts); err != nil {
			t.Fatal(err)
		}
		for i, tr := range ts {
			if !bytes.Equal(dst[tr.Dst-addr(dst):][:tr.Len], src[tr.Src-addr(src):][:tr.Len]) {
				t.Fatalf("triple %d did not land", i)
			}
		}
		if m := get(t, "http://"+d.Addrs().Metrics+"/metrics"); !strings.Contains(m, "kvproxy_registered_regions 1") {
			t.Fatalf("decode metrics lack the registration:\n%s", m)
		}
		// Each end names the link's path: host memory goes by the transport.
		var st kvtransfer.PlaneStatus
		if err := json.Unmarshal([]byte(get(t, "http://"+p.Addrs().Metrics+"/status")), &st); err != nil {
			t.Fatal(err)
		}
		want := kvtransfer.Path(transport)
		if transport == "ucx" { // one host: UCX cannot register the memfd for shared memory
			want = kvtransfer.PathSHM
		}
		if len(st.Links) == 0 || len(st.Links[0].Paths) == 0 || st.Links[0].Paths[0].Path != want {
			t.Fatalf("/status: %+v", st)
		}
		if m := get(t, "http://"+p.Addrs().Metrics+"/metrics"); !strings.Contains(m, `path="`+string(want)+`"`) {
			t.Fatalf("prefill metrics lack kvproxy_link_path:\n%s", m)
		}
		// The engines leave: their registrations go (what tests read).
		pcl.Close()
		dcl.Close()
		for _, s := range []*Sidecar{p, d} {
			deadline := time.Now().Add(5 * time.Second)
			for !strings.Contains(get(t, "http://"+s.Addrs().Metrics+"/metrics"), "kvproxy_registered_regions 0") {
				if time.Now().After(deadline) {
					t.Fatal("registrations did not go with the engine's connection")
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	})
}

// TestUCXAcrossHostIDs: ucx kvproxies with different host ids are on two
// hosts as far as they know: no shm between them, host memory goes by DATA
// frames on the link (UCX_TLS has no rc or dc lane, so UCX's puts would be
// emulated), and the link says so.
func TestUCXAcrossHostIDs(t *testing.T) {
	if !ucxBuilt {
		t.Skip("ucx needs a cgo build")
	}
	t.Setenv("UCX_TLS", "posix,cma,tcp")
	t.Setenv("UCX_NET_DEVICES", "lo")
	for _, hosts := range [][2]string{{"node-a", "node-b"}, {"node-a", "node-a"}} {
		t.Run(hosts[0]+"-"+hosts[1], func(t *testing.T) {
			p := start(t, "prefill", "ucx", func(c *Config) { c.HostID = hosts[0] })
			d := start(t, "decode", "ucx", func(c *Config) { c.HostID = hosts[1] })
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			pcl, src := engineMemory(t, ctx, p, 1<<16)
			_, dst := engineMemory(t, ctx, d, 1<<16)
			for i := range src {
				src[i] = byte(i*13 + 1)
			}
			if err := pcl.Write(ctx, d.Addrs().Peer, []control.Triple{{Src: addr(src), Dst: addr(dst), Len: 1 << 16}}); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(src, dst) {
				t.Fatal("the write did not land")
			}
			want := kvtransfer.PairPath{Src: "host@" + hosts[0], Dst: "host@" + hosts[1], Path: kvtransfer.PathTCP}
			if hosts[0] == hosts[1] {
				want.Path = kvtransfer.PathSHM
			}
			var st kvtransfer.PlaneStatus
			if err := json.Unmarshal([]byte(get(t, "http://"+p.Addrs().Metrics+"/status")), &st); err != nil {
				t.Fatal(err)
			}
			if len(st.Links) != 1 || st.Links[0].PeerHost != hosts[1] || !slices.Contains(st.Links[0].Paths, want) {
				t.Fatalf("/status %+v, want a link to %s with %+v", st, hosts[1], want)
			}
		})
	}
}

// Two kvproxies of one host with different host ids are remote to each
// other: shm, which maps the peer's memory, has no path between them, and
// a write says so at once.
func TestHostIDMakesPeersRemote(t *testing.T) {
	p := start(t, "prefill", "shm", func(c *Config) { c.HostID = "node-a" })
	d := start(t, "decode", "shm", func(c *Config) { c.HostID = "node-b" })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pcl, src := engineMemory(t, ctx, p, 4096)
	_, dst := engineMemory(t, ctx, d, 4096)
	err := pcl.Write(ctx, d.Addrs().Peer, []control.Triple{{Src: addr(src), Dst: addr(dst), Len: 8}})
	if err == nil || !strings.Contains(err.Error(), "no path from host@node-a to host@node-b over shm") {
		t.Fatalf("shm write to another host id: %v", err)
	}
}

// engineMemory is an engine of s: a control connection that registered
// size bytes of a memfd it mapped.
func engineMemory(t *testing.T, ctx context.Context, s *Sidecar, size int) (*control.Client, []byte) {
	cl, err := control.Dial(s.Addrs().Control)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	seg := kvtest.EngineMemory(t, size)
	mem := seg.Mem
	if err := cl.RegisterMemory(ctx, addr(mem), uint64(size), seg.Fd()); err != nil {
		t.Fatal(err)
	}
	return cl, mem
}

var addr = kvtest.Addr

// TestPrefillWithoutBootstrap: with SGLang serving its own bootstrap API, a
// prefill kvproxy started with a negative bootstrap port binds none, so the
// two do not clash on 8998, and still serves engine memory.
func TestPrefillWithoutBootstrap(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0") // a port "SGLang" holds
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	s := start(t, "prefill", "tcp", func(c *Config) { c.BootstrapPort = -1 })
	if a := s.Addrs(); a.Bootstrap != "" || a.Peer == "" {
		t.Fatalf("addrs %+v: want a peer port and no bootstrap", a)
	}
	cl, err := control.Dial(s.Addrs().Control)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	if peer, _, err := cl.Hello(context.Background()); err != nil || peer != s.Addrs().Peer {
		t.Fatalf("hello: %q %v", peer, err)
	}
	// Without it, a kvproxy on SGLang's port would not start.
	port := held.Addr().(*net.TCPAddr).Port
	if _, err := Start(Config{Role: "prefill", Transport: "tcp", Host: "127.0.0.1", BootstrapPort: port,
		Control: filepath.Join(t.TempDir(), "x.sock")}); err == nil {
		t.Fatal("a kvproxy on a taken bootstrap port started")
	}
}
