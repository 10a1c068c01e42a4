package main

import (
	"context"
	"fmt"
	"io"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/pdrouter/pdrouter/internal/cli"
	"github.com/pdrouter/pdrouter/router"
	"github.com/pdrouter/pdrouter/router/doctor"
)

// runDoctor is `pdrouter doctor <router flags>`: it checks the deployment
// the flags describe (router.Server.Doctor) without serving, prints one
// line per finding and exits 1 if any failed (2 for bad flags).
func runDoctor(args []string, stdout, stderr io.Writer) int {
	p, o := newParser()
	if err := p.Parse(args); err != nil {
		if err == cli.ErrHelp {
			fmt.Fprintln(stdout, "usage: pdrouter doctor <the router's flags>")
			p.Help(stdout)
			return 0
		}
		p.Usage(stderr, err)
		return 2
	}
	cfg, err := o.config()
	if err != nil {
		p.Usage(stderr, err)
		return 2
	}
	srv, err := router.New(cfg, zap.NewNop(), prometheus.NewRegistry())
	if err != nil {
		fmt.Fprintln(stderr, "pdrouter doctor:", err)
		return 2
	}
	findings := srv.Doctor(context.Background())
	for _, f := range findings {
		fmt.Fprintln(stdout, f)
	}
	if !doctor.Healthy(findings) {
		fmt.Fprintln(stdout, "doctor: problems found")
		return 1
	}
	fmt.Fprintln(stdout, "doctor: all checks passed")
	return 0
}
