// Package kvtransfer moves KV-cache bytes between engines' registered
// memory, from one kvproxy to its peer.
//
// Where each layer lives, bottom up:
//
//   - Transports, in this package for now: transport.go (the interfaces),
//     tcp.go (DATA frames on the peer link), samehost.go (shm: a memcpy
//     into the peer engine's memfd mapped here), ucx.go (UCX RMA puts, cgo
//     binding in ucx/), ucxlocal.go (kvproxy's ucx: shm's memcpy to a peer
//     of the same host id, UCX to the others); for GPU memory device.go
//     (the copier seam) and staging.go, the one pipeline of the staged
//     paths, with stageucx.go's ring and stagelocal.go's local scatter.
//   - The memory plane, this package: memory.go (regions an engine
//     registered from its own memfd), memlink.go (one link per peer
//     kvproxy: region tables, DATA frames, fences), pagewrite.go (SGLang's
//     page writes), gpu.go (CUDA memory by IPC handle), place.go and
//     linkpath.go (which path a pair of places takes), directwrite.go (an
//     engine's small host write sent straight to the peer's port as a
//     write-only client, skipping its own kvproxy). This is what
//     SGLang's Mooncake-style TransferEngine drives through python/.
//     peerlink.go is the seam for the layer above: a Link handle, the
//     RoomHandler that gets the room messages each link reads, and
//     WriteOver, the page write a room's chunk takes.
//   - Rooms, in rooms/: SGLang's high-level API (Expect/Send/Poll/Abort by
//     room, the KVPoll ladder, bootstrap and waiting timeouts, heartbeats)
//     for an engine that registered its memory here and described its KV
//     layout; each chunk moves by the same page write and over the same
//     link an engine's own write takes.
//
// Beside them: wire/ (the peer protocol, one for both layers), control/
// (the engine's Unix-socket API), bootstrap/ (SGLang's bootstrap HTTP API),
// shm/ (a memfd segment), sidecar/ (kvproxy as a value) and e2e/ (the
// binaries end to end); what the KV tests share is testkit/kvtest.
package kvtransfer
