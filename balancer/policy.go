package balancer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// Request is what a policy may look at. Text is only filled when the policy
// says it needs it (NeedsText), because extracting it costs a scan.
type Request struct {
	Text   string
	Model  string  // model the request asks for; "" = the default tree/pool
	Header Headers // the request's headers; may be nil
	// Pool is the side's registered workers (Snapshot.ByType), which
	// X-SMG-Target-Worker indexes among those in service; nil: the workers
	// Select is given.
	Pool []*Worker
}

// target is the worker X-SMG-Target-Worker's index i names: the i-th in
// service of the pool (healthy, not ejected), whichever of them the router
// leaves out of one attempt's candidates (workers the request failed on,
// suspects), so that an index names the same worker on every attempt.
func (r *Request) target(workers []*Worker, i int) *Worker {
	if r == nil || r.Pool == nil {
		if i < 0 || i >= len(workers) {
			return nil
		}
		return workers[i]
	}
	for _, w := range r.Pool {
		if i >= 0 && w.inService() {
			if i == 0 {
				return w
			}
			i--
		}
	}
	return nil
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
// DefaultPolicyOptions' values.
type PolicyOptions struct {
	CacheThreshold       float64       // cache_aware: min match rate to follow the cache
	BalanceAbsThreshold  int64         // cache_aware, bucket: load spread that counts as imbalance
	BalanceRelThreshold  float64       // ... and max > min × this
	EvictionInterval     time.Duration // cache_aware: tree eviction period
	MaxTreeSize          int64         // cache_aware: bytes for the whole tree
	MaxIdle              time.Duration // manual: routing key idle eviction
	AssignmentMode       string        // manual: one of AssignmentModes
	BucketAdjustInterval time.Duration // bucket: boundary rebalancing period
	PrefixBytes          int           // prefix_hash: bytes of text hashed (≈ 4 bytes a token)
	LoadFactor           float64       // prefix_hash: max load over the mean before spilling; > 1
	VirtualNodes         int           // consistent_hashing, prefix_hash: ring points per worker
	Metrics              *Metrics
}

// DefaultPolicyOptions are sglang-router 0.3.x's defaults, plus pdrouter's
// own for prefix_hash.
func DefaultPolicyOptions() PolicyOptions {
	return PolicyOptions{
		CacheThreshold:       0.3,
		BalanceAbsThreshold:  64,
		BalanceRelThreshold:  1.5,
		EvictionInterval:     60 * time.Second,
		MaxTreeSize:          1 << 26,
		MaxIdle:              4 * time.Hour,
		AssignmentMode:       "random",
		BucketAdjustInterval: 5 * time.Second,
		PrefixBytes:          1024,
		LoadFactor:           1.25,
		VirtualNodes:         160,
	}
}

// AssignmentModes are the manual policy's ways to place a new routing key.
func AssignmentModes() []string { return []string{"random", "min_load", "min_group"} }

func (o PolicyOptions) withDefaults() PolicyOptions {
	d := DefaultPolicyOptions()
	o.CacheThreshold = cmp.Or(o.CacheThreshold, d.CacheThreshold)
	o.BalanceAbsThreshold = cmp.Or(o.BalanceAbsThreshold, d.BalanceAbsThreshold)
	o.BalanceRelThreshold = cmp.Or(o.BalanceRelThreshold, d.BalanceRelThreshold)
	o.AssignmentMode = cmp.Or(o.AssignmentMode, d.AssignmentMode)
	o.EvictionInterval = positiveOr(o.EvictionInterval, d.EvictionInterval)
	o.MaxTreeSize = positiveOr(o.MaxTreeSize, d.MaxTreeSize)
	o.MaxIdle = positiveOr(o.MaxIdle, d.MaxIdle)
	o.BucketAdjustInterval = positiveOr(o.BucketAdjustInterval, d.BucketAdjustInterval)
	o.PrefixBytes = positiveOr(o.PrefixBytes, d.PrefixBytes)
	o.VirtualNodes = positiveOr(o.VirtualNodes, d.VirtualNodes)
	if o.LoadFactor <= 1 {
		o.LoadFactor = d.LoadFactor
	}
	return o
}

// positiveOr is v, or def when v is not positive: a period or a size of zero
// or less would stop a ticker or an index, so both mean "unset".
func positiveOr[T int | int64 | time.Duration](v, def T) T {
	if v <= 0 {
		return def
	}
	return v
}

// PolicyInfo is one row of the policy table, which drives NewPolicy, the
// CLI's choices and its --help, and router.Config's validation.
type PolicyInfo struct {
	Name        string
	Summary     string // one line for --help
	PrefillOnly bool   // only as a PD deployment's prefill policy
	ReadsLoad   bool   // reads engine-reported loads, so the Manager polls /get_load
	build       func(PolicyOptions) Policy
}

var policyTable = []PolicyInfo{
	{Name: "random", Summary: "a worker drawn uniformly", build: func(PolicyOptions) Policy { return Random{} }},
	{Name: "round_robin", Summary: "the workers in turn", build: func(PolicyOptions) Policy { return &RoundRobin{} }},
	{Name: "cache_aware", Summary: "the worker most likely to hold the prompt's prefix in cache, unless loads are unbalanced",
		build: func(o PolicyOptions) Policy { return NewCacheAware(o) }},
	{Name: "power_of_two", Summary: "the less loaded of two random workers (engine-reported load)", ReadsLoad: true,
		build: func(PolicyOptions) Policy { return PowerOfTwo{} }},
	{Name: "manual", Summary: "sticky by X-SMG-Routing-Key; new keys by --assignment-mode", build: func(o PolicyOptions) Policy { return NewManual(o) }},
	{Name: "consistent_hashing", Summary: "a hash ring over X-SMG-Routing-Key or an implicit key (auth, client address, cookie)",
		build: func(o PolicyOptions) Policy { return NewConsistentHashing(o) }},
	{Name: "prefix_hash", Summary: "a hash ring over the prompt's first bytes, spilling past loaded workers",
		build: func(o PolicyOptions) Policy { return NewPrefixHash(o) }},
	{Name: "bucket", Summary: "prompt-length buckets, one per worker", PrefillOnly: true,
		build: func(o PolicyOptions) Policy { return NewBucket(o) }},
}

// Policies lists the policy table in --help order.
func Policies() []PolicyInfo { return slices.Clone(policyTable) }

// PolicyNames lists the names of the policies that may serve a side: every
// policy for a PD prefill side, the others elsewhere.
func PolicyNames(prefill bool) []string {
	var names []string
	for _, p := range policyTable {
		if prefill || !p.PrefillOnly {
			names = append(names, p.Name)
		}
	}
	return names
}

// LookupPolicy finds a row of the policy table by name.
func LookupPolicy(name string) (PolicyInfo, bool) {
	i := slices.IndexFunc(policyTable, func(p PolicyInfo) bool { return p.Name == name })
	if i < 0 {
		return PolicyInfo{}, false
	}
	return policyTable[i], true
}

// NewPolicy builds a policy by its CLI name. Call it once per PD side: each
// side needs its own instance. Give it to Manager.AttachPolicy so policies
// with state see worker changes and run their background work.
func NewPolicy(name string, o PolicyOptions) (Policy, error) {
	p, ok := LookupPolicy(name)
	if !ok {
		return nil, fmt.Errorf("unknown policy %q", name)
	}
	return p.build(o), nil
}
