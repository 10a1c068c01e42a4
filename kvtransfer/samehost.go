package kvtransfer

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// SHM is the same-host transport for engine-owned memory: the writing
// kvproxy maps the peer engine's memfd itself (opened through the peer
// kvproxy's /proc/PID/fd, so both run on one host under one user) and
// copies straight from its mapping of the local engine's memory into it:
// one memcpy, no socket, no UCX. UCX over shared memory cannot do that for
// memory it did not allocate (UCX 1.13's posix and sysv register no
// foreign memory and fall back to active messages).
type SHM struct {
	TCP
	live shmLiveness
	// HostID is this machine's id (default: the boot id); peers whose id
	// differs are on another host (kvproxy --host-id).
	HostID string
}

var _ Transport = (*SHM)(nil)

func (*SHM) Name() string { return "shm" }

// shmKeyLen is a packed key: boot id (36 bytes, text), pid, fd, the
// memfd's inode (so a reused fd number is never mistaken for it), the
// mapping's address in the peer kvproxy and its length; then where the
// registration's liveness word is: the fd and inode of the liveness memfd,
// the word's index and the token it holds while the region is registered.
const shmKeyLen = 36 + 4 + 4 + 8 + 8 + 8 + 4 + 8 + 4 + 8

var bootID = sync.OnceValues(func() ([]byte, error) {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return nil, fmt.Errorf("shm transport: boot id: %w", err)
	}
	id := []byte(strings.TrimSpace(string(b)))
	if len(id) != 36 {
		return nil, fmt.Errorf("shm transport: boot id %q", id)
	}
	return id, nil
})

type shmRegistration struct {
	mem  []byte
	key  []byte
	live *shmLiveness
	slot uint32
}

func (r *shmRegistration) RKey() []byte { return r.key }

// Close marks the region gone before the engine hears it is unregistered.
func (r *shmRegistration) Close() error {
	r.live.release(r.slot)
	return nil
}

// RegisterMemory publishes where a peer finds the memfd (this process and
// the fd's number in it) and the region's liveness word.
func (t *SHM) RegisterMemory(b []byte, fd int) (MemoryRegistration, error) {
	id, err := bootID()
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if fd < 0 || unix.Fstat(fd, &st) != nil {
		return nil, errors.New("shm transport: no memfd")
	}
	liveFd, liveIno, slot, token, err := t.live.take()
	if err != nil {
		return nil, err
	}
	k := append([]byte(nil), id...)
	k = binary.LittleEndian.AppendUint32(k, uint32(os.Getpid()))
	k = binary.LittleEndian.AppendUint32(k, uint32(fd))
	k = binary.LittleEndian.AppendUint64(k, st.Ino)
	k = binary.LittleEndian.AppendUint64(k, uint64(uintptr(unsafe.Pointer(unsafe.SliceData(b)))))
	k = binary.LittleEndian.AppendUint64(k, uint64(len(b)))
	k = binary.LittleEndian.AppendUint32(k, uint32(liveFd))
	k = binary.LittleEndian.AppendUint64(k, liveIno)
	k = binary.LittleEndian.AppendUint32(k, slot)
	k = binary.LittleEndian.AppendUint64(k, token)
	return &shmRegistration{mem: b, key: k, live: &t.live, slot: slot}, nil
}

// WorkerAddress is the host id: peers on another host fail at once.
func (s *SHM) WorkerAddress() ([]byte, error) {
	if s.HostID != "" {
		return []byte(s.HostID), nil
	}
	return bootID()
}

func (s *SHM) MemoryEndpoint(addr []byte) (MemoryEndpoint, error) {
	id, err := s.WorkerAddress()
	if err != nil {
		return nil, err
	}
	if !bytes.Equal(addr, id) {
		return nil, errors.New("shm transport: the peer kvproxy runs on another host")
	}
	return &shmEndpoint{lives: map[shmFile][]uint64{}}, nil
}

// shmEndpoint holds the peer mappings it opened, until it closes: mu is
// read-held by writes, so Close never unmaps under a copy.
type shmEndpoint struct {
	mu     sync.RWMutex
	maps   []*shmMapping
	lives  map[shmFile][]uint64 // peer liveness memfds mapped here, till Close
	closed bool
}

// shmMapping is a peer engine's memory mapped here; base is the peer
// kvproxy's address of it, which MemoryOp.Remote is relative to. live is
// the region's liveness word in the peer, holding token while registered.
type shmMapping struct {
	mem   []byte
	base  uint64
	live  *uint64
	token uint64
}

func (e *shmEndpoint) Unpack(rkey []byte) (RemoteKey, error) {
	if len(rkey) != shmKeyLen {
		return nil, fmt.Errorf("shm transport: key of %d bytes", len(rkey))
	}
	pid := binary.LittleEndian.Uint32(rkey[36:])
	fd := binary.LittleEndian.Uint32(rkey[40:])
	ino := binary.LittleEndian.Uint64(rkey[44:])
	base := binary.LittleEndian.Uint64(rkey[52:])
	n := binary.LittleEndian.Uint64(rkey[60:])
	liveFile := shmFile{pid, binary.LittleEndian.Uint32(rkey[68:]), binary.LittleEndian.Uint64(rkey[72:])}
	slot, token := binary.LittleEndian.Uint32(rkey[80:]), binary.LittleEndian.Uint64(rkey[84:])
	words, err := e.liveness(liveFile)
	if err != nil {
		return nil, err
	}
	if int(slot) >= len(words) {
		return nil, fmt.Errorf("shm transport: liveness word %d of %d", slot, len(words))
	}
	live := &words[slot]
	ptr, err := mapPeer(shmFile{pid, fd, ino}, n, "memfd", unix.MAP_POPULATE)
	if err != nil {
		return nil, err
	}
	m := &shmMapping{mem: unsafe.Slice((*byte)(ptr), n), base: base, live: live, token: token}
	if atomic.LoadUint64(live) != token {
		return nil, errors.Join(errors.New("shm transport: the peer region is not registered any more"), unmap(m.mem))
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errors.Join(errors.New("shm transport: endpoint closed"), unmap(m.mem))
	}
	e.maps = append(e.maps, m)
	return m, nil
}

// Put copies every op; the bytes are in the peer's memory when it returns.
func (e *shmEndpoint) Put(ctx context.Context, ops []MemoryOp) error {
	e.mu.RLock()
	defer e.mu.RUnlock()
	if e.closed {
		return errors.New("shm transport: endpoint closed")
	}
	for i, o := range ops {
		if i%64 == 0 && ctx.Err() != nil {
			return ctx.Err()
		}
		reg, ok1 := o.Local.(*shmRegistration)
		m, ok2 := o.Key.(*shmMapping)
		if !ok1 || !ok2 {
			return fmt.Errorf("shm put: op %d has a registration or key of another transport", i)
		}
		off := o.Remote - m.base
		if o.Remote < m.base || off > uint64(len(m.mem)) || o.Len > uint64(len(m.mem))-off ||
			o.LocalOff > uint64(len(reg.mem)) || o.Len > uint64(len(reg.mem))-o.LocalOff {
			return fmt.Errorf("shm put: op %d outside its regions", i)
		}
		copy(m.mem[off:off+o.Len], reg.mem[o.LocalOff:o.LocalOff+o.Len])
	}
	// The peer may have dropped a region while its table push, which makes
	// us forget the key, was on the way: the bytes then went into memory the
	// engine no longer reads. An atomic read-modify-write is a full barrier
	// (the copies are visible before it), and the peer clears the word
	// before its engine hears the region is unregistered, so a word still
	// holding the token means the bytes landed while it was registered.
	for i, o := range ops {
		if m := o.Key.(*shmMapping); atomic.AddUint64(m.live, 0) != m.token {
			return fmt.Errorf("shm put: op %d: the peer dropped the destination region during the write", i)
		}
	}
	return nil
}

func (e *shmEndpoint) Forget(k RemoteKey) {
	m, ok := k.(*shmMapping)
	if !ok {
		return
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if i := slices.Index(e.maps, m); i >= 0 {
		_ = unmap(m.mem)
		e.maps = slices.Delete(e.maps, i, i+1)
	}
}

func (e *shmEndpoint) Close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	for _, m := range e.maps {
		_ = unmap(m.mem)
	}
	e.maps = nil
	for _, w := range e.lives {
		_ = unmap(wordBytes(w))
	}
	e.lives = nil
}

// shmFile names a memfd of a peer process.
type shmFile struct {
	pid, fd uint32
	ino     uint64
}

// liveness maps the peer's liveness memfd f once per endpoint.
func (e *shmEndpoint) liveness(f shmFile) ([]uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if w, ok := e.lives[f]; ok {
		return w, nil
	}
	if e.closed {
		return nil, errors.New("shm transport: endpoint closed")
	}
	ptr, err := mapPeer(f, shmLiveBytes, "liveness memfd", 0)
	if err != nil {
		return nil, err
	}
	w := unsafe.Slice((*uint64)(ptr), shmLiveWords)
	e.lives[f] = w
	return w, nil
}

// mapPeer maps n bytes of memfd f of a peer kvproxy, checking that it is
// still the file the key named (by inode) and holds them.
func mapPeer(f shmFile, n uint64, what string, flags int) (unsafe.Pointer, error) {
	path := fmt.Sprintf("/proc/%d/fd/%d", f.pid, f.fd)
	fd, err := unix.Open(path, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm transport: open the peer's %s %s (both kvproxies must run under one user): %w", what, path, err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Ino != f.ino || uint64(st.Size) < n || n == 0 {
		return nil, fmt.Errorf("shm transport: %s is not the peer's %s of %d bytes any more (inode %d, size %d): %v", path, what, n, st.Ino, st.Size, err)
	}
	ptr, err := unix.MmapPtr(fd, 0, nil, uintptr(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|flags)
	if err != nil {
		return nil, fmt.Errorf("shm transport: map the peer's %s: %w", what, err)
	}
	return ptr, nil
}

// shmLiveWords bounds the regions one kvproxy registers at once (a peer
// table holds at most 4096).
const (
	shmLiveWords = 4096
	shmLiveBytes = shmLiveWords * 8
)

// shmLiveness is a memfd of words, one per registered region, which its
// writers map: a word holds its registration's token while the region is
// registered and 0 after. Tokens are never reused, so a reused word is
// never mistaken for the region that had it.
type shmLiveness struct {
	mu    sync.Mutex
	fd    int // 0: not made yet
	ino   uint64
	words []uint64
	free  []uint32
	used  uint32 // words handed out so far
	token uint64
}

// take hands out a word holding a fresh token.
func (l *shmLiveness) take() (fd int, ino uint64, slot uint32, token uint64, err error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.words == nil {
		if err := l.make(); err != nil {
			return 0, 0, 0, 0, err
		}
	}
	switch {
	case len(l.free) > 0:
		slot, l.free = l.free[len(l.free)-1], l.free[:len(l.free)-1]
	case l.used < shmLiveWords:
		slot = l.used
		l.used++
	default:
		return 0, 0, 0, 0, fmt.Errorf("shm transport: %d regions registered, at most %d", shmLiveWords, shmLiveWords)
	}
	l.token++
	atomic.StoreUint64(&l.words[slot], l.token)
	return l.fd, l.ino, slot, l.token, nil
}

func (l *shmLiveness) release(slot uint32) {
	l.mu.Lock()
	defer l.mu.Unlock()
	atomic.StoreUint64(&l.words[slot], 0) // a full barrier: before any reply to the engine
	l.free = append(l.free, slot)
}

// make creates the memfd; it lives as long as the process (peers hold keys
// naming it).
func (l *shmLiveness) make() error {
	fd, err := unix.MemfdCreate("kvproxy-shm-live", unix.MFD_CLOEXEC)
	if err != nil {
		return fmt.Errorf("shm transport: liveness memfd: %w", err)
	}
	var st unix.Stat_t
	var ptr unsafe.Pointer
	if err = unix.Ftruncate(fd, shmLiveBytes); err == nil {
		err = unix.Fstat(fd, &st)
	}
	if err == nil {
		ptr, err = unix.MmapPtr(fd, 0, nil, shmLiveBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	}
	if err != nil {
		unix.Close(fd)
		return fmt.Errorf("shm transport: liveness memfd: %w", err)
	}
	l.fd, l.ino, l.words = fd, st.Ino, unsafe.Slice((*uint64)(ptr), shmLiveWords)
	return nil
}

func wordBytes(w []uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), len(w)*8)
}
