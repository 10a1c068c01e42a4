package balancer

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
)

// Request is what a policy may look at. Text is only filled when the policy
// says it needs it (NeedsText), because extracting it costs a scan.
type Request struct {
	Text   string
	Header func(name string) string // case-insensitive request header lookup; may be nil
}

// Policy picks one worker out of the available ones. Implementations must be
// safe for concurrent use; workers is never empty and must not be modified.
type Policy interface {
	Name() string
	NeedsText() bool
	Select(workers []*Worker, req *Request) (*Worker, error)
}

// ErrNoSelection is returned by a policy that cannot choose (e.g. a pinned
// worker index that does not exist).
var ErrNoSelection = errors.New("policy made no selection")

// PolicyOptions carries the CLI tunables policies read.
type PolicyOptions struct{}

// NewPolicy builds a policy by its CLI name.
func NewPolicy(name string, _ PolicyOptions) (Policy, error) {
	switch name {
	case "random":
		return Random{}, nil
	case "round_robin":
		return &RoundRobin{}, nil
	}
	return nil, fmt.Errorf("unknown policy %q", name)
}

// Random picks uniformly.
type Random struct{}

func (Random) Name() string    { return "random" }
func (Random) NeedsText() bool { return false }
func (Random) Select(workers []*Worker, _ *Request) (*Worker, error) {
	return workers[rand.IntN(len(workers))], nil
}

// RoundRobin cycles through the available workers with one atomic counter.
type RoundRobin struct{ next atomic.Uint64 }

func (*RoundRobin) Name() string    { return "round_robin" }
func (*RoundRobin) NeedsText() bool { return false }
func (r *RoundRobin) Select(workers []*Worker, _ *Request) (*Worker, error) {
	n := r.next.Add(1) - 1
	return workers[n%uint64(len(workers))], nil
}
