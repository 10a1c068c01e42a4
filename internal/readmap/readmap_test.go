package readmap

import (
	"strconv"
	"sync"
	"testing"
)

func TestLoadOrStoreKeepsTheFirstValue(t *testing.T) {
	var m Map[string, int]
	if _, ok := m.Load("a"); ok {
		t.Fatal("empty map has a value")
	}
	if v := m.LoadOrStore("a", 1); v != 1 {
		t.Fatalf("first store returned %d", v)
	}
	if v := m.LoadOrStore("a", 2); v != 1 {
		t.Fatalf("second store returned %d, want the first value", v)
	}
	m.LoadOrStore("b", 3)
	if v, ok := m.Load("a"); !ok || v != 1 {
		t.Fatalf("a = %d %v after adding b", v, ok)
	}
	if v, ok := m.Load("b"); !ok || v != 3 {
		t.Fatalf("b = %d %v", v, ok)
	}
}

// Readers racing with adders always see a key's one value (go test -race).
func TestConcurrentAddsAgreeOnOneValue(t *testing.T) {
	var m Map[int, *int]
	const keys, goroutines = 50, 8
	got := make([][keys]*int, goroutines)
	var wg sync.WaitGroup
	for g := range goroutines {
		wg.Go(func() {
			for k := range keys {
				v := new(int)
				got[g][k] = m.LoadOrStore(k, v)
				if l, ok := m.Load(k); !ok || l != got[g][k] {
					t.Errorf("goroutine %d key %d: Load %p %v, LoadOrStore %p", g, k, l, ok, got[g][k])
				}
			}
		})
	}
	wg.Wait()
	for g := 1; g < goroutines; g++ {
		if got[g] != got[0] {
			t.Fatalf("goroutine %d saw other values than goroutine 0", g)
		}
	}
}

type key struct {
	a, b string
	n    uint8
	f    bool
}

// The router's lookup: a struct key with strings, against sync.Map's.
func BenchmarkLoad(b *testing.B) {
	keys := make([]key, 8)
	for i := range keys {
		keys[i] = key{"regular", "model-" + strconv.Itoa(i), uint8(i), i%2 == 0}
	}
	b.Run("readmap", func(b *testing.B) {
		var m Map[key, int]
		for i, k := range keys {
			m.LoadOrStore(k, i)
		}
		for i := 0; b.Loop(); i++ {
			if _, ok := m.Load(keys[i%len(keys)]); !ok {
				b.Fatal("missing")
			}
		}
	})
	b.Run("sync.Map", func(b *testing.B) {
		var m sync.Map
		for i, k := range keys {
			m.Store(k, i)
		}
		for i := 0; b.Loop(); i++ {
			if _, ok := m.Load(keys[i%len(keys)]); !ok {
				b.Fatal("missing")
			}
		}
	})
}
