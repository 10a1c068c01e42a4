package router_test

import (
	"encoding/json"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/pdrouter/pdrouter/testkit/testenv"
)

// vllmKVFlags keep the mocks' KV pools small: 2 layers × K,V × 64 bytes a
// token, 16 tokens a page.
var vllmKVFlags = []string{"--kv-layers", "2", "--kv-bytes-per-token", "64", "--kv-pool-tokens", "65536"}

const vllmKVPageBytes = 2 * 2 * 64 * 16

// startVLLMKVWorker runs a vLLM mock with its own kvproxy (tcp); a
// prefill's kvproxy serves its bootstrap API on the port the mock names
// in kv_transfer_params, which is boot when boot is not 0.
func startVLLMKVWorker(t *testing.T, role string, boot int, args ...string) worker {
	t.Helper()
	kvRole := strings.TrimPrefix(role, "vllm-")
	sock := filepath.Join(t.TempDir(), kvRole+".sock")
	pargs := []string{"--role", kvRole, "--transport", "tcp", "--control", sock, "--host", "127.0.0.1",
		"--metrics-port", "0", "--bootstrap-timeout", "10s", "--waiting-timeout", "10s", "--log-level", "warn"}
	proxyBoot := testenv.FreePort(t)
	if kvRole == "prefill" {
		pargs = append(pargs, "--bootstrap-port", strconv.Itoa(proxyBoot))
	}
	testenv.StartWith(t, testenv.BuildBinary(t, "kvproxy", testenv.Build{CGO: true, NoRace: true}),
		testenv.Options{Ready: "kvproxy ready", ReadyTimeout: 20 * time.Second}, pargs...)
	if boot == 0 {
		boot = proxyBoot
	}
	return startWorker(t, role, append(append([]string{"--kvproxy", sock, "--bootstrap-port", strconv.Itoa(boot)}, vllmKVFlags...), args...)...)
}

type kvTransfer struct {
	Bytes      int64  `json:"bytes"`
	Pages      int64  `json:"pages"`
	Transport  string `json:"transport"`
	ChecksumOK bool   `json:"checksum_ok"`
}

// Through the router, the decode mock brings the prefill mock's KV in
// through the two kvproxies: every page checked (checksum_ok in its reply
// and in its pull record), the prefill's blocks let go, streamed or not.
func TestVLLMKVThroughKVProxy(t *testing.T) {
	t.Parallel()
	p := startVLLMKVWorker(t, "vllm-prefill", 0)
	d := startVLLMKVWorker(t, "vllm-decode", 0, "--tokens", "3")
	r := vllmPD(t, []worker{p}, []worker{d})
	prompt := strings.Repeat("w ", 100) // 100 tokens: 7 pages
	for _, stream := range []bool{false, true} {
		body := `{"model":"mock","prompt":"` + prompt + `","max_tokens":3,"stream":` + strconv.FormatBool(stream) + `}`
		resp, out := post(t, r.url+"/v1/completions", body)
		if resp.StatusCode != 200 {
			t.Fatalf("stream %v: %d %s", stream, resp.StatusCode, out)
		}
		reply := out
		if stream { // kv_transfer comes in the last chunk
			ev := sseEvents(out)
			if len(ev) < 2 || ev[len(ev)-1] != "[DONE]" {
				t.Fatalf("stream: %q", out)
			}
			reply = []byte(ev[len(ev)-2])
		}
		var got struct {
			KV *kvTransfer `json:"kv_transfer"`
		}
		if err := json.Unmarshal(reply, &got); err != nil || got.KV == nil {
			t.Fatalf("stream %v: no kv_transfer in %s", stream, reply)
		}
		const pages = (100 + 15) / 16
		if kv := *got.KV; !kv.ChecksumOK || kv.Pages != pages || kv.Bytes != pages*vllmKVPageBytes+64 || kv.Transport != "tcp" {
			t.Errorf("stream %v: kv_transfer %+v, want %d checked pages over tcp", stream, kv, pages)
		}
		pulls := d.vllmPulls(t)
		if last := pulls[len(pulls)-1]; last.Error != "" || last.KV == nil || !last.KV.ChecksumOK {
			t.Errorf("stream %v: decode recorded %+v", stream, last)
		}
	}
	// The decode checks the bytes: KV made for another prompt of the same
	// length fails its checksum.
	_, out := post(t, p.URL()+"/v1/completions", `{"model":"mock","prompt":"`+prompt+`","max_tokens":1,"kv_transfer_params":`+
		`{"do_remote_decode":true}}`, "X-Request-Id", "x9")
	var pre struct {
		Params json.RawMessage `json:"kv_transfer_params"`
	}
	if err := json.Unmarshal(out, &pre); err != nil || len(pre.Params) == 0 {
		t.Fatalf("prefill reply %s", out)
	}
	other := strings.Repeat("v ", 100)
	resp, out := post(t, d.URL()+"/v1/completions", `{"model":"mock","prompt":"`+other+`","max_tokens":2,"kv_transfer_params":`+
		string(pre.Params)+`}`, "X-Request-Id", "x9")
	if resp.StatusCode != 500 || !strings.Contains(string(out), "checksum mismatch") {
		t.Errorf("decode of another prompt's KV: %d %s, want a 500 saying checksum mismatch", resp.StatusCode, out)
	}

	deadline := time.Now().Add(5 * time.Second)
	for len(p.vllmHeld(t)) != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("prefill still holds %+v after its decodes took the KV", p.vllmHeld(t))
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// A decode whose kv_transfer_params name a prefill kvproxy nobody runs
// fails at once with a 500 naming the address, sent to it directly; through
// the router (a prefill that names a dead bootstrap port) the client hears
// that the KV transfer failed, and nothing of where (issue 26 item 6).
func TestVLLMKVUnreachablePrefill(t *testing.T) {
	t.Parallel()
	dead := testenv.FreePort(t)
	d := startVLLMKVWorker(t, "vllm-decode", 0)
	direct := `{"model":"mock","prompt":"a b c","max_tokens":2,"kv_transfer_params":{"do_remote_prefill":true,"do_remote_decode":false,` +
		`"remote_engine_id":"e","remote_request_id":"cmpl-x1-0","remote_block_ids":[0],"remote_host":"127.0.0.1","remote_port":` +
		strconv.Itoa(dead) + `,"tp_size":1}}`
	start := time.Now()
	resp, out := post(t, d.URL()+"/v1/completions", direct, "X-Request-Id", "x1")
	want := "from the prefill's kvproxy at 127.0.0.1:" + strconv.Itoa(dead)
	if resp.StatusCode != 500 || !strings.Contains(string(out), want) || !strings.Contains(string(out), "connection refused") {
		t.Errorf("decode naming a dead prefill: %d %s, want a 500 saying %q", resp.StatusCode, out, want)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("the failure took %v (the kvproxies' bootstrap timeout is 10 s)", took)
	}

	p := startVLLMKVWorker(t, "vllm-prefill", dead)
	r := vllmPD(t, []worker{p}, []worker{d}, "--disable-retries")
	resp, out = post(t, r.url+"/v1/completions", `{"model":"mock","prompt":"a b c","max_tokens":2}`)
	if resp.StatusCode != 500 || !strings.Contains(string(out), `"code":"kv_transfer_failed"`) || strings.Contains(string(out), strconv.Itoa(dead)) {
		t.Errorf("through the router: %d %s, want a 500 kv_transfer_failed naming no address", resp.StatusCode, out)
	}
	pulls := d.vllmPulls(t)
	if last := pulls[len(pulls)-1]; !strings.Contains(last.Error, want) || last.KV != nil {
		t.Errorf("decode recorded %+v", last)
	}
}
