// Command ucxbench measures ucx put bandwidth and latency between two
// processes against ucx_perftest (make bench-ucx). Roles: "suite" runs
// everything and writes the results; "server" and "client" are the two
// processes it starts.
package main

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
)

func main() {
	role := flag.String("role", "suite", "suite, server or client")
	addr := flag.String("addr", "", "client: server address ip:port")
	runs := flag.Int("runs", 5, "suite: runs per transport and size (median and range reported)")
	tlsList := flag.String("tls", strings.Join(transports, "|"), "suite: UCX_TLS values, |-separated")
	sizeList := flag.String("sizes", "", "suite: message sizes in bytes, comma-separated (default all)")
	size := flag.Int("size", 0, "server, client: measure only this size (0: all)")
	mem := flag.String("mem", "host", "memory the buffers live in: host or cuda (device 0, needs a CUDA-aware UCX)")
	out := flag.String("json", "bench/out/ucx.json", "suite: JSON output")
	md := flag.String("md", "bench/RESULTS.md", "suite: markdown file with the ucx markers")
	flag.Parse()
	var err error
	if *mem != "host" && *mem != "cuda" {
		err = fmt.Errorf("unknown memory %q", *mem)
	}
	switch {
	case err != nil:
	case *role == "server":
		err = serve(*mem, bufferLen(*mem, *size))
	case *role == "client":
		err = runClient(*addr, *mem, *size)
	case *role == "suite":
		var szs []int
		if szs, err = parseSizes(*sizeList, *mem); err == nil {
			err = runSuite(*runs, strings.Split(*tlsList, "|"), szs, *mem, *out, *md)
		}
	default:
		err = fmt.Errorf("unknown role %q", *role)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "ucxbench:", err)
		os.Exit(1)
	}
}

func parseSizes(list, mem string) ([]int, error) {
	if list == "" {
		return defaultSizes(mem), nil
	}
	var out []int
	for _, f := range strings.Split(list, ",") {
		n, err := strconv.Atoi(f)
		if err != nil || n < 8 || n > maxLen {
			return nil, fmt.Errorf("bad size %q (8 to %d bytes)", f, maxLen)
		}
		out = append(out, n)
	}
	return out, nil
}
