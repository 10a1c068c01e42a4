package e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// TestBenchKV is `make bench-kv` (scripts/bench-kv.sh sets KV_BENCH_OUT):
// the default Llama-3.1-8B layout (32 layers × K,V × 2 KiB per token, page
// 16 → 128 KiB per token), one prefill and one decode mockworker with their
// kvproxies, prompts of 128, 1k, 4k and 32k tokens, next to ucx_perftest's
// ucp_put_bw for the same UCX_TLS in the same run.
func TestBenchKV(t *testing.T) {
	out := os.Getenv("KV_BENCH_OUT")
	if out == "" {
		t.Skip("set KV_BENCH_OUT (make bench-kv)")
	}
	saved := kvFlags
	kvFlags = []string{"--kv-pool-tokens", "33792"} // defaults otherwise
	t.Cleanup(func() { kvFlags = saved })
	type row struct {
		Transport      string  `json:"transport"`
		UCXTLS         string  `json:"ucx_tls"`
		Tokens         int     `json:"tokens"`
		Bytes          int64   `json:"bytes"`
		TransferMS     float64 `json:"transfer_ms"`
		MiBps          float64 `json:"mib_per_s"`
		TTFTMS         float64 `json:"ttft_ms"`
		TTFTShare      float64 `json:"ttft_share"`
		PerftestMiBps  float64 `json:"perftest_mib_per_s"`
		RatioPerftest  float64 `json:"ratio_to_perftest"`
		PerftestSizeKB int     `json:"perftest_msg_kib"`
		// Shared memory only: perftest with one put of a whole chunk's bytes,
		// i.e. our working set instead of one cache-hot block.
		PerftestChunkMiBps float64 `json:"perftest_chunk_mib_per_s,omitempty"`
		RatioChunk         float64 `json:"ratio_to_perftest_chunk,omitempty"`
	}
	var rows []row
	// shm is compared with UCX's own shared memory (its UCX_TLS column is
	// perftest's).
	for _, cfg := range []struct{ transport, tls string }{{"tcp", "tcp"}, {"shm", "posix,cma,tcp"}, {"ucx", "tcp"}, {"ucx", "posix,cma,tcp"}} {
		t.Run(cfg.transport+"/"+cfg.tls, func(t *testing.T) {
			tls := ""
			if cfg.transport == "ucx" {
				tls = cfg.tls
			}
			// Default 5 s heartbeats: filling and verifying 4 GiB keeps both
			// cores busy for seconds, which a 500 ms test interval mistakes
			// for a dead peer.
			c := startCluster(t, opts{transport: cfg.transport, tls: tls, prefills: 1, decodes: 1, timeouts: "300s", heartbeat: "5s"})
			p, d := c.prefills[0], c.decodes[0]
			for _, tokens := range []int{128, 1024, 4096, 32768} {
				reps := 5
				if tokens == 32768 {
					reps = 2
				}
				var best row
				for r := 0; r < reps+1; r++ { // first run warms up the endpoint and pages
					kv, ttft, err := pdOnce(p, d, tokens, uint64(tokens*100+r))
					if err != nil {
						t.Fatal(err)
					}
					if r == 0 {
						continue
					}
					mibps := float64(kv.Bytes) / (1 << 20) / (kv.TransferMS / 1000)
					if mibps > best.MiBps {
						best = row{Transport: cfg.transport, UCXTLS: cfg.tls, Tokens: tokens, Bytes: kv.Bytes, TransferMS: kv.TransferMS,
							MiBps: mibps, TTFTMS: ttft, TTFTShare: kv.TransferMS / ttft}
					}
				}
				// Perftest with the run length our batches post: a prompt's pages
				// are contiguous in a fresh pool, so one put per buffer and
				// chunk (the mockworker's default 8192-token chunks).
				size := min(tokens, 8192) * 2048
				best.PerftestSizeKB = size >> 10
				best.PerftestMiBps = perftest(t, cfg.tls, size)
				best.RatioPerftest = best.MiBps / best.PerftestMiBps
				if strings.Contains(cfg.tls, "posix") {
					best.PerftestChunkMiBps = perftest(t, cfg.tls, size*64)
					best.RatioChunk = best.MiBps / best.PerftestChunkMiBps
				}
				rows = append(rows, best)
				t.Logf("%+v", best)
			}
		})
	}
	var empty string
	if b, err := exec.Command("go", "test", "-run", "^$", "-bench", "EmptyRoom", "-benchtime", "3000x", "../rooms/").CombinedOutput(); err == nil {
		empty = string(b)
	} else {
		t.Fatalf("empty-room benchmark: %v\n%s", err, b)
	}
	js, _ := json.MarshalIndent(map[string]any{"rows": rows, "empty_room_bench": empty, "date": time.Now().UTC().Format(time.RFC3339)}, "", "  ")
	if err := os.WriteFile(out, js, 0o644); err != nil {
		t.Fatal(err)
	}
	var md strings.Builder
	md.WriteString("| transport | UCX_TLS | tokens | KV bytes | transfer ms | MiB/s | ucx_perftest put_bw MiB/s (msg) | ratio | perftest, one chunk per put MiB/s | ratio | TTFT ms | KV share of TTFT |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		chunk := "– | –"
		if r.PerftestChunkMiBps > 0 {
			chunk = fmt.Sprintf("%.0f (%d MiB) | %.0f %%", r.PerftestChunkMiBps, r.PerftestSizeKB*64>>10, 100*r.RatioChunk)
		}
		fmt.Fprintf(&md, "| %s | %s | %d | %d | %.2f | %.0f | %.0f (%d KiB) | %.0f %% | %s | %.1f | %.0f %% |\n", r.Transport, r.UCXTLS, r.Tokens, r.Bytes,
			r.TransferMS, r.MiBps, r.PerftestMiBps, r.PerftestSizeKB, 100*r.RatioPerftest, chunk, r.TTFTMS, 100*r.TTFTShare)
	}
	md.WriteString("\nEmpty room (Expect → XFER_REQ → Send(last) → DONE → Success), in-process, loopback:\n\n```\n")
	for _, l := range strings.Split(empty, "\n") {
		if strings.HasPrefix(l, "BenchmarkEmptyRoom") {
			md.WriteString(l + "\n")
		}
	}
	md.WriteString("```\n")
	if err := os.WriteFile(strings.TrimSuffix(out, ".json")+".md", []byte(md.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}

// pdOnce sends one request to prefill and decode at once (as the router
// does) and returns decode's kv_transfer and its time to first token (the
// decode answers one token right after the KV is verified).
func pdOnce(p, d worker, tokens int, room uint64) (*kvInfo, float64, error) {
	b := body(tokens, fmt.Sprintf(`,"bootstrap_host":"127.0.0.1","bootstrap_port":%d,"bootstrap_room":%d`, p.boot, room))
	b = []byte(strings.Replace(string(b), `"max_new_tokens":4`, `"max_new_tokens":1`, 1))
	var wg sync.WaitGroup
	var perr error
	wg.Go(func() {
		code, out, err := post(context.Background(), p.url, b)
		if err == nil && code != 200 {
			err = fmt.Errorf("prefill %d: %s", code, out)
		}
		perr = err
	})
	start := time.Now()
	code, out, err := post(context.Background(), d.url, b)
	ttft := float64(time.Since(start).Microseconds()) / 1000
	wg.Wait()
	if err == nil && code != 200 {
		err = fmt.Errorf("decode %d: %s", code, out)
	}
	if err != nil || perr != nil {
		return nil, 0, fmt.Errorf("%d tokens: %v %v", tokens, err, perr)
	}
	var r struct {
		MetaInfo struct {
			KV *kvInfo `json:"kv_transfer"`
		} `json:"meta_info"`
	}
	if err := json.Unmarshal(out, &r); err != nil || r.MetaInfo.KV == nil || !r.MetaInfo.KV.ChecksumOK {
		return nil, 0, fmt.Errorf("%d tokens: bad answer %s", tokens, out)
	}
	return r.MetaInfo.KV, ttft, nil
}

// perftest runs ucx_perftest ucp_put_bw (server and client on this host)
// and returns its best average bandwidth (MB/s as printed, i.e. MiB/s) over
// three runs: best of several, like our side, so load from other processes
// on the box skews neither side alone. Its buffers are UCX-allocated;
// ours are the engines' memfds, registered.
func perftest(t *testing.T, tls string, size int) float64 {
	best := 0.0
	for range 3 {
		best = max(best, perftestOnce(t, tls, size))
	}
	return best
}

func perftestOnce(t *testing.T, tls string, size int) float64 {
	port := strconv.Itoa(testenv.FreePort(t))
	env := append(os.Environ(), "UCX_TLS="+tls, "UCX_NET_DEVICES=lo")
	srv := exec.Command("ucx_perftest", "-p", port)
	srv.Env = env
	if err := srv.Start(); err != nil {
		t.Fatalf("ucx_perftest: %v", err)
	}
	defer func() { _ = srv.Process.Kill(); _ = srv.Wait() }()
	iters := strconv.Itoa(max(5, min(2000, (1<<30)/size)))
	for i := 0; ; i++ {
		time.Sleep(200 * time.Millisecond)
		cl := exec.Command("ucx_perftest", "127.0.0.1", "-p", port, "-t", "ucp_put_bw", "-s", strconv.Itoa(size), "-n", iters)
		cl.Env = env
		b, err := cl.CombinedOutput()
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(f) >= 6 && f[0] == "Final:" {
				v, _ := strconv.ParseFloat(f[5], 64)
				return v
			}
		}
		if i == 10 {
			t.Fatalf("ucx_perftest client: %v\n%s", err, b)
		}
	}
}
