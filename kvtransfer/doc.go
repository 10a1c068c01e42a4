// Package kvtransfer moves KV-cache bytes between engines' registered
// memory, from one kvproxy to its peer.
//
// Three layers, bottom up:
//
//   - Transports (transport.go: tcp.go, samehost.go for shm, ucx.go) move
//     bytes between mappings: DATA frames on the peer link, a memcpy into
//     the peer engine's memfd mapped here, or UCX RMA puts.
//   - The memory plane (memory.go, memlink.go, pagewrite.go; GPU memory in
//     gpu.go and staging.go, the path for a pair of places in place.go) is
//     what SGLang's Mooncake-style TransferEngine drives through python/:
//     an engine registers memory it allocated itself (a memfd, or CUDA
//     memory by IPC handle), and writes name source and destination by
//     engine addresses. One link per peer kvproxy carries the region
//     tables, tcp's DATA frames and fences, and the rooms' messages.
//   - Rooms (rooms.go, room.go, roomlink.go) are SGLang's high-level API on
//     top: an engine that registered its memory describes its KV layout
//     once (RoomLayout), then the decode side calls Expect (it finds the
//     prefill's kvproxy through the bootstrap API and sends XFER_REQ with
//     its layout and page indices) and the prefill side calls Send per
//     chunk; the prefill kvproxy moves each chunk with the same page write
//     an engine-memory write makes, over the same link, then sends DONE.
//     Rooms climb SGLang's KVPoll ladder and every room ends (Success,
//     Failed, abort, bootstrap or waiting timeout, a peer silent for two
//     heartbeats), then lingers as a small tombstone.
//
// Subpackages: wire (the peer protocol), control (the engine's Unix-socket
// API), bootstrap (SGLang's bootstrap HTTP API), sidecar (kvproxy as a
// value) and e2e (the binaries end to end).
package kvtransfer
