// Package balancer holds the worker pools the router picks from: workers and
// their health, the registry snapshot read lock-free on the hot path, and the
// selection policies.
package balancer

import (
	"net"
	"net/url"
	"strings"
	"sync/atomic"
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

// Worker is one upstream engine. Identity fields are immutable after
// creation; mutable state is atomic so the hot path never locks.
type Worker struct {
	ID            string
	URL           string // base URL, no trailing slash
	ModelID       string
	Type          WorkerType
	BootstrapPort int    // NoBootstrapPort when none
	BootstrapHost string // host of URL as sglang-router injects it ([::1] for IPv6)
	Priority      uint32
	Cost          float32
	Labels        map[string]string

	healthy atomic.Bool
	load    atomic.Int64 // router-side in-flight requests
	Breaker *Breaker
}

// NewWorker builds a worker from its base URL. The worker starts healthy;
// registration decides when it joins a pool.
func NewWorker(rawURL string, typ WorkerType, bootstrapPort int) *Worker {
	w := &Worker{
		URL:           strings.TrimRight(rawURL, "/"),
		Type:          typ,
		BootstrapPort: bootstrapPort,
		ModelID:       "unknown",
		Breaker:       NewBreaker(DefaultBreakerConfig()),
	}
	w.BootstrapHost = BootstrapHost(w.URL)
	w.healthy.Store(true)
	return w
}

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

func (w *Worker) Healthy() bool     { return w.healthy.Load() }
func (w *Worker) SetHealthy(h bool) { w.healthy.Store(h) }

// Available reports whether the worker may take new traffic.
func (w *Worker) Available() bool {
	return w.healthy.Load() && (w.Breaker == nil || w.Breaker.Allow())
}

// Load is the router's in-flight request count for the worker.
func (w *Worker) Load() int64 { return w.load.Load() }
func (w *Worker) IncLoad()    { w.load.Add(1) }
func (w *Worker) DecLoad()    { w.load.Add(-1) }
