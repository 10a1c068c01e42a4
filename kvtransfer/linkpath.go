package kvtransfer

import (
	"cmp"
	"maps"
	"slices"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// No silent slow path: each link names the path it takes for each pair of
// places its two region tables hold (a log line when it forms, the
// kvproxy_link_path metric, LinkStatus for kvproxy's /status).

// PairPath is the path one pair of places takes, or why none does.
type PairPath struct {
	Src   string `json:"src"`
	Dst   string `json:"dst"`
	Path  Path   `json:"path,omitempty"`
	Error string `json:"error,omitempty"`
}

// LinkStatus is one link to a peer kvproxy.
type LinkStatus struct {
	Peer      string     `json:"peer"`
	Addr      string     `json:"addr"`
	PeerHost  string     `json:"peer_host,omitempty"` // empty: the peer's tables do not say
	Transport string     `json:"transport"`
	Paths     []PairPath `json:"paths"`
	// DirectRoutes counts engine sessions told to send their small host
	// writes to this peer themselves (directwrite.go).
	DirectRoutes uint64 `json:"direct_routes"`
}

// PlaneStatus is the plane's host id and its links' paths, and the
// engines writing small host buffers into ours themselves.
type PlaneStatus struct {
	Host          string       `json:"host"`
	Links         []LinkStatus `json:"links"`
	DirectClients int64        `json:"direct_clients"`
	DirectWrites  uint64       `json:"direct_writes"`
}

// Paths reports every link's paths, computed from the current tables.
func (p *MemoryPlane) Paths() PlaneStatus {
	p.mu.Lock()
	links := slices.Collect(maps.Keys(p.links))
	p.mu.Unlock()
	st := PlaneStatus{Host: p.host, Links: make([]LinkStatus, 0, len(links)), DirectClients: p.direct.clients.Load(), DirectWrites: p.direct.writes.Load()}
	for _, l := range links {
		st.Links = append(st.Links, l.status())
	}
	slices.SortFunc(st.Links, func(a, b LinkStatus) int { return strings.Compare(a.Addr, b.Addr) })
	return st
}

// localPlaces are the places of this plane's regions (host memory always:
// an engine's aux buffers are host memory even beside GPU KV).
func (p *MemoryPlane) localPlaces() []Place {
	places := []Place{HostPlace(p.host)}
	p.gpu.mu.Lock()
	for _, r := range p.gpu.regions {
		if pl := (Place{Kind: wire.MemCUDA, Device: r.dev.Ordinal(), Host: p.gpu.host}); !slices.Contains(places, pl) {
			places = append(places, pl)
		}
	}
	p.gpu.mu.Unlock()
	return places
}

// peerHost is the peer's host id as far as its link tells: a GPU region's
// key carries it, shm's worker address is it.
func (l *memLink) peerHost() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.regions {
		if pl := peerPlace(r); pl.Host != "" {
			return pl.Host
		}
	}
	if l.p.cfg.Transport.Name() == "shm" {
		return string(l.remote.WorkerAddr)
	}
	if h, ok := l.p.mt.(interface{ PeerHost([]byte) string }); ok {
		return h.PeerHost(l.remote.WorkerAddr)
	}
	return ""
}

// remotePlaces are the places of the peer's regions.
func (l *memLink) remotePlaces(host string) []Place {
	l.mu.Lock()
	defer l.mu.Unlock()
	places := []Place{}
	for _, r := range l.regions {
		pl := peerPlace(r)
		if pl.Kind == wire.MemHost {
			pl.Host = host
		}
		if !slices.Contains(places, pl) {
			places = append(places, pl)
		}
	}
	return places
}

// pathTo is the path from local place src into the peer's place dst: host
// memory by the plane's host path, device memory staged by RMA into the
// peer's ring where stagedUCX says so (and the peer lends one), else as
// DATA frames.
func (l *memLink) pathTo(src, dst Place) (Path, error) {
	tr := string(l.hostPath())
	if src.Kind != wire.MemHost || dst.Kind != wire.MemHost {
		tr = "tcp"
		if l.stagedUCX() && !l.ustage.none.Load() {
			tr = "ucx"
		}
	}
	return choosePath(tr, src, dst, l.p.cfg.GPUs.PeerAccess)
}

func (l *memLink) status() LinkStatus {
	host := l.peerHost()
	st := LinkStatus{Peer: l.remote.Name, Addr: l.remote.ListenAddr, PeerHost: host, Transport: l.p.cfg.Transport.Name(), Paths: []PairPath{},
		DirectRoutes: l.directRoutes.Load()}
	for _, src := range l.p.localPlaces() {
		for _, dst := range l.remotePlaces(host) {
			path, err := l.pathTo(src, dst)
			pp := PairPath{Src: src.String(), Dst: dst.String(), Path: path}
			if err != nil {
				pp.Error = err.Error()
			}
			st.Paths = append(st.Paths, pp)
		}
	}
	return st
}

// logPaths says which path each pair of the new link takes.
func (l *memLink) logPaths() {
	st := l.status()
	fields := []zap.Field{zap.String("peer", st.Peer), zap.String("addr", st.Addr), zap.String("peer_host", st.PeerHost)}
	for _, pp := range st.Paths {
		fields = append(fields, zap.String(pp.Src+"->"+pp.Dst, string(pp.Path)+pp.Error))
	}
	l.p.log.Info("memory link formed", fields...)
}

// linkPathCollector exports kvproxy_link_path{peer,src,dst,path} = 1 for
// each pair of each link at scrape time (path "none" with no path), and
// the direct small writes: kvproxy_direct_routes{peer} (engine sessions
// sent to write to that peer themselves), kvproxy_direct_clients and
// kvproxy_direct_writes_total (engines writing into ours themselves).
type linkPathCollector struct {
	p                                 *MemoryPlane
	desc, routes, clients, directDone *prometheus.Desc
}

func newLinkPathCollector(p *MemoryPlane) *linkPathCollector {
	return &linkPathCollector{p: p,
		desc: prometheus.NewDesc("kvproxy_link_path",
			"The path each link takes for each pair of memory places (1 per pair).", []string{"peer", "src", "dst", "path"}, nil),
		routes: prometheus.NewDesc("kvproxy_direct_routes",
			"Engine sessions told to send small host writes to this peer kvproxy themselves.", []string{"peer"}, nil),
		clients: prometheus.NewDesc("kvproxy_direct_clients",
			"Engines connected to this kvproxy's peer port to write small host buffers themselves.", nil, nil),
		directDone: prometheus.NewDesc("kvproxy_direct_writes_total",
			"Small writes engines sent straight to this kvproxy (fences answered).", nil, nil)}
}

func (c *linkPathCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.desc
	ch <- c.routes
	ch <- c.clients
	ch <- c.directDone
}

func (c *linkPathCollector) Collect(ch chan<- prometheus.Metric) {
	st := c.p.Paths()
	seen := map[[3]string]bool{} // both ends may have dialed: two links, one peer
	routes := map[string]uint64{}
	for _, l := range st.Links {
		routes[l.Addr] += l.DirectRoutes
		for _, pp := range l.Paths {
			if k := [3]string{l.Addr, pp.Src, pp.Dst}; !seen[k] {
				seen[k] = true
				ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, 1, l.Addr, pp.Src, pp.Dst, cmp.Or(string(pp.Path), "none"))
			}
		}
	}
	for addr, n := range routes {
		ch <- prometheus.MustNewConstMetric(c.routes, prometheus.GaugeValue, float64(n), addr)
	}
	ch <- prometheus.MustNewConstMetric(c.clients, prometheus.GaugeValue, float64(st.DirectClients))
	ch <- prometheus.MustNewConstMetric(c.directDone, prometheus.CounterValue, float64(st.DirectWrites))
}
