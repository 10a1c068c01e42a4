package mockworker

import (
	"errors"
	"flag"
	"io"
	"reflect"
	"testing"
	"time"
)

func TestParseFlags(t *testing.T) {
	c, err := ParseFlags("mockworker", []string{"--role", "decode", "--port", "0", "--tokens", "4", "--token-delay", "5ms",
		"--prefill-delay", "1s", "--status-code", "429", "--fail-first-n", "2", "--random-fail-rate", "0.25",
		"--hang", "--crash-on-request", "--health-fail-after", "3s", "--health-flap", "1s", "--seed", "7",
		"--api-key", "k", "--require-api-key", "--worker-id", "w", "--model", "m", "--bootstrap-port", "9000",
		"--record-requests", "-1"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	want := Config{Role: RoleDecode, Host: "127.0.0.1", Port: 0, Tokens: 4, TokenDelay: 5 * time.Millisecond,
		PrefillDelay: time.Second, StatusCode: 429, FailFirstN: 2, RandomFailRate: 0.25, Hang: true, CrashOnRequest: true,
		HealthFailAfter: 3 * time.Second, HealthFlap: time.Second, Seed: 7, APIKey: "k", RequireAPIKey: true,
		WorkerID: "w", Model: "m", BootstrapPort: 9000, RecordLimit: -1}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("got  %+v\nwant %+v", c, want)
	}
	for _, args := range [][]string{
		{},                                  // --port is required
		{"--port", "0", "--role", "leader"}, // bad role
		{"--port", "0", "--random-fail-rate", "2"},
		{"--port", "0", "--status-code", "1000"},
		{"--port", "70000"},
		{"--port", "0", "--tokens", "-1"},
		{"--port", "0", "--token-delay", "-1s"},
		{"--port", "0", "--nope"},
		{"--port", "0", "extra"},
	} {
		if _, err := ParseFlags("mockworker", args, io.Discard); err == nil {
			t.Errorf("%v: no error", args)
		}
	}
	if _, err := ParseFlags("mockworker", []string{"-h"}, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
}
