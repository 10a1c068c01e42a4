package balancer

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func keyOwners(t *testing.T, p Policy, ws []*Worker, keys int) []string {
	t.Helper()
	out := make([]string, keys)
	for i := range out {
		w, err := p.Select(ws, withHeaders(HeaderRoutingKey, fmt.Sprintf("session-%d", i)))
		if err != nil {
			t.Fatal(err)
		}
		out[i] = w.URL
	}
	return out
}

func TestConsistentHashingStableUnderChanges(t *testing.T) {
	const keys = 10000
	ws := testWorkers(11)
	ch := NewConsistentHashing(PolicyOptions{})
	base := keyOwners(t, ch, ws[:10], keys)
	if again := keyOwners(t, ch, ws[:10], keys); !slices.Equal(base, again) {
		t.Fatal("same key, same pool, different worker")
	}
	// Adding an 11th worker should move about 1/11 of the keys, all to it.
	added := keyOwners(t, ch, ws, keys)
	moved := 0
	for i := range added {
		if added[i] != base[i] {
			moved++
			if added[i] != ws[10].URL {
				t.Fatalf("key %d moved between old workers", i)
			}
		}
	}
	if f := float64(moved) / keys; f < 0.05 || f > 0.14 {
		t.Fatalf("adding 1 of 11 workers moved %.3f of keys, want ≈ 0.09", f)
	}
	// Removing a worker moves only its own keys.
	removed := keyOwners(t, ch, slices.Delete(slices.Clone(ws[:10]), 3, 4), keys)
	for i := range removed {
		if removed[i] != base[i] && base[i] != ws[3].URL {
			t.Fatalf("key %d moved though its worker stayed", i)
		}
	}
	// Keys spread over all workers.
	per := map[string]int{}
	for _, u := range base {
		per[u]++
	}
	for _, w := range ws[:10] {
		if per[w.URL] < keys/10/2 || per[w.URL] > keys/10*2 {
			t.Fatalf("uneven ring: %v", per)
		}
	}
}

func TestConsistentHashingHeaders(t *testing.T) {
	ws := testWorkers(4)
	ch := NewConsistentHashing(PolicyOptions{})
	if w, err := ch.Select(ws, withHeaders(HeaderTargetWorker, "2", HeaderRoutingKey, "k")); err != nil || w != ws[2] {
		t.Fatalf("target worker pin: %v %v", w, err)
	}
	for _, bad := range []string{"4", "-1", "x"} {
		if _, err := ch.Select(ws, withHeaders(HeaderTargetWorker, bad)); !errors.Is(err, ErrNoSelection) {
			t.Fatalf("pin %q: %v, want ErrNoSelection", bad, err)
		}
	}
	byKey, _ := ch.Select(ws, withHeaders(HeaderRoutingKey, "tok"))
	for _, h := range []string{"Authorization", "X-Forwarded-For", "Cookie"} {
		if w, _ := ch.Select(ws, withHeaders(h, "tok")); w != byKey {
			t.Fatalf("implicit key %s not hashed like the routing key", h)
		}
	}
	// The routing key outranks implicit keys.
	a, _ := ch.Select(ws, withHeaders(HeaderRoutingKey, "tok", "Authorization", "other"))
	if a != byKey {
		t.Fatal("authorization overrode X-SMG-Routing-Key")
	}
	seen := map[*Worker]bool{}
	for range 200 {
		w, _ := ch.Select(ws, &Request{})
		seen[w] = true
	}
	if len(seen) < 3 {
		t.Fatal("requests without any key are not spread at random")
	}
}

// X-SMG-Target-Worker indexes the pool's workers in service, not one
// attempt's candidates: a retry that leaves out the worker it failed on
// still reaches the pinned worker, and an unhealthy worker shifts the index
// as the available list does.
func TestTargetWorkerIndexesThePool(t *testing.T) {
	ws := testWorkers(3)
	ch := NewConsistentHashing(PolicyOptions{})
	req := withHeaders(HeaderTargetWorker, "1")
	req.Pool = ws
	if w, err := ch.Select([]*Worker{ws[0], ws[2]}, req); w != ws[1] {
		t.Fatalf("index 1 with ws[1] left out of the candidates: %v %v, want ws[1]", w, err)
	}
	ws[0].SetHealthy(false)
	if w, _ := ch.Select(ws[1:], req); w != ws[2] {
		t.Fatalf("index 1 with ws[0] unhealthy: %v, want ws[2]", w)
	}
	req = withHeaders(HeaderTargetWorker, "2")
	req.Pool = ws
	if _, err := ch.Select(ws[1:], req); !errors.Is(err, ErrNoSelection) {
		t.Fatalf("index 2 of 2 in service: %v, want ErrNoSelection", err)
	}
}
