package main

import (
	"bufio"
	"context"
	"errors"
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/kvtransfer/sidecar"
)

// The test binary runs kvproxy's main when this is set, so the tests see
// its exit status and output.
const runMain = "KVPROXY_TEST_RUN_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(runMain) == "1" {
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestStrayArgumentFails: a word that is not a flag ends flag parsing, so
// the flags after it (here the transport and the ports) would be dropped
// silently and kvproxy would run with defaults; it must refuse instead.
func TestStrayArgumentFails(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	sock := filepath.Join(t.TempDir(), "k.sock")
	cmd := exec.CommandContext(ctx, os.Args[0], "--role", "decode", "--control", sock, "stray",
		"--transport", "tcp", "--peer-port", "0", "--metrics-port", "0")
	cmd.Env = append(os.Environ(), runMain+"=1")
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	if line, _ := bufio.NewReader(out).ReadString('\n'); strings.HasPrefix(line, "kvproxy ready") {
		t.Fatalf("kvproxy ran, ignoring the flags after a stray argument: %s", line)
	}
	err = cmd.Wait()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(stderr.String(), `unexpected argument "stray"`) {
		t.Fatalf("exit %v, stderr %q", err, stderr.String())
	}
}

// TestFlagDefaultsAreDefaultConfig: no flag writes its own default.
func TestFlagDefaultsAreDefaultConfig(t *testing.T) {
	fs := flag.NewFlagSet("kvproxy", flag.ContinueOnError)
	cfg, level := flags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(*cfg, sidecar.DefaultConfig()) || *level != "info" {
		t.Errorf("flag defaults %+v, want %+v", *cfg, sidecar.DefaultConfig())
	}
	if err := fs.Parse([]string{"--role", "decode", "--write-timeout", "2s"}); err != nil || cfg.Role != "decode" || cfg.WriteTimeout != 2*time.Second {
		t.Errorf("flags not applied: %+v %v", *cfg, err)
	}
}
