//go:build pprof

// Built only with -tags pprof (scripts/bench-profile.sh): serves
// net/http/pprof on $PDROUTER_PPROF so that a benchmark can take CPU and
// heap profiles of a running router. Release builds carry none of it.
package main

import (
	"fmt"
	"net/http"
	_ "net/http/pprof"
	"os"
)

func init() {
	addr := os.Getenv("PDROUTER_PPROF")
	if addr == "" {
		return
	}
	go func() {
		if err := http.ListenAndServe(addr, nil); err != nil {
			fmt.Fprintln(os.Stderr, "pdrouter: pprof:", err)
		}
	}()
}
