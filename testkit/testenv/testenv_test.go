package testenv

import (
	"fmt"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"
)

func TestMain(m *testing.M) { Main(m) }

func sh(t *testing.T, o Options, script string) *Proc {
	t.Helper()
	return StartWith(t, "/bin/sh", o, "-c", script)
}

func TestReadyLineAddrAndEnv(t *testing.T) {
	p := sh(t, Options{Ready: "listening on ", Env: []string{"TESTENV_FOO=bar"}},
		`echo "log foo=$TESTENV_FOO" >&2; echo "listening on 127.0.0.1:4242" >&2; exec sleep 30`)
	if p.Line != "listening on 127.0.0.1:4242" || p.Addr != "127.0.0.1:4242" || p.URL() != "http://127.0.0.1:4242" {
		t.Fatalf("line %q addr %q", p.Line, p.Addr)
	}
	if out := p.Output(); !strings.Contains(out, "log foo=bar") {
		t.Fatalf("stderr or environment missing: %q", out)
	}
}

func TestReadyLineWithoutAddr(t *testing.T) {
	p := sh(t, Options{Ready: "kvproxy ready"}, `echo "kvproxy ready role=decode peer=- metrics=127.0.0.1:1"; exec sleep 30`)
	if p.Addr != "" || !strings.HasPrefix(p.Line, "kvproxy ready role=decode") {
		t.Fatalf("line %q addr %q", p.Line, p.Addr)
	}
}

func TestReadyThenExit(t *testing.T) {
	p := sh(t, Options{Ready: "done"}, `echo done`)
	if p.Line != "done" {
		t.Fatalf("line %q", p.Line)
	}
	if code := p.Wait(5 * time.Second); code != 0 {
		t.Fatalf("exit %d", code)
	}
}

func TestStopSendsSIGTERM(t *testing.T) {
	p := sh(t, Options{Ready: "up"}, `trap 'echo got-term; exit 3' TERM; echo up; while :; do sleep 0.05; done`)
	p.Stop()
	if code := p.Wait(0); code != 3 || !strings.Contains(p.Output(), "got-term") {
		t.Fatalf("exit %d, output %q", code, p.Output())
	}
}

// fatalTB records the first Fatalf and ends the goroutine, as testing does.
type fatalTB struct {
	testing.TB
	msg string
}

func (f *fatalTB) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	runtime.Goexit()
}

func startFails(t *testing.T, o Options, script string) string {
	f := &fatalTB{TB: t}
	done := make(chan struct{})
	go func() {
		defer close(done)
		StartWith(f, "/bin/sh", o, "-c", script)
	}()
	<-done
	return f.msg
}

func TestNotReady(t *testing.T) {
	if msg := startFails(t, Options{Ready: "up"}, `echo starting; exit 1`); !strings.Contains(msg, `exited before "up"`) || !strings.Contains(msg, "starting") {
		t.Errorf("exit before ready: %q", msg)
	}
	if msg := startFails(t, Options{Ready: "up", ReadyTimeout: 100 * time.Millisecond}, `exec sleep 30`); !strings.Contains(msg, `no "up" within 100ms`) {
		t.Errorf("no ready line: %q", msg)
	}
}

func TestBuildSettings(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a binary")
	}
	for _, tc := range []struct {
		b         Build
		cgo, race bool
	}{
		{Build{}, raceEnabled, raceEnabled},
		{Build{NoRace: true}, false, false},
	} {
		out, err := exec.Command("go", "version", "-m", BuildBinary(t, "mockworker", tc.b)).Output()
		if err != nil {
			t.Fatal(err)
		}
		want := []string{fmt.Sprintf("CGO_ENABLED=%d", map[bool]int{false: 0, true: 1}[tc.cgo])}
		if tc.race {
			want = append(want, "-race=true")
		}
		for _, w := range want {
			if !strings.Contains(string(out), w) {
				t.Errorf("%+v: %q not in the build settings:\n%s", tc.b, w, out)
			}
		}
		if !tc.race && strings.Contains(string(out), "-race=true") {
			t.Errorf("%+v: built with -race", tc.b)
		}
	}
}
