// Package sysmon keeps the Go runtime's monitor thread on its own tick, so
// a process that idles between small requests does not wake it on each one.
//
// The runtime's sysmon thread sleeps once every P is idle and is woken by
// the first system call after that: for a kvproxy relaying a small write
// (engine -> kvproxy -> peer kvproxy -> back), that is a futex wake on the
// write's path and two more context switches, in each process, every write.
// With GODEBUG's schedtrace set, sysmon never takes that sleep (it prints a
// scheduler line to stderr every schedtrace ms instead, so the period is the
// longest GODEBUG takes, 24.8 days; a host up longer than that gets one line
// at start too) and ticks on its own, at most every 10 ms when idle.
package sysmon

import (
	"os"
	"strings"
	"syscall"
)

// period is the schedtrace period set, in ms: the most GODEBUG takes.
const period = "2147483647"

// KeepAwake re-executes the program (same pid and arguments) with
// schedtrace added to GODEBUG, unless GODEBUG names schedtrace already
// (GODEBUG=schedtrace=0 opts out). It returns only when it does not
// re-execute, or when exec fails: the program then runs as it is.
func KeepAwake() {
	env, ok := schedtraceEnv(os.Environ())
	if !ok {
		return
	}
	if exe, err := os.Executable(); err == nil {
		_ = syscall.Exec(exe, os.Args, env)
	}
}

// schedtraceEnv is environ with schedtrace=period added to its GODEBUG (the
// runtime reads the first GODEBUG, so it replaces it in place); false:
// GODEBUG names schedtrace already.
func schedtraceEnv(environ []string) ([]string, bool) {
	out := make([]string, 0, len(environ)+1)
	seen := false
	for _, kv := range environ {
		v, ok := strings.CutPrefix(kv, "GODEBUG=")
		switch {
		case !ok:
			out = append(out, kv)
		case seen: // the runtime never reads a second one
		case strings.HasPrefix(v, "schedtrace=") || strings.Contains(v, ",schedtrace="):
			return environ, false
		default:
			seen = true
			out = append(out, "GODEBUG="+strings.TrimPrefix(v+",schedtrace="+period, ","))
		}
	}
	if !seen {
		out = append(out, "GODEBUG=schedtrace="+period)
	}
	return out, true
}
