package balancer

import "math/rand/v2"

// Random picks uniformly.
type Random struct{}

func (Random) Name() string    { return "random" }
func (Random) NeedsText() bool { return false }
func (Random) Select(workers []*Worker, _ *Request) (*Worker, error) {
	return workers[rand.IntN(len(workers))], nil
}
