package kvtransfer

import (
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// A write from one Place to another goes by the Path choosePath picks from
// the two places alone, so a link names its path for each pair of memory
// kinds before any byte moves, and a pair no path carries fails at once.
// GPUDIRECT.md is the design for a path that skips the staging.

// Place is where a region's bytes live.
type Place struct {
	Kind   wire.MemKind
	Device int // CUDA ordinal in the registering process; -1: host memory
	// Host is the machine's id (kvproxy's --host-id, default the boot id):
	// equal hosts share GPUs by IPC handle and memory by memfd.
	Host string
}

// HostPlace is host memory on host.
func HostPlace(host string) Place { return Place{Kind: wire.MemHost, Device: -1, Host: host} }

func (p Place) String() string {
	if p.Kind == wire.MemCUDA {
		return fmt.Sprintf("cuda:%d@%s", p.Device, p.Host)
	}
	return fmt.Sprintf("%s@%s", p.Kind, p.Host)
}

// Path is how a write moves bytes from one place to another.
type Path string

// The paths. Host-to-host writes go by the transport itself; device memory
// moves by a device copy on one host (same-gpu, p2p), or through pinned
// host staging buffers: scattered by the writing kvproxy itself between
// devices of one host without peer access (staged-local, stagelocal.go),
// else sent to the peer as DATA frames (staged-tcp, staging.go) or put by
// RMA into the peer's staging ring (staged-ucx, stageucx.go).
const (
	PathSameGPU     Path = "same-gpu"
	PathP2P         Path = "p2p"
	PathStagedLocal Path = "staged-local"
	PathStagedTCP   Path = "staged-tcp"
	PathStagedUCX   Path = "staged-ucx"
	PathSHM         Path = "shm"
	PathTCP         Path = "tcp"
	PathUCX         Path = "ucx"
)

// NoPathError is a pair of places no path carries, and why.
type NoPathError struct {
	Src, Dst  Place
	Transport string
	Why       string
}

func (e *NoPathError) Error() string {
	return fmt.Sprintf("no path from %s to %s over %s: %s", e.Src, e.Dst, e.Transport, e.Why)
}

// choosePath picks the path a write from src to dst takes with this
// transport ("tcp", "ucx" or "shm"); access reports whether device a can
// read and write device b's memory directly (nil: never).
func choosePath(transport string, src, dst Place, access func(a, b int) bool) (Path, error) {
	sameHost := src.Host == dst.Host && src.Host != ""
	noPath := func(why string) (Path, error) {
		return "", &NoPathError{Src: src, Dst: dst, Transport: transport, Why: why}
	}
	if src.Kind == wire.MemHost && dst.Kind == wire.MemHost {
		switch transport {
		case "shm":
			if !sameHost {
				return noPath("shm moves memory between engines of one host only")
			}
			return PathSHM, nil
		case "tcp":
			return PathTCP, nil
		case "ucx":
			return PathUCX, nil
		}
		return noPath("unknown transport")
	}
	if src.Kind == wire.MemCUDA && dst.Kind == wire.MemCUDA && sameHost {
		switch {
		case src.Device == dst.Device:
			return PathSameGPU, nil
		case access != nil && access(src.Device, dst.Device):
			return PathP2P, nil
		}
		return PathStagedLocal, nil
	}
	// Staged: shm has no socket of its own for DATA frames, but the link has.
	if transport == "ucx" {
		return PathStagedUCX, nil
	}
	return PathStagedTCP, nil
}
