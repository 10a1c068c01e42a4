// Package shm is the KV pool's shared memory: a file (memfd, or the shm file
// UCX allocated) that the kvproxy maps and passes to its engine
// (SCM_RIGHTS), which maps it too, so pages move between the two processes'
// views without a copy.
package shm

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Segment is one mapping of a shared-memory file and an fd for that file.
type Segment struct {
	fd    int
	Mem   []byte
	unmap bool // false: another owner (UCX) unmaps Mem
}

// Create makes a memfd of size bytes and maps it.
func Create(name string, size int) (*Segment, error) {
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(size)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("ftruncate memfd to %d: %w", size, err)
	}
	s, err := Map(fd)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return s, nil
}

// Map maps the whole file behind fd (shared, read-write) and takes
// ownership of fd.
func Map(fd int) (*Segment, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("fstat: %w", err)
	}
	if st.Size <= 0 {
		return nil, fmt.Errorf("shared segment is empty")
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap %d bytes: %w", st.Size, err)
	}
	return &Segment{fd: fd, Mem: mem, unmap: true}, nil
}

// ErrNotShared means memory is not a shared mapping of a file this process
// holds open, so no other process can map it.
var ErrNotShared = errors.New("not a shared file mapping with an open fd")

// Find returns a Segment for mem, memory someone else mapped (UCX's posix
// allocator: a deleted /dev/shm file kept open). It looks the mapping up in
// /proc/self/maps and finds an open fd on the same file; mem must start at
// file offset 0. The Segment holds a duplicate of that fd; its Close closes
// only the duplicate, never unmapping mem.
func Find(mem []byte) (*Segment, error) {
	if len(mem) == 0 {
		return nil, errors.New("shm: find: empty memory")
	}
	dev, ino, err := mappedFile(uint64(uintptr(unsafe.Pointer(unsafe.SliceData(mem)))), uint64(len(mem)))
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return nil, err
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		var st unix.Stat_t
		if unix.Fstat(fd, &st) != nil || st.Dev != dev || st.Ino != ino {
			continue
		}
		dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("shm: dup fd %d: %w", fd, err)
		}
		return &Segment{fd: dup, Mem: mem}, nil
	}
	return nil, fmt.Errorf("shm: find: %w (no fd on device %d inode %d)", ErrNotShared, dev, ino)
}

// mappedFile returns the device and inode of the shared file mapping that
// covers [addr, addr+n) from file offset 0.
func mappedFile(addr, n uint64) (dev, ino uint64, err error) {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset major:minor inode [path]
		fs := strings.Fields(sc.Text())
		if len(fs) < 5 {
			continue
		}
		lo, hi, ok := strings.Cut(fs[0], "-")
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if !ok || err1 != nil || err2 != nil || addr < start || addr >= end {
			continue
		}
		off, _ := strconv.ParseUint(fs[2], 16, 64)
		maj, min, _ := strings.Cut(fs[3], ":")
		ma, _ := strconv.ParseUint(maj, 16, 32)
		mi, _ := strconv.ParseUint(min, 16, 32)
		ino, _ = strconv.ParseUint(fs[4], 10, 64)
		switch {
		case !strings.Contains(fs[1], "s") || ino == 0:
			return 0, 0, fmt.Errorf("shm: find: %w (mapping %s %s is private or anonymous)", ErrNotShared, fs[0], fs[1])
		case off+addr-start != 0 || end-addr < n:
			return 0, 0, fmt.Errorf("shm: find: %w (mapping %s does not hold [%#x,+%d) from offset 0)", ErrNotShared, fs[0], addr, n)
		}
		return unix.Mkdev(uint32(ma), uint32(mi)), ino, nil
	}
	if err := sc.Err(); err != nil {
		return 0, 0, err
	}
	return 0, 0, fmt.Errorf("shm: find: %#x is not mapped", addr)
}

// Fd is the file's fd, to pass to the other process.
func (s *Segment) Fd() int { return s.fd }

// Close closes the fd and unmaps the segment unless another owner maps it.
func (s *Segment) Close() error {
	var err error
	if s.unmap {
		err = unix.Munmap(s.Mem)
	}
	s.Mem = nil
	if cerr := unix.Close(s.fd); err == nil {
		err = cerr
	}
	return err
}
