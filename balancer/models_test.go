package balancer

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
)

// An engine with no /server_info (vLLM) is known by its /v1/models; one
// whose list is unreadable stays unknown and registers all the same.
func TestManagerModelFromV1Models(t *testing.T) {
	serve := func(models string) string {
		mux := http.NewServeMux()
		mux.HandleFunc("/health", func(http.ResponseWriter, *http.Request) {})
		mux.HandleFunc("/v1/models", func(w http.ResponseWriter, _ *http.Request) { w.Write([]byte(models)) })
		s := httptest.NewServer(mux)
		t.Cleanup(s.Close)
		return s.URL
	}
	m := newTestManager(t, ManagerConfig{})
	for models, want := range map[string]string{
		`{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B","object":"model"},{"id":"lora"}]}`: "meta-llama/Llama-3.1-8B",
		`{"data":[]}`: "unknown",
		`not json`:    "unknown",
	} {
		id, err := m.Add(WorkerSpec{URL: serve(models), WorkerType: "prefill"})
		if err != nil {
			t.Fatal(err)
		}
		if err := m.Await(context.Background(), id); err != nil {
			t.Fatal(err)
		}
		if got := m.Snapshot().ByID(id).ModelID; got != want {
			t.Errorf("%s: model %q, want %q", models, got, want)
		}
	}
}
