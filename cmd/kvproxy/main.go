// Command kvproxy is the KV-transfer sidecar next to one engine. The
// engine registers memory it owns (a memfd, or CUDA memory by IPC handle)
// over the control socket; SGLang (through the Mooncake-compatible
// TransferEngine in python/) then writes into peer engines by address, and
// an engine that wants rooms (our mock engine) describes its KV layout and
// calls Expect/Send/Poll/Abort, whose pages move by the same writes over
// the same links. Peers name this kvproxy by its peer address (the
// engine's rpc address), so keep --peer-port fixed across restarts. The
// prefill kvproxy also serves SGLang's bootstrap API on the bootstrap port.
// /health, /metrics and /status (each peer link's path per pair of memory
// places, JSON) are on the metrics port. The sidecar itself is package
// kvtransfer/sidecar; this command parses flags and runs it until SIGINT or
// SIGTERM. It first re-executes itself with GODEBUG's schedtrace set
// (package internal/sysmon: an idle spell between small writes then does
// not cost a wake of the runtime's monitor thread; GODEBUG=schedtrace=0
// opts out).
//
// Once everything listens it prints one line:
//
//	kvproxy ready role=R transport=T control=PATH metrics=H:P peer=H:P bootstrap=H:P
package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/pdrouter/pdrouter/internal/netutil"
	"github.com/pdrouter/pdrouter/internal/sysmon"
	"github.com/pdrouter/pdrouter/kvtransfer/sidecar"
)

func main() {
	sysmon.KeepAwake() // before anything else: it may re-execute kvproxy
	cfg, logLevel := flags(flag.CommandLine)
	flag.Parse()
	if flag.NArg() > 0 {
		// flag stops at the first non-flag word: every flag after it would
		// be ignored without a word.
		fmt.Fprintf(os.Stderr, "kvproxy: unexpected argument %q (flags after it would be ignored)\n", flag.Arg(0))
		os.Exit(2)
	}
	if err := run(*cfg, *logLevel); err != nil {
		fmt.Fprintln(os.Stderr, "kvproxy:", err)
		os.Exit(1)
	}
}

// flags defines kvproxy's flags on fs, each defaulting to
// sidecar.DefaultConfig's value.
func flags(fs *flag.FlagSet) (*sidecar.Config, *string) {
	cfg := sidecar.DefaultConfig()
	fs.StringVar(&cfg.Role, "role", cfg.Role, "prefill or decode")
	fs.StringVar(&cfg.Transport, "transport", cfg.Transport, "ucx, tcp or shm (UCX_TLS passes through to ucx, which copies as shm does to a kvproxy of the same host id; shm: engine memory between kvproxies of one host)")
	fs.StringVar(&cfg.Control, "control", cfg.Control, "Unix socket the engine connects to")
	fs.StringVar(&cfg.Host, "host", cfg.Host, "address to listen on and advertise to peers")
	fs.IntVar(&cfg.BootstrapPort, "bootstrap-port", cfg.BootstrapPort, "prefill: bootstrap HTTP API port (0: any; negative: none, when SGLang serves its own)")
	fs.IntVar(&cfg.PeerPort, "peer-port", cfg.PeerPort, "peer protocol port: links to peer kvproxies, the rank port the bootstrap API hands out (0: any)")
	fs.IntVar(&cfg.MetricsPort, "metrics-port", cfg.MetricsPort, "/health and /metrics port (0: any)")
	fs.DurationVar(&cfg.BootstrapTimeout, "bootstrap-timeout", cfg.BootstrapTimeout, "a room not matched by its peer within this fails")
	fs.DurationVar(&cfg.WaitingTimeout, "waiting-timeout", cfg.WaitingTimeout, "a matched room not finished within this fails")
	fs.DurationVar(&cfg.Heartbeat, "heartbeat-interval", cfg.Heartbeat, "peer heartbeat; two missed intervals fail the peer's rooms")
	fs.DurationVar(&cfg.WriteTimeout, "write-timeout", cfg.WriteTimeout, "an engine-memory write (or probe) not complete within this fails")
	fs.IntVar(&cfg.StageChunk, "stage-chunk", cfg.StageChunk, "bytes of GPU memory the staged cross-host path gathers and sends per chunk (0: 1 MiB; at most 8 MiB)")
	fs.StringVar(&cfg.HostID, "host-id", cfg.HostID, "this machine's identity to peer kvproxies (default: the boot id); give two kvproxies of one host different ids to make them treat each other as remote")
	logLevel := fs.String("log-level", "info", "debug, info, warn or error")
	return &cfg, logLevel
}

func run(cfg sidecar.Config, logLevel string) error {
	var level zapcore.Level
	if err := level.Set(logLevel); err != nil {
		return err
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(level)
	log, err := zc.Build()
	if err != nil {
		return err
	}
	defer log.Sync()
	cfg.Logger = log
	if soft, hard, err := netutil.RaiseFileLimit(); err == nil {
		log.Info("open-file limit", zap.Uint64("soft", soft), zap.Uint64("hard", hard))
	}

	s, err := sidecar.Start(cfg)
	if err != nil {
		return err
	}
	a := s.Addrs()
	fmt.Printf("kvproxy ready role=%s transport=%s control=%s metrics=%s peer=%s bootstrap=%s\n",
		cfg.Role, s.TransportName(), a.Control, a.Metrics, cmp.Or(a.Peer, "-"), cmp.Or(a.Bootstrap, "-"))

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	select {
	case <-ctx.Done():
	case <-s.Done():
	}
	return s.Close()
}
