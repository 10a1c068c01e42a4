// Package balancer holds the worker pools the router picks from: workers and
// their health, the registry snapshot read lock-free on the hot path, and the
// selection policies.
package balancer

import (
	"maps"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// WorkerType is the role a worker plays.
type WorkerType uint8

const (
	Regular WorkerType = iota
	Prefill
	Decode
)

func (t WorkerType) String() string {
	switch t {
	case Prefill:
		return "prefill"
	case Decode:
		return "decode"
	default:
		return "regular"
	}
}

// ParseWorkerType accepts the names used by the /workers API.
func ParseWorkerType(s string) (WorkerType, bool) {
	switch strings.ToLower(s) {
	case "", "regular":
		return Regular, true
	case "prefill":
		return Prefill, true
	case "decode":
		return Decode, true
	}
	return Regular, false
}

// NoBootstrapPort marks a prefill worker registered with "none": the router
// then sends JSON null and SGLang falls back to its own default.
const NoBootstrapPort = -1

// Worker is one upstream engine. The exported fields are immutable once the
// worker is published in a Snapshot: an update publishes a copy that shares
// the mutable state (health, load, breaker), so in-flight requests holding
// the old pointer still count against the same worker.
type Worker struct {
	ID                 string
	URL                string // identity: the base URL, or with --dp-aware "BASE@RANK"
	BaseURL            string // where requests and probes go: URL without "@RANK", no trailing slash
	ModelID            string
	Type               WorkerType
	BootstrapPort      int    // NoBootstrapPort when none
	BootstrapHost      string // host of URL as sglang-router injects it ([::1] for IPv6)
	Priority           uint32
	Cost               float32
	Labels             map[string]string
	APIKey             string // sent as Bearer to this worker; empty = none
	DisableHealthCheck bool
	// DPSize > 0 marks one rank of a data-parallel engine (--dp-aware):
	// requests carry DPRank, in [0, DPSize), for the engine to honour.
	DPRank, DPSize int
	// HTTP2: requests go to this worker over HTTP/2 cleartext (h2c),
	// multiplexed on a few connections, instead of HTTP/1.1.
	HTTP2 bool

	st      *workerState
	Breaker *Breaker
}

// workerState is the part of a worker that changes while it serves traffic.
type workerState struct {
	healthy atomic.Bool
	load    atomic.Int64 // router-side in-flight requests

	// Owned by the health checker: consecutive probe results and the
	// breaker's success total seen at the previous probe (passive health).
	probeFails  atomic.Int32
	probeOKs    atomic.Int32
	passiveSeen atomic.Uint64

	// Owned by the load monitor: the engine-reported load and the router's
	// in-flight count when it was read; reportedOK says whether it is valid.
	// (Three separate atomics: a torn read only skews one pick slightly.)
	reported   atomic.Int64
	loadAtPoll atomic.Int64
	reportedOK atomic.Bool
	legacyLoad atomic.Bool // the engine has no /v1/loads: poll /get_load

	selected atomic.Pointer[lastSelection] // Metrics.Selected's cache
}

// NewWorker builds a worker from its base URL. The worker starts healthy;
// registration decides when it joins a pool.
func NewWorker(rawURL string, typ WorkerType, bootstrapPort int) *Worker {
	base := strings.TrimRight(rawURL, "/")
	w := &Worker{
		URL:           base,
		BaseURL:       base,
		Type:          typ,
		BootstrapPort: bootstrapPort,
		ModelID:       "unknown",
		Priority:      DefaultPriority,
		Cost:          DefaultCost,
		Breaker:       NewBreaker(DefaultBreakerConfig()),
		st:            &workerState{},
	}
	w.BootstrapHost = BootstrapHost(w.URL)
	w.st.healthy.Store(true)
	return w
}

// rank is the worker for one DP rank of w's engine, named "URL@RANK" as
// sglang-router and smg name them. It has its own health, load and breaker
// (so one rank's failures do not shut out the others), and no ID yet.
func (w *Worker) rank(rank, size int, breaker BreakerConfig) *Worker {
	c := *w
	c.URL = w.BaseURL + "@" + strconv.Itoa(rank)
	c.ID = ""
	c.DPRank, c.DPSize = rank, size
	c.st = &workerState{}
	c.st.healthy.Store(w.Healthy())
	c.Breaker = NewBreaker(breaker)
	return &c
}

// Defaults of WorkerConfigRequest (spec §3.3).
const (
	DefaultPriority uint32  = 50
	DefaultCost     float32 = 1.0
)

// BootstrapHost returns the host part of a worker URL the way sglang-router
// 0.3.x does: no scheme, no port, IPv6 in brackets, "localhost" if unparsable.
func BootstrapHost(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil || u.Host == "" {
		u, err = url.Parse("http://" + rawURL)
		if err != nil || u.Host == "" {
			return "localhost"
		}
	}
	host := u.Hostname()
	if strings.Contains(host, ":") && net.ParseIP(host) != nil {
		return "[" + host + "]"
	}
	return host
}

func (w *Worker) Healthy() bool     { return w.st.healthy.Load() }
func (w *Worker) SetHealthy(h bool) { w.st.healthy.Store(h) }

// Available reports whether the worker may take new traffic.
func (w *Worker) Available() bool {
	return w.st.healthy.Load() && (w.Breaker == nil || w.Breaker.Allow())
}

// inService reports, without taking a half-open trial, whether the worker
// is healthy and not ejected.
func (w *Worker) inService() bool {
	b := w.Breaker
	return w.Healthy() && (b == nil || b.cfg.Disabled || !b.isEjected(time.Now().UnixNano()))
}

// Load is the router's in-flight request count for the worker.
func (w *Worker) Load() int64 { return w.st.load.Load() }
func (w *Worker) IncLoad()    { w.st.load.Add(1) }
func (w *Worker) DecLoad()    { w.st.load.Add(-1) }

// Record feeds one request outcome to the worker's breaker (and, through it,
// to passive health). Same as w.Breaker.Record.
func (w *Worker) Record(success bool) {
	if w.Breaker != nil {
		w.Breaker.Record(success)
	}
}

// ReportedLoad is the load from the last successful /get_load poll.
func (w *Worker) ReportedLoad() (int64, bool) {
	return w.st.reported.Load(), w.st.reportedOK.Load()
}

// reportedSample is the last report and the in-flight count at that poll.
func (w *Worker) reportedSample() (reported, atPoll int64, ok bool) {
	return w.st.reported.Load(), w.st.loadAtPoll.Load(), w.st.reportedOK.Load()
}

func (w *Worker) setReportedLoad(n int64, ok bool) {
	if ok {
		w.st.reported.Store(n)
		w.st.loadAtPoll.Store(w.Load())
	}
	w.st.reportedOK.Store(ok)
}

// withAttrs returns a copy sharing w's mutable state, for Update.
func (w *Worker) withAttrs(u WorkerUpdate) *Worker {
	c := *w
	if u.Priority != nil {
		c.Priority = *u.Priority
	}
	if u.Cost != nil {
		c.Cost = *u.Cost
	}
	if u.Labels != nil {
		c.Labels = maps.Clone(u.Labels)
	}
	if u.APIKey != nil {
		c.APIKey = *u.APIKey
	}
	return &c
}
