package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"
)

var transports = []string{"tcp", "posix,cma,tcp"}

// row is one line of bench/out/ucx.json.
type row struct {
	Transport   string  `json:"transport"`
	Size        int     `json:"size"`
	MiBps       float64 `json:"mibps"`
	PerfMiBps   float64 `json:"perftest_mibps"`
	LatUS       float64 `json:"lat_us"`
	PerfLatUS   float64 `json:"perftest_lat_us"`
	BWRatio     float64 `json:"bw_ratio"`
	LatDeltaUS  float64 `json:"lat_delta_us"`
	Outstanding int     `json:"outstanding"`
}

type key struct {
	tls  string
	size int
}

// samples collects per-run numbers for the medians.
type samples struct{ bw, pbw, lat, plat []float64 }

func runSuite(runs int, outPath, mdPath string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	all := map[key]*samples{}
	for _, tls := range transports {
		for _, size := range sizes {
			all[key{tls, size}] = &samples{}
		}
	}
	port := 14000 + os.Getpid()%1000
	for run := range runs {
		for _, tls := range transports {
			fmt.Fprintf(os.Stderr, "run %d/%d %s: ucx\n", run+1, runs, tls)
			res, err := ours(self, tls)
			if err != nil {
				return fmt.Errorf("ucxbench %s: %w", tls, err)
			}
			for _, r := range res {
				s := all[key{tls, r.Size}]
				s.bw, s.lat = append(s.bw, r.MiBps), append(s.lat, r.LatUS)
			}
			fmt.Fprintf(os.Stderr, "run %d/%d %s: ucx_perftest\n", run+1, runs, tls)
			for _, size := range sizes {
				s := all[key{tls, size}]
				port++
				bw, err := perftest(tls, port, "ucp_put_bw", size, bwIters(tls, size), outstanding(size), 4)
				if err != nil {
					return err
				}
				port++
				lat, err := perftest(tls, port, "ucp_put_lat", size, latIters(tls, size), 0, 1)
				if err != nil {
					return err
				}
				s.pbw, s.plat = append(s.pbw, bw), append(s.plat, lat)
			}
		}
	}
	var rows []row
	for _, tls := range transports {
		for _, size := range sizes {
			s := all[key{tls, size}]
			r := row{Transport: tls, Size: size, MiBps: median(s.bw), PerfMiBps: median(s.pbw),
				LatUS: median(s.lat), PerfLatUS: median(s.plat), Outstanding: outstanding(size)}
			r.BWRatio = r.MiBps / r.PerfMiBps
			r.LatDeltaUS = r.LatUS - r.PerfLatUS
			rows = append(rows, r)
		}
	}
	if err := os.MkdirAll(filepath.Dir(outPath), 0o755); err != nil {
		return err
	}
	js, err := json.MarshalIndent(rows, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(outPath, append(js, '\n'), 0o644); err != nil {
		return err
	}
	return writeMarkdown(mdPath, rows, runs)
}

// ours runs one server/client pair pinned to the two cores.
func ours(self, tls string) ([]result, error) {
	env := append(os.Environ(), "UCX_TLS="+tls)
	srv := exec.Command("taskset", "-c", "0", self, "-role", "server")
	srv.Env, srv.Stderr = env, os.Stderr
	out, err := srv.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := srv.Start(); err != nil {
		return nil, err
	}
	defer srv.Wait()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ADDR ") {
		srv.Process.Kill()
		return nil, fmt.Errorf("server handshake %q: %v", line, err)
	}
	cli := exec.Command("taskset", "-c", "1", self, "-role", "client", "-addr", strings.TrimSpace(line[5:]))
	cli.Env, cli.Stderr = env, os.Stderr
	b, err := cli.Output()
	if err != nil {
		srv.Process.Kill()
		return nil, err
	}
	var res []result
	dec := json.NewDecoder(bytes.NewReader(b))
	for dec.More() {
		var r result
		if err := dec.Decode(&r); err != nil {
			return nil, err
		}
		res = append(res, r)
	}
	return res, nil
}

// perftest runs one ucx_perftest server/client pair and returns column col
// of the client's final line (1: 50th-percentile latency µs, 4: average MiB/s).
func perftest(tls string, port int, test string, size, iters, outstanding, col int) (float64, error) {
	env := append(os.Environ(), "UCX_TLS="+tls)
	p := strconv.Itoa(port)
	srv := exec.Command("ucx_perftest", "-p", p, "-c", "0")
	srv.Env = env
	if err := srv.Start(); err != nil {
		return 0, fmt.Errorf("ucx_perftest server: %w", err)
	}
	defer srv.Wait()
	args := []string{"127.0.0.1", "-p", p, "-c", "1", "-t", test, "-s", strconv.Itoa(size),
		"-n", strconv.Itoa(iters), "-w", strconv.Itoa(max(1, iters/10)), "-f"}
	if outstanding > 0 {
		args = append(args, "-O", strconv.Itoa(outstanding))
	}
	var b []byte
	var err error
	for try := 0; try < 20; try++ { // the server needs a moment to listen
		time.Sleep(100 * time.Millisecond)
		cli := exec.Command("ucx_perftest", args...)
		cli.Env = env
		if b, err = cli.CombinedOutput(); err == nil {
			break
		}
	}
	if err != nil {
		srv.Process.Kill()
		return 0, fmt.Errorf("ucx_perftest %s: %v: %s", strings.Join(args, " "), err, b)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	f := strings.Fields(lines[len(lines)-1])
	if len(f) <= col {
		return 0, fmt.Errorf("ucx_perftest: unexpected output %q", lines[len(lines)-1])
	}
	return strconv.ParseFloat(f[col], 64)
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	return s[len(s)/2]
}

func sizeName(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}

// writeMarkdown replaces the text between the ucx markers of path.
func writeMarkdown(path string, rows []row, runs int) error {
	const begin, end = "<!-- BEGIN ucx -->\n", "<!-- END ucx -->"
	old, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	i, j := bytes.Index(old, []byte(begin)), bytes.Index(old, []byte(end))
	if i < 0 || j < i {
		return fmt.Errorf("%s: ucx markers not found", path)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "Two processes pinned to cores 0 and 1, both buffers UCX-allocated (`UCP_MEM_MAP_ALLOCATE`, as ucx_perftest), "+
		"median of %d runs, %s. Bandwidth: puts with at most `outstanding` in flight (ucx_perftest `-O` the same), then a flush. "+
		"Latency: 50th-percentile half round trip of a put ping-pong (ucx_perftest `ucp_put_lat`).\n\n", runs, time.Now().UTC().Format("2006-01-02"))
	b.WriteString("| UCX_TLS | size | outstanding | ucx MiB/s | perftest MiB/s | ratio | ucx µs | perftest µs | Δ µs |\n")
	b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %d | %.0f | %.0f | %.2f | %.2f | %.2f | %+.2f |\n", r.Transport, sizeName(r.Size),
			r.Outstanding, r.MiBps, r.PerfMiBps, r.BWRatio, r.LatUS, r.PerfLatUS, r.LatDeltaUS)
	}
	var out bytes.Buffer
	out.Write(old[:i+len(begin)])
	out.WriteString(b.String())
	out.Write(old[j:])
	return os.WriteFile(path, out.Bytes(), 0o644)
}
