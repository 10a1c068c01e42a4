package chaos

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// Row 9: one of two decode workers is SIGSTOPped under steady load. Once
// the router has ejected it (the first detection window), at most 1 % of
// requests may wait more than twice the p99 measured before the stop.
func TestHungDecodeIsEjected(t *testing.T) {
	policies := []string{"cache_aware", "round_robin"} // steered by load, and blind to it
	if os.Getenv("CHAOS_FULL") == "1" {
		policies = append(policies, "power_of_two")
	}
	for _, policy := range policies {
		t.Run(policy, func(t *testing.T) { hungDecode(t, policy) })
	}
}

// sample is one client request: when it started, how long it took, and
// its status (0: no answer).
type sample struct {
	start  time.Time
	took   time.Duration
	status int
}

func hungDecode(t *testing.T, policy string) {
	const rate = 40 // requests a second
	warm := time.Duration(size(3, 10)) * time.Second
	measure := time.Duration(size(6, 20)) * time.Second
	decodeArgs := []string{"--role", "decode", "--port", "0", "--tokens", "10", "--token-delay", "25ms"}
	mock := testenv.Binary(t, "mockworker")
	prefill := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "}, "--role", "prefill", "--port", "0")
	hung := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "}, decodeArgs...)
	other := testenv.StartWith(t, mock, testenv.Options{Ready: "listening on "}, decodeArgs...)
	// Registered after the Starts, so it runs before their Stops: a
	// stopped process only sees SIGTERM once continued.
	t.Cleanup(func() { _ = hung.Signal(syscall.SIGCONT) })

	port, prom := testenv.FreePort(t), testenv.FreePort(t)
	base := "http://127.0.0.1:" + strconv.Itoa(port)
	metrics := "http://127.0.0.1:" + strconv.Itoa(prom) + "/metrics"
	testenv.Start(t, testenv.Binary(t, "pdrouter"), "--host", "127.0.0.1", "--port", strconv.Itoa(port),
		"--prometheus-host", "127.0.0.1", "--prometheus-port", strconv.Itoa(prom), "--log-level", "warn",
		"--pd-disaggregation", "--prefill", prefill.URL(), "none", "--decode", hung.URL(), "--decode", other.URL(),
		"--policy", policy, "--health-check-timeout-secs", "1",
		// The full pass ejects for 5 s, 10 s, ...: half-open, the stopped
		// worker must cost next to nothing each time.
		"--cb-timeout-duration-secs", strconv.Itoa(size(60, 5)), "--request-timeout-secs", strconv.Itoa(size(30, 10)),
		"--outlier-first-byte-timeout-secs", "1")
	testenv.WaitStatus(t, base+"/readiness", 200, 30*time.Second)
	waitWorkers(t, base, 3)

	// Open loop: requests arrive at a steady rate whatever their latency,
	// as from many independent clients.
	var (
		mu      sync.Mutex
		samples []sample
		stop    = make(chan struct{})
		wg      sync.WaitGroup
	)
	long := &http.Client{Timeout: 40 * time.Second}
	wg.Go(func() {
		tick := time.NewTicker(time.Second / rate)
		defer tick.Stop()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			wg.Go(func() {
				body := fmt.Sprintf(`{"text":"client %d asks question %d","stream":%t,"sampling_params":{"max_new_tokens":10}}`,
					i%8, i%16, i%2 == 0)
				s := sample{start: time.Now()}
				if resp, err := long.Post(base+"/generate", "application/json", strings.NewReader(body)); err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					s.status = resp.StatusCode
				}
				s.took = time.Since(s.start)
				mu.Lock()
				samples = append(samples, s)
				mu.Unlock()
			})
		}
	})
	stopLoad := func() {
		close(stop)
		_ = hung.Signal(syscall.SIGCONT) // let the requests it holds finish
		wg.Wait()
	}

	time.Sleep(warm)
	if err := hung.Signal(syscall.SIGSTOP); err != nil {
		stopLoad()
		t.Fatal(err)
	}
	stopped := time.Now()
	detected, ok := waitEjected(metrics, hung.URL(), 20*time.Second)
	if !ok {
		stopLoad()
		t.Fatalf("the stopped decode was not ejected within 20 s")
	}
	time.Sleep(measure)
	end := time.Now()
	stopLoad()

	var warmTimes []time.Duration
	var after []sample
	for _, s := range samples {
		switch {
		case s.start.After(stopped.Add(-warm+time.Second)) && s.start.Add(s.took).Before(stopped) && s.status == 200:
			warmTimes = append(warmTimes, s.took)
		case !s.start.Before(detected) && s.start.Before(end):
			after = append(after, s)
		}
	}
	if len(warmTimes) < 20 || len(after) < 50 {
		t.Fatalf("too few requests to judge: %d before the stop, %d after the ejection", len(warmTimes), len(after))
	}
	slices.Sort(warmTimes)
	p99 := warmTimes[len(warmTimes)*99/100]
	var slow, failed int
	var worst, badWait time.Duration
	for _, s := range after {
		worst = max(worst, s.took)
		switch {
		case s.status != 200:
			failed++
		case s.took > 2*p99:
			slow++
		default:
			continue
		}
		badWait += s.took
	}
	t.Logf("%s: p99 %v before the stop; ejected %v after it; then %d requests in %v: %d slower than %v and %d failed (%v average), worst %v",
		policy, p99.Round(time.Millisecond), detected.Sub(stopped).Round(time.Millisecond), len(after),
		end.Sub(detected).Round(time.Second), slow, (2 * p99).Round(time.Millisecond), failed,
		(badWait / time.Duration(max(slow+failed, 1))).Round(time.Millisecond), worst.Round(time.Millisecond))
	if bad := slow + failed; bad*100 > len(after) {
		t.Errorf("%d of %d requests after the ejection were slow or failed, want <= 1 %%", bad, len(after))
	}
}

// waitEjected polls the router's metrics until the worker's breaker is
// open and returns when it saw that.
func waitEjected(metrics, worker string, d time.Duration) (time.Time, bool) {
	want := `smg_worker_cb_state{worker="` + worker + `"} 1`
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		resp, err := client.Get(metrics)
		if err != nil {
			continue
		}
		found := false
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			found = found || sc.Text() == want
		}
		resp.Body.Close()
		if found {
			return time.Now(), true
		}
	}
	return time.Time{}, false
}

// waitWorkers waits until the router lists n registered workers.
func waitWorkers(t *testing.T, base string, n int) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if resp, err := client.Get(base + "/workers"); err == nil {
			var list struct {
				Total int `json:"total"`
			}
			err := json.NewDecoder(resp.Body).Decode(&list)
			resp.Body.Close()
			if err == nil && list.Total == n {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("router did not list %d workers", n)
		}
	}
}
