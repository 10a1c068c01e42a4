// Package ucx is a thin cgo binding to UCX's libucp (1.13+): contexts,
// workers, listeners, endpoints, memory registration, remote keys, RMA
// put/get (one call or a batch per cgo call), flush and active messages.
//
// It and package cuda (../cuda: the CUDA driver, loaded at run time) are the
// project's only cgo; pdrouter itself builds with CGO_ENABLED=0.
//
// Threading rules:
//   - A Worker and everything created from it (Endpoint, Listener, Rkey,
//     Request) belong to one owner goroutine locked to its OS thread
//     (runtime.LockOSThread). Call their methods only from that goroutine;
//     only Worker.Signal is safe from anywhere. Loop runs such a goroutine
//     and executes closures on it.
//   - Context and Memory are safe to share between goroutines.
//   - Nothing moves unless the owner progresses its worker. Over tcp the
//     target of a put must progress its worker too, or the put never
//     completes.
//
// Memory rules: UCX never sees Go heap memory. Registered buffers come from
// Context.Alloc (UCX-allocated, the fast path over shared memory),
// Context.Map of memory the caller obtained outside the Go heap (mmap,
// C.malloc), or Context.MapAddr by address with a memory type: CUDA device
// memory needs a UCX built with CUDA (make cuda-bundle builds against one;
// Debian's refuses it with an error naming the UCX version). Active-message payloads are copied into C memory before
// sending. Errors carry UCX's status text (see Error).
//
// Without cgo the package compiles, and every constructor returns
// ErrUnavailable.
package ucx
