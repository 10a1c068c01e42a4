package kvtransfer

// immediateMax bounds the writes Immediate admits: a copy this small
// takes less than handing the call to another goroutine.
const immediateMax = 64 << 10

// Immediate reports whether a write of ts to peer completes without
// waiting on the network: host memory over shm (a copy into the peer
// engine's mapping), the link to peer already up, at most immediateMax
// bytes. The control server runs such a write in its read loop instead of
// handing it to a worker. (A destination the link's table lacks still
// costs one table round trip, bounded by the write's deadline.)
func (p *MemoryPlane) Immediate(peer string, ts []Triple) bool {
	if p.hostPath != PathSHM || len(ts) == 0 {
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
	return l != nil && !p.gpu.holds(ts)
}
