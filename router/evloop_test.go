package router

import "testing"

func TestEventLoopsConfig(t *testing.T) {
	for n, ok := range map[int]bool{-1: false, 0: true, 4: true, 1025: false} {
		cfg := DefaultConfig()
		cfg.WorkerURLs = []string{"http://127.0.0.1:1"}
		cfg.EventLoops = n
		if err := cfg.Validate(); (err == nil) != ok {
			t.Errorf("EventLoops %d: Validate = %v, want ok %v", n, err, ok)
		}
	}
}
