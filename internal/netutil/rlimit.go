package netutil

import "syscall"

// RaiseFileLimit raises the soft RLIMIT_NOFILE to the hard limit and
// returns both as they are afterwards. (Go's runtime already does this on
// Linux at start-up; calling it states the limit for the log and covers a
// limit lowered since.)
func RaiseFileLimit() (soft, hard uint64, err error) {
	var r syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &r); err != nil {
		return 0, 0, err
	}
	if r.Cur < r.Max {
		raised := r
		raised.Cur = r.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &raised); err == nil {
			r = raised
		}
	}
	return r.Cur, r.Max, nil
}

// DefaultMaxConns is the connection limit a server with this fd limit
// gets by default: half of it, leaving the rest for the connections each
// request opens to workers or peers, files and the listeners themselves.
func DefaultMaxConns(fdLimit uint64) int {
	return int(min(max(fdLimit/2, 16), 1<<20))
}
