package sysmon

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestSchedtraceEnv(t *testing.T) {
	set := "schedtrace=" + period
	for _, c := range []struct {
		in, want []string
		ok       bool
	}{
		{[]string{"A=1"}, []string{"A=1", "GODEBUG=" + set}, true},
		{[]string{"GODEBUG=", "A=1"}, []string{"GODEBUG=" + set, "A=1"}, true},
		{[]string{"GODEBUG=gctrace=1", "GODEBUG=x=2"}, []string{"GODEBUG=gctrace=1," + set}, true},
		{[]string{"GODEBUG=gctrace=1,schedtrace=0"}, []string{"GODEBUG=gctrace=1,schedtrace=0"}, false},
		{[]string{"GODEBUG=schedtrace=5"}, []string{"GODEBUG=schedtrace=5"}, false},
		{[]string{"GODEBUG=noschedtrace=1"}, []string{"GODEBUG=noschedtrace=1," + set}, true},
	} {
		got, ok := schedtraceEnv(c.in)
		if ok != c.ok || !slices.Equal(got, c.want) {
			t.Errorf("schedtraceEnv(%q) = %q, %v; want %q, %v", c.in, got, ok, c.want, c.ok)
		}
	}
}

// The test binary plays a small server when this is set: KeepAwake, then
// one byte back for each byte in, then its GODEBUG and context switches.
const helperEnv = "SYSMON_TEST_HELPER"

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) == "1" {
		KeepAwake()
		// Read through the netpoller, as a server's sockets are (a blocking
		// read would have sysmon take its P back instead).
		_ = syscall.SetNonblock(0, true)
		in, out := bufio.NewReader(os.NewFile(0, "stdin")), bufio.NewWriter(os.Stdout)
		var ru0 syscall.Rusage
		for n := 0; ; n++ {
			b, err := in.ReadByte()
			if err != nil {
				break
			}
			if n == 10 { // past start-up
				_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)
			}
			_ = out.WriteByte(b)
			_ = out.Flush()
		}
		var ru syscall.Rusage
		_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
		fmt.Fprintf(out, "%d %d %s\n", os.Getpid(), ru.Nvcsw+ru.Nivcsw-ru0.Nvcsw-ru0.Nivcsw, os.Getenv("GODEBUG"))
		_ = out.Flush()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// pingPong runs the helper with GODEBUG=godebug and answers a byte at a
// time with an idle spell between: its context switches per request, and
// its pid and GODEBUG once KeepAwake ran.
func pingPong(t *testing.T, godebug string, n int) (float64, int, int, string) {
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), helperEnv+"=1", "GODEBUG="+godebug)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outPipe, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	out := bufio.NewReader(outPipe)
	for range n + 10 {
		time.Sleep(time.Millisecond) // the helper idles: its Ps all go idle
		if _, err := in.Write([]byte{'x'}); err != nil {
			t.Fatal(err)
		}
		if _, err := out.ReadByte(); err != nil {
			t.Fatal(err)
		}
	}
	_ = in.Close()
	line, _ := out.ReadString('\n')
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		t.Fatalf("helper said %q", line)
	}
	pid, _ := strconv.Atoi(f[0])
	switches, _ := strconv.Atoi(f[1])
	return float64(switches) / float64(n), pid, cmd.Process.Pid, strings.Join(f[2:], " ")
}

// TestKeepAwake: the program goes on, re-executed in place, with
// schedtrace set, and an idle spell then a request no longer wakes sysmon:
// fewer context switches a request than with the opt-out.
func TestKeepAwake(t *testing.T) {
	if testing.Short() {
		t.Skip("times idle spells")
	}
	const n = 300
	kept, pid, started, godebug := pingPong(t, "gctrace=0", n)
	if pid != started || godebug != "gctrace=0,schedtrace="+period {
		t.Fatalf("helper pid %d (started %d), GODEBUG %q", pid, started, godebug)
	}
	asleep, _, _, godebug := pingPong(t, "schedtrace=0", n)
	if godebug != "schedtrace=0" {
		t.Fatalf("opted out, GODEBUG became %q", godebug)
	}
	t.Logf("context switches a request: %.2f kept awake, %.2f sysmon asleep", kept, asleep)
	if kept > asleep-0.75 { // about two fewer: sysmon's wake and its return to sleep
		t.Fatalf("context switches a request: %.2f kept awake, %.2f sysmon asleep: want fewer by 0.75 at least", kept, asleep)
	}
}
