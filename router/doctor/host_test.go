package doctor

import (
	"context"
	"errors"
	"net"
	"strings"
	"testing"

	"github.com/pdrouter/pdrouter/balancer"
)

// The bootstrap_host finding on names a fake resolver knows: nothing here
// is dialled.
func TestBootstrapHostFinding(t *testing.T) {
	names := map[string][]string{
		"localhost":      {"::1", "127.0.0.1"},
		"prefill.lan":    {"10.0.0.9"},
		"decode.lan":     {"10.0.0.7"},
		"router-nic.lan": {"10.0.0.5"}, // an address of the router's own machine
		"any.lan":        {"0.0.0.0"},
	}
	look := hostLookup{
		resolve: func(_ context.Context, host string) ([]net.IP, error) {
			if ip := net.ParseIP(host); ip != nil {
				return []net.IP{ip}, nil
			}
			addrs, ok := names[host]
			if !ok {
				return nil, errors.New("no such host")
			}
			var ips []net.IP
			for _, a := range addrs {
				ips = append(ips, net.ParseIP(a))
			}
			return ips, nil
		},
		local: func(ip net.IP) bool { return ip.IsLoopback() || ip.Equal(net.ParseIP("10.0.0.5")) },
	}
	for _, c := range []struct {
		prefill string
		decodes []string
		verdict string
		detail  string
	}{
		{"http://127.0.0.1:30000", []string{"http://127.0.0.1:30001", "http://localhost:30002"}, VerdictOK, "127.0.0.1 is loopback, and every decode runs on this host"},
		{"http://localhost:30000", []string{"http://router-nic.lan:30001"}, VerdictOK, "localhost is loopback, and every decode runs on this host"},
		{"http://[::1]:30000", []string{"http://decode.lan:30001"}, VerdictFail, "::1 is loopback, but decode http://decode.lan:30001 (10.0.0.7) runs on another host"},
		{"http://127.0.0.1:30000", []string{"http://127.0.0.1:30001", "http://10.0.0.8:30002"}, VerdictFail, "decode http://10.0.0.8:30002 (10.0.0.8) runs on another host"},
		{"http://127.0.0.1:30000", []string{"http://gone.lan:30001"}, VerdictFail, "cannot tell whether decode http://gone.lan:30001 runs on this host: no such host"},
		{"http://prefill.lan:30000", []string{"http://decode.lan:30001"}, VerdictOK, "prefill.lan resolves to 10.0.0.9"},
		{"http://0.0.0.0:30000", []string{"http://127.0.0.1:30001"}, VerdictFail, "0.0.0.0 is a wildcard address"},
		{"http://any.lan:30000", []string{"http://127.0.0.1:30001"}, VerdictFail, "any.lan is a wildcard address"},
		{"http://[::]:30000", []string{"http://127.0.0.1:30001"}, VerdictFail, ":: is a wildcard address"},
		{"http://nowhere.lan:30000", []string{"http://127.0.0.1:30001"}, VerdictFail, "nowhere.lan does not resolve: no such host"},
	} {
		workers := []*balancer.Worker{balancer.NewWorker(c.prefill, balancer.Prefill, 8998)}
		for _, d := range c.decodes {
			workers = append(workers, balancer.NewWorker(d, balancer.Decode, balancer.NoBootstrapPort))
		}
		fs := bootstrapHostChecks(context.Background(), workers, look)
		if len(fs) != 1 || fs[0].Verdict != c.verdict || fs[0].Check != "bootstrap_host" || !strings.Contains(fs[0].Detail, c.detail) {
			t.Errorf("prefill %s, decodes %v: got %+v, want %s ...%s...", c.prefill, c.decodes, fs, c.verdict, c.detail)
		}
	}
}
