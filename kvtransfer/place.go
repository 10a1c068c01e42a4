package kvtransfer

import (
	"fmt"

	"github.com/pdrouter/pdrouter/kvtransfer/wire"
)

// The memory plane's seam. Every registered region has a Place: the kind
// of memory it is (host or CUDA), the device it lives on and the host that
// holds it. A write from one place to another goes by one Path, which
// choosePath picks from the two places alone (and whether the two devices
// can reach each other), so a link can name its path for each pair of
// memory kinds before any byte moves, and a pair no path carries fails at
// once. What moves the bytes of a GPU region is a Device (device.go); the
// CUDA binding is one, and host memory stands in for it on CPU.
// GPUDIRECT.md is the design for a path that skips the staging.

// Place is where a region's bytes live.
type Place struct {
	Kind wire.MemKind
	// Device is the CUDA ordinal of device memory in the process that
	// registered it (-1 for host memory).
	Device int
	// Host identifies the machine (kvproxy's --host-id, default the boot
	// id). Equal hosts share GPUs by IPC handle and memory by memfd; two
	// kvproxies of one machine given different ids treat each other as
	// remote.
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

// The paths. Host-to-host writes go by the transport itself (tcp, ucx or
// shm); the rest name how device memory takes part.
const (
	// PathSameGPU: both regions on one device of one host, one device copy.
	PathSameGPU Path = "same-gpu"
	// PathP2P: two devices of one host with peer access, device to device.
	PathP2P Path = "p2p"
	// PathStagedLocal: two devices of one host without peer access: the
	// writing kvproxy gathers into its pinned host staging buffers and
	// scatters from them into the destination device itself, no socket.
	PathStagedLocal Path = "staged-local"
	// PathStagedTCP: device memory on at least one end, across hosts or
	// beside host memory: gathered into pinned host staging buffers, sent
	// as DATA frames on the peer link (tcp and shm), scattered at the far
	// end.
	PathStagedTCP Path = "staged-tcp"
	// PathStagedUCX: as PathStagedTCP, but each chunk goes by one RMA put
	// from the writer's registered staging buffer into a slot of the
	// receiver's registered staging ring (stageucx.go).
	PathStagedUCX Path = "staged-ucx"
	PathSHM       Path = "shm"
	PathTCP       Path = "tcp"
	PathUCX       Path = "ucx"
)

// PeerAccess reports whether device a can read and write device b's
// memory directly (cuDeviceCanAccessPeer); nil means never.
type PeerAccess func(a, b int) bool

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
// transport ("tcp", "ucx" or "shm").
func choosePath(transport string, src, dst Place, access PeerAccess) (Path, error) {
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
	// Device memory across hosts, or beside host memory: bytes travel as
	// host bytes with a device copy on the ends that need one: by RMA into
	// the receiver's staging ring over ucx, as DATA frames on the peer link
	// otherwise (shm has no socket of its own for them, but the link has).
	if transport == "ucx" {
		return PathStagedUCX, nil
	}
	return PathStagedTCP, nil
}
