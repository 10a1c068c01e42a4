package kvtransfer

import (
	"context"
	"fmt"
	"slices"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// confirm asks the peer, after an shm write copied the runs into its
// engine's memory, whether every region written into is still registered.
// The writer maps the peer's memfd itself, so a region the peer dropped
// while its table push was on the way still takes the bytes, into memory
// the engine no longer reads: without this the write would report them
// delivered (tcp's fence reports such DATA frames as dropped).
func (l *memLink) confirm(ctx context.Context, runs []memRun) error {
	l.mu.Lock()
	_, shm := l.ep.(*shmEndpoint)
	l.mu.Unlock()
	if !shm {
		return nil
	}
	var ids []uint32
	for _, r := range runs {
		if !slices.Contains(ids, r.dst.ID) {
			ids = append(ids, r.dst.ID)
		}
	}
	seq, ch, err := l.ask()
	if err != nil {
		return err
	}
	if err := l.conn.Write(&wire.MemFence{Seq: seq, Regions: ids}); err != nil {
		l.close(err)
		return err
	}
	m, err := l.await(ctx, seq, ch)
	if err != nil {
		return err
	}
	ack, ok := m.(*wire.MemFenceAck)
	if !ok {
		return fmt.Errorf("%w: %s answered a fence", wire.ErrMalformed, m.Type())
	}
	if ack.Err != "" {
		return fmt.Errorf("peer dropped data: %s", ack.Err)
	}
	return nil
}

// unregistered says which of the regions ids this plane no longer holds,
// for a fence's ack ("" when it holds them all).
func (p *MemoryPlane) unregistered(ids []uint32) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, id := range ids {
		if p.byID[id] == nil {
			return fmt.Sprintf("destination region %d is not registered (any more)", id)
		}
	}
	return ""
}
