package router

import (
	"net/http"
	"strings"
	"testing"
)

// Issue 26 item 6: an engine's error about the KV transfer reached the
// client word for word, naming the kvproxy's control socket and the
// internal bootstrap address. The client is now told the KV transfer
// failed, and nothing of where.
func TestKVTransferErrorHidesInternals(t *testing.T) {
	engineSays := `{"error":{"message":"KV transfer failed: kvproxy expect: dial unix /run/pdrouter/kv.sock: connect: no such file or directory (bootstrap http://10.1.2.3:8998/route)"}}`
	for _, side := range []string{"prefill", "decode"} {
		t.Run(side, func(t *testing.T) {
			failing := legWorker(t, func(w http.ResponseWriter, r *http.Request) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(500)
				w.Write([]byte(engineSays))
			})
			cfg := legPDConfig(legWorker(t, answer(200)), failing)
			if side == "prefill" { // decode waits for the KV, which never comes
				cfg = legPDConfig(failing, legWorker(t, hang))
			}
			e := startLegEnv(t, cfg)
			status, body, err := e.post(t, t.Context(), `{"text":"x"}`)
			if err != nil || status != 500 {
				t.Fatalf("status %d err %v: %s", status, err, body)
			}
			if !strings.Contains(body, "KV transfer") || !strings.Contains(body, `"code":"kv_transfer_failed"`) ||
				strings.Contains(body, "kv.sock") || strings.Contains(body, "10.1.2.3") {
				t.Fatalf("client got %s; want a KV transfer failure naming no socket or address", body)
			}
		})
	}
}
