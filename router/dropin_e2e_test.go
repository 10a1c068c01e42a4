package router_test

import (
	"net/http"
	"testing"
	"time"
)

// Behaviours where pdrouter was measured against sglang-router 0.3.2.
func TestPowerOfTwoWithOnePrefillAndOneDecode(t *testing.T) {
	p, d := startWorker(t, "prefill"), startWorker(t, "decode")
	// 0.3.2 counts both sides together for --policy power_of_two.
	r := startSecureRouter(t, "http", client, "--pd-disaggregation", "--policy", "power_of_two",
		"--prefill", p.URL(), "8998", "--decode", d.URL())
	waitCode(t, client, "GET", r.base+"/readiness", "", 200, 30*time.Second)
	if code, body, err := call(client, "POST", r.base+"/generate", "", `{"text":"hi"}`); err != nil || code != 200 {
		t.Fatalf("generate: %d %s %v", code, body, err)
	}
}

func TestNotFoundKeepsRequestID(t *testing.T) {
	r := startSecureRouter(t, "http", client)
	for _, hdr := range []string{"", "client-id-7"} {
		req, _ := http.NewRequest("GET", r.base+"/no/such/route", nil)
		if hdr != "" {
			req.Header.Set("x-request-id", hdr)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		got := resp.Header.Get("x-request-id")
		if resp.StatusCode != 404 || got == "" || (hdr != "" && got != hdr) {
			t.Errorf("404 with x-request-id %q: status %d, x-request-id %q", hdr, resp.StatusCode, got)
		}
	}
}
