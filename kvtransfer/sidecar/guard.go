package sidecar

import (
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/pdrouter/pdrouter/internal/netutil"
)

// connGuard admits an HTTP port's connections so that a flood cannot lock
// out the peers that use the port. A peer is known once a request of its
// has reached the handler (decode kvproxies and engines asking /route);
// connections from peers not known yet may take only part of the slots,
// so a flood of connections that send nothing, or dribble a head, from
// other addresses leaves the rest to known peers. A connection over its
// share, or over the cap, is answered 503 rather than dropped.
type connGuard struct {
	*netutil.Listener // its 503, and an accept that survives EMFILE
	max, strangerMax  int

	mu        sync.Mutex
	known     map[netip.Addr]struct{}
	conns     map[net.Conn]bool // open admitted connections: admitted as a stranger?
	strangers int
}

// maxKnownPeers bounds the known set: a deployment has a few peers, and
// past this many, newcomers are served as strangers.
const maxKnownPeers = 4096

// busyRefusal is what a refused connection reads.
var busyRefusal = func() []byte {
	body := "server busy: too many connections; retry\n"
	return []byte("HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: " +
		strconv.Itoa(len(body)) + "\r\nRetry-After: 1\r\nConnection: close\r\n\r\n" + body)
}()

// newConnGuard caps ln at max connections, of which strangers may hold
// three quarters.
func newConnGuard(ln net.Listener, max int, onAcceptError func(error, time.Duration)) *connGuard {
	return &connGuard{
		// The cap is counted here, over admitted connections only: refusals
		// in progress (at most 64) must not use up the known peers' slots.
		Listener:    netutil.Listen(ln, netutil.Options{Refusal: busyRefusal, OnAcceptError: onAcceptError}),
		max:         max,
		strangerMax: max - max/4,
		known:       map[netip.Addr]struct{}{},
		conns:       map[net.Conn]bool{},
	}
}

func (g *connGuard) Accept() (net.Conn, error) {
	for {
		c, err := g.Listener.Accept()
		if err != nil {
			return nil, err
		}
		ip := addrOf(c.RemoteAddr().String())
		g.mu.Lock()
		_, known := g.known[ip]
		admit := len(g.conns) < g.max && (known || g.strangers < g.strangerMax)
		if admit {
			g.conns[c] = !known
			if !known {
				g.strangers++
			}
		}
		g.mu.Unlock()
		if admit {
			return c, nil
		}
		g.Refuse(c)
	}
}

// track is the http.Server's ConnState hook: a closed connection frees
// its slot.
func (g *connGuard) track(c net.Conn, st http.ConnState) {
	if st != http.StateClosed && st != http.StateHijacked {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	stranger, ok := g.conns[c]
	if !ok {
		return
	}
	delete(g.conns, c)
	if stranger {
		g.strangers--
	}
}

// vouch wraps h: a peer whose request reaches it is known from then on.
func (g *connGuard) vouch(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if ip := addrOf(r.RemoteAddr); ip.IsValid() {
			g.mu.Lock()
			if len(g.known) < maxKnownPeers {
				g.known[ip] = struct{}{}
			}
			g.mu.Unlock()
		}
		h.ServeHTTP(w, r)
	})
}

// addrOf is the IP of a "host:port" (invalid if it has none).
func addrOf(hostPort string) netip.Addr {
	ap, err := netip.ParseAddrPort(hostPort)
	if err != nil {
		return netip.Addr{}
	}
	return ap.Addr().Unmap()
}
