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
