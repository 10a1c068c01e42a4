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

// row is one line of bench/out/ucx.json: medians over the runs, the range
// (min, max) of each, and the median of the per-run ratios (each run pairs
// ucxbench with ucx_perftest back to back, so a load spike on the shared
// machine hits both sides of a ratio).
type row struct {
	Transport     string     `json:"transport"`
	Size          int        `json:"size"`
	Runs          int        `json:"runs"`
	MiBps         float64    `json:"mibps"`
	MiBpsRange    [2]float64 `json:"mibps_range"`
	PerfMiBps     float64    `json:"perftest_mibps"`
	PerfRange     [2]float64 `json:"perftest_mibps_range"`
	LatUS         float64    `json:"lat_us"`
	LatRange      [2]float64 `json:"lat_us_range"`
	PerfLatUS     float64    `json:"perftest_lat_us"`
	PerfLatRange  [2]float64 `json:"perftest_lat_us_range"`
	BWRatio       float64    `json:"bw_ratio"`       // median of per-run ratios
	BWRatioRange  [2]float64 `json:"bw_ratio_range"` // their min, max
	LatDeltaUS    float64    `json:"lat_delta_us"`   // median of per-run deltas
	LatDeltaRange [2]float64 `json:"lat_delta_us_range"`
	Outstanding   int        `json:"outstanding"`
	Memory        string     `json:"memory"` // host, or cuda (both buffers on GPU 0; no latency figures)
}

// samples collects per-run numbers.
type samples struct{ bw, pbw, lat, plat, ratio, delta []float64 }

func runSuite(runs int, tlss []string, szs []int, mem, outPath, mdPath string) error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	all := map[string]*samples{}
	port := 14000 + os.Getpid()%1000
	for run := range runs {
		for _, tls := range tlss {
			for _, size := range szs {
				k := fmt.Sprint(tls, size)
				if all[k] == nil {
					all[k] = &samples{}
				}
				s := all[k]
				fmt.Fprintf(os.Stderr, "run %d/%d %s %s\n", run+1, runs, tls, sizeName(size))
				var r result
				var bw, lat float64
				ucx := func() (err error) { r, err = ours(self, tls, size, mem); return err }
				perf := func() error {
					port += 2
					var err error
					if bw, err = perftest(tls, mem, port, "ucp_put_bw", size, bwIters(tls, size, mem), outstanding(size, mem), 5); err != nil {
						return err
					}
					if mem == "host" {
						lat, err = perftest(tls, mem, port+1, "ucp_put_lat", size, latIters(tls, size), 0, 1)
					}
					return err
				}
				// Alternate who goes first so drift in the machine's load
				// does not favour one side.
				first, second := ucx, perf
				if run%2 == 1 {
					first, second = perf, ucx
				}
				if err := first(); err != nil {
					return err
				}
				if err := second(); err != nil {
					return err
				}
				s.bw, s.lat = append(s.bw, r.MiBps), append(s.lat, r.LatUS)
				s.pbw, s.plat = append(s.pbw, bw), append(s.plat, lat)
				s.ratio, s.delta = append(s.ratio, r.MiBps/bw), append(s.delta, r.LatUS-lat)
			}
		}
	}
	var rows []row
	for _, tls := range tlss {
		for _, size := range szs {
			s := all[fmt.Sprint(tls, size)]
			rows = append(rows, row{Transport: tls, Size: size, Runs: runs,
				MiBps: median(s.bw), MiBpsRange: span(s.bw),
				PerfMiBps: median(s.pbw), PerfRange: span(s.pbw),
				LatUS: median(s.lat), LatRange: span(s.lat),
				PerfLatUS: median(s.plat), PerfLatRange: span(s.plat),
				BWRatio: median(s.ratio), BWRatioRange: span(s.ratio),
				LatDeltaUS: median(s.delta), LatDeltaRange: span(s.delta),
				Outstanding: outstanding(size, mem), Memory: mem})
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
	if mdPath == "" {
		return nil
	}
	return writeMarkdown(mdPath, rows, runs)
}

// childEnv is the environment of both tools' processes. GOMAXPROCS=2 is
// for ours only (ucx_perftest ignores it): with the process pinned to one
// core Go defaults to 1, and then sysmon takes the P away whenever the
// polling thread is descheduled inside a cgo call, waking more threads on
// that core (measured: half the context switches, tcp 8 B latency about
// 0.6 µs lower with 2).
func childEnv(tls string) []string {
	return append(os.Environ(), "UCX_TLS="+tls, "GOMAXPROCS=2")
}

// ours runs one server/client pair pinned to the two cores, as
// ucx_perftest -c 0 / -c 1.
func ours(self, tls string, size int, mem string) (result, error) {
	env := childEnv(tls)
	srv := exec.Command("taskset", "-c", "0", self, "-role", "server", "-mem", mem, "-size", strconv.Itoa(size))
	srv.Env, srv.Stderr = env, os.Stderr
	out, err := srv.StdoutPipe()
	if err != nil {
		return result{}, err
	}
	if err := srv.Start(); err != nil {
		return result{}, err
	}
	defer srv.Wait()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ADDR ") {
		srv.Process.Kill()
		return result{}, fmt.Errorf("ucxbench server handshake %q: %v", line, err)
	}
	cli := exec.Command("taskset", "-c", "1", self, "-role", "client", "-mem", mem, "-size", strconv.Itoa(size),
		"-addr", strings.TrimSpace(line[5:]))
	cli.Env, cli.Stderr = env, os.Stderr
	b, err := cli.Output()
	if err != nil {
		srv.Process.Kill()
		return result{}, fmt.Errorf("ucxbench %s %d B: %w", tls, size, err)
	}
	var r result
	return r, json.Unmarshal(b, &r)
}

// perftest runs one ucx_perftest server/client pair and returns column col
// of the client's final line (1: 50th-percentile latency µs, 5: overall
// MiB/s, which like ours covers the whole timed run; 4 covers only the last
// report interval).
func perftest(tls, mem string, port int, test string, size, iters, outstanding, col int) (float64, error) {
	env := childEnv(tls)
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
	if mem == "cuda" {
		args = append(args, "-m", "cuda,cuda")
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

func span(v []float64) [2]float64 {
	if len(v) == 0 {
		return [2]float64{}
	}
	return [2]float64{slices.Min(v), slices.Max(v)}
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
		"same UCX_* environment for both tools, %d runs on %s; each run measures ucxbench and ucx_perftest back to back "+
		"(alternating which goes first). Cells are medians with the [min–max] over the runs; ratio and Δ are medians of the per-run "+
		"ratios and differences. Bandwidth: puts with at most `outstanding` in flight (ucx_perftest `-O` the same) and the same "+
		"iteration and warm-up counts, then a flush; perftest's \"overall\" column. Latency: 50th-percentile half round trip of a put "+
		"ping-pong where each side polls its target memory while progressing (ucx_perftest `ucp_put_lat`).\n\n", runs, time.Now().UTC().Format("2006-01-02"))
	b.WriteString("| UCX_TLS | size | outstanding | ucx MiB/s | perftest MiB/s | ratio | ucx µs | perftest µs | Δ µs |\n")
	b.WriteString("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
	for _, r := range rows {
		fmt.Fprintf(&b, "| %s | %s | %d | %.0f [%.0f–%.0f] | %.0f [%.0f–%.0f] | %.2f [%.2f–%.2f] | %.2f [%.2f–%.2f] | %.2f [%.2f–%.2f] | %+.2f [%+.2f–%+.2f] |\n",
			r.Transport, sizeName(r.Size), r.Outstanding,
			r.MiBps, r.MiBpsRange[0], r.MiBpsRange[1], r.PerfMiBps, r.PerfRange[0], r.PerfRange[1],
			r.BWRatio, r.BWRatioRange[0], r.BWRatioRange[1],
			r.LatUS, r.LatRange[0], r.LatRange[1], r.PerfLatUS, r.PerfLatRange[0], r.PerfLatRange[1],
			r.LatDeltaUS, r.LatDeltaRange[0], r.LatDeltaRange[1])
	}
	var out bytes.Buffer
	out.Write(old[:i+len(begin)])
	out.WriteString(b.String())
	out.Write(old[j:])
	return os.WriteFile(path, out.Bytes(), 0o644)
}
