package kvtransfer

import (
	"context"
	"sync"
)

// dialOnce shares one dial per address among the callers that ask for it
// at the same time.
type dialOnce[T any] map[string]*dialCall[T]

type dialCall[T any] struct {
	done chan struct{}
	v    T
	err  error
}

// get returns have()'s connection to addr if there is one, else the result
// of a single dial() shared with concurrent callers; a caller whose ctx
// ends stops waiting, the dial goes on for the others. mu guards d and
// whatever have reads; dial runs without it.
func (d dialOnce[T]) get(ctx context.Context, mu *sync.Mutex, addr string, have func() (T, bool), dial func() (T, error)) (T, error) {
	mu.Lock()
	if v, ok := have(); ok {
		mu.Unlock()
		return v, nil
	}
	c := d[addr]
	if c == nil {
		c = &dialCall[T]{done: make(chan struct{})}
		d[addr] = c
		mu.Unlock()
		c.v, c.err = dial()
		mu.Lock()
		delete(d, addr)
		mu.Unlock()
		close(c.done)
		return c.v, c.err
	}
	mu.Unlock()
	select {
	case <-c.done:
		return c.v, c.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}
