//go:build cgo

package ucx

// Abort force-closes the endpoint without the bounded flush Close tries
// first: for a peer known to be dead or stuck, where that flush would only
// hold the worker's goroutine for closeFlushTimeout. Operations still
// pending on it are dropped; their requests still need Free.
func (ep *Endpoint) Abort() error {
	if ep.closed {
		return ErrClosed
	}
	ep.forceClose()
	return nil
}
