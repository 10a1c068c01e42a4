// Command mockworker is a mock SGLang engine for tests and benchmarks; see
// package mock/mockworker for its flags and endpoints. The first stdout
// line is "listening on HOST:PORT".
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/pdrouter/pdrouter/mock/enginesim"
	"github.com/pdrouter/pdrouter/mock/mockworker"
)

func main() {
	kvArgs, args := enginesim.SplitArgs(os.Args[1:])
	cfg, err := mockworker.ParseFlags(os.Args[0], args, os.Stderr)
	var kvOpts enginesim.Options
	if err == nil {
		kvFlags := flag.NewFlagSet(os.Args[0], flag.ContinueOnError)
		kvOpts.RegisterFlags(kvFlags)
		err = kvFlags.Parse(kvArgs)
	}
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "mockworker:", err)
		os.Exit(2)
	}
	if kvOpts.Control != "" && cfg.Role != mockworker.RoleRegular {
		kv, err := enginesim.New(context.Background(), kvOpts)
		if err != nil {
			fmt.Fprintln(os.Stderr, "mockworker:", err)
			os.Exit(1)
		}
		defer kv.Close()
		cfg.KV = kv
	}
	srv, err := mockworker.Start(cfg)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fmt.Printf("listening on %s\n", srv.Addr())

	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGINT, syscall.SIGTERM)
	select {
	case <-sig:
	case <-srv.Done():
	}
	if err := srv.Close(); err != nil {
		fmt.Fprintln(os.Stderr, "mockworker:", err)
		os.Exit(1)
	}
}
