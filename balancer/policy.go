package balancer

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Request is what a policy may look at. Text is only filled when the policy
// says it needs it (NeedsText), because extracting it costs a scan.
type Request struct {
	Text   string
	Model  string  // model the request asks for; "" = the default tree/pool
	Header Headers // the request's headers; may be nil
}

// Headers looks request headers up case-insensitively; net/http's Header
// fits, and the router passes a view of fasthttp's without copying it.
type Headers interface {
	Get(name string) string
}

func (r *Request) header(name string) string {
	if r == nil || r.Header == nil {
		return ""
	}
	return r.Header.Get(name)
}

// Policy picks one worker out of the available ones. Implementations must be
// safe for concurrent use; workers is never empty and must not be modified,
// by the policy or later by the caller: policies cache per-list state keyed
// by the slice (Snapshot.Available's results qualify).
type Policy interface {
	Name() string
	NeedsText() bool
	Select(workers []*Worker, req *Request) (*Worker, error)
}

// WorkerWatcher is implemented by policies that keep per-worker state; the
// Manager (AttachPolicy) calls it with every new registry snapshot.
type WorkerWatcher interface {
	WorkersChanged(s *Snapshot)
}

// Runner is implemented by policies with background work (eviction,
// rebalancing); Run returns when ctx ends.
type Runner interface {
	Run(ctx context.Context)
}

// ErrNoSelection is returned by a policy that cannot choose (e.g. a pinned
// worker index that does not exist).
var ErrNoSelection = errors.New("policy made no selection")

// PolicyOptions carries the CLI tunables policies read. Zero values take
// sglang-router's defaults.
type PolicyOptions struct {
	CacheThreshold       float64       // cache_aware: min match rate to follow the cache (0.3)
	BalanceAbsThreshold  int64         // cache_aware, bucket: load spread that counts as imbalance (64)
	BalanceRelThreshold  float64       // ... and max > min × this (1.5)
	EvictionInterval     time.Duration // cache_aware: tree eviction period (60 s)
	MaxTreeSize          int64         // cache_aware: bytes for the whole tree (2^26)
	MaxIdle              time.Duration // manual: routing key idle eviction (4 h)
	AssignmentMode       string        // manual: random, min_load or min_group
	BucketAdjustInterval time.Duration // bucket: boundary rebalancing period (5 s)
	PrefixBytes          int           // prefix_hash: bytes of text hashed (1024 ≈ 256 tokens)
	LoadFactor           float64       // prefix_hash: max load over the mean before spilling (1.25)
	VirtualNodes         int           // consistent_hashing, prefix_hash: ring points per worker (160)
	Metrics              *Metrics
}

func (o PolicyOptions) withDefaults() PolicyOptions {
	if o.CacheThreshold == 0 {
		o.CacheThreshold = 0.3
	}
	if o.BalanceAbsThreshold == 0 {
		o.BalanceAbsThreshold = 64
	}
	if o.BalanceRelThreshold == 0 {
		o.BalanceRelThreshold = 1.5
	}
	if o.EvictionInterval <= 0 {
		o.EvictionInterval = 60 * time.Second
	}
	if o.MaxTreeSize <= 0 {
		o.MaxTreeSize = 1 << 26
	}
	if o.MaxIdle <= 0 {
		o.MaxIdle = 4 * time.Hour
	}
	if o.AssignmentMode == "" {
		o.AssignmentMode = "random"
	}
	if o.BucketAdjustInterval <= 0 {
		o.BucketAdjustInterval = 5 * time.Second
	}
	if o.PrefixBytes <= 0 {
		o.PrefixBytes = 1024
	}
	if o.LoadFactor <= 1 {
		o.LoadFactor = 1.25
	}
	if o.VirtualNodes <= 0 {
		o.VirtualNodes = 160
	}
	return o
}

// PolicyNames lists what NewPolicy accepts.
var PolicyNames = []string{"random", "round_robin", "power_of_two", "cache_aware", "consistent_hashing", "manual", "bucket", "prefix_hash"}

// NewPolicy builds a policy by its CLI name. Call it once per PD side: each
// side needs its own instance. Give it to Manager.AttachPolicy so policies
// with state see worker changes and run their background work.
func NewPolicy(name string, o PolicyOptions) (Policy, error) {
	switch name {
	case "random":
		return Random{}, nil
	case "round_robin":
		return &RoundRobin{}, nil
	case "power_of_two":
		return PowerOfTwo{}, nil
	case "cache_aware":
		return NewCacheAware(o), nil
	case "consistent_hashing":
		return NewConsistentHashing(o), nil
	case "manual":
		return NewManual(o), nil
	case "bucket":
		return NewBucket(o), nil
	case "prefix_hash":
		return NewPrefixHash(o), nil
	}
	return nil, fmt.Errorf("unknown policy %q", name)
}

// runEvery calls fn every period until ctx ends: the background work of
// policies that implement Runner.
func runEvery(ctx context.Context, period time.Duration, fn func()) {
	t := time.NewTicker(period)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			fn()
		}
	}
}
