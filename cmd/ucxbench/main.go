// Command ucxbench measures ucx put bandwidth and latency between two
// processes against ucx_perftest (make bench-ucx). Roles: "suite" runs
// everything and writes the results; "server" and "client" are the two
// processes it starts.
package main

import (
	"flag"
	"fmt"
	"os"
)

func main() {
	role := flag.String("role", "suite", "suite, server or client")
	addr := flag.String("addr", "", "client: server address ip:port")
	runs := flag.Int("runs", 3, "suite: runs per transport (median reported)")
	out := flag.String("json", "bench/out/ucx.json", "suite: JSON output")
	md := flag.String("md", "bench/RESULTS.md", "suite: markdown file with the ucx markers")
	flag.Parse()
	var err error
	switch *role {
	case "server":
		err = serve()
	case "client":
		err = runClient(*addr)
	case "suite":
		err = runSuite(*runs, *out, *md)
	default:
		err = fmt.Errorf("unknown role %q", *role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ucxbench:", err)
		os.Exit(1)
	}
}
