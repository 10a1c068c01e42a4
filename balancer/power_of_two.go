package balancer

import "math/rand/v2"

// PowerOfTwo draws two distinct workers and takes the less loaded (spec
// §4.3). Load is the engine's /get_load report when both have one (the
// Manager polls it when LoadPollInterval > 0), else the router's in-flight
// count. Reports are stale between polls, so each is advanced by the
// requests routed since, priced at the pair's tokens per request: an engine
// that looked idle at the last poll stops looking idle after a few picks.
type PowerOfTwo struct{}

func (PowerOfTwo) Name() string    { return "power_of_two" }
func (PowerOfTwo) NeedsText() bool { return false }

func (PowerOfTwo) Select(workers []*Worker, _ *Request) (*Worker, error) {
	n := len(workers)
	if n == 1 {
		return workers[0], nil
	}
	i := rand.IntN(n)
	j := rand.IntN(n - 1)
	if j >= i {
		j++
	}
	a, b := workers[i], workers[j]
	if loadB, loadA := pairLoads(b, a); loadB < loadA {
		return b, nil
	}
	return a, nil
}

func pairLoads(a, b *Worker) (int64, int64) {
	ra, pa, oka := a.reportedSample()
	rb, pb, okb := b.reportedSample()
	la, lb := a.Load(), b.Load()
	if !oka || !okb {
		return la, lb
	}
	perReq := int64(1) // tokens one routed request is worth
	if pa+pb > 0 {
		perReq = max(1, (ra+rb)/(pa+pb))
	}
	return ra + max(0, la-pa)*perReq, rb + max(0, lb-pb)*perReq
}
