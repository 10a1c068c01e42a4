// Package cuda is the slice of the CUDA driver API kvproxy needs to move
// engines' GPU memory: it opens an engine's allocation by CUDA IPC handle,
// closes it, and allocates, copies and inspects device memory for tests and
// benchmarks. libcuda.so.1 (the driver's library, not the toolkit) is loaded
// with dlopen on first use, so building needs no CUDA toolkit and a machine
// without a driver gets ErrNoDriver instead of a failed start.
//
// Every call makes the device's primary context current only for its own
// duration, so callers need not lock OS threads; MakeCurrent is for threads
// (such as a UCX worker's) that call into CUDA on their own.
package cuda
