package kvtransfer

import "github.com/pdrouter/pdrouter/kvtransfer/wire"

// Bounds of the writes Immediate admits: a copy this small takes less
// than handing the call to another goroutine.
const (
	immediateMax     = 64 << 10
	immediateTriples = 64
)

// Immediate reports whether a write of ts to peer completes without
// waiting on the network: host memory over shm into host memory the link's
// table already lists (a copy into the peer engine's mapping), the link to
// peer up, at most immediateTriples ranges and immediateMax bytes. The
// control server runs such a write in its read loop instead of handing it
// to a worker; anything else (a GPU end, a destination only a table
// refresh would find) may wait on the peer and goes to a worker.
func (p *MemoryPlane) Immediate(peer string, ts []Triple) bool {
	if p.hostPath != PathSHM || len(ts) == 0 || len(ts) > immediateTriples {
		return false
	}
	var n uint64
	for _, t := range ts {
		if t.Len > immediateMax-n {
			return false
		}
		n += t.Len
	}
	p.mu.Lock()
	l := p.byAddr[peer]
	p.mu.Unlock()
	if l == nil || p.gpu.holds(ts) {
		return false
	}
	for _, t := range ts {
		if r, ok := l.remoteRegion(t.Dst, t.Len); !ok || r.Kind != wire.MemHost {
			return false
		}
	}
	return true
}
