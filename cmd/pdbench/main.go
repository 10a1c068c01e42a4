// Command pdbench is a load tester for OpenAI-compatible and SGLang endpoints, with
// sglang.bench_serving's flags and metric definitions:
//
//	pdbench --backend openai-chat --base-url http://127.0.0.1:8000 --dataset-name random \
//	    --num-prompts 1000 --request-rate 50 --output-file out.jsonl --plot out.html
//
// Token lengths are counted in words (see package loadgen). Ctrl-C stops the run and reports what
// finished; a second Ctrl-C exits at once.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/pdrouter/pdrouter/bench/loadgen"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	context.AfterFunc(ctx, stop) // the second signal gets the default action
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr, isTerminal(os.Stderr))
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "pdbench:", err)
		os.Exit(1)
	}
}

func isTerminal(f *os.File) bool {
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer, tty bool) error {
	fs := flag.NewFlagSet("pdbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	var (
		backend     = fs.String("backend", "sglang", "API: openai-chat (/v1/chat/completions), openai (/v1/completions) or sglang (/generate)")
		baseURL     = fs.String("base-url", "http://127.0.0.1:30000", "server to load")
		model       = fs.String("model", "", "model name; read from GET /v1/models when empty")
		rate        = fs.Float64("request-rate", math.Inf(1), "Poisson arrivals per second; inf sends all at once (ignored by trace, which keeps its timestamps)")
		maxConc     = fs.Int("max-concurrency", 0, "cap on requests in flight (a closed loop with --request-rate inf); 0 = none")
		warmupN     = fs.Int("warmup-requests", 1, "unmeasured requests sent before the run")
		seed        = fs.Uint64("seed", 1, "seed for datasets and arrival times")
		noStream    = fs.Bool("disable-stream", false, "ask for whole replies (TTFT = E2E)")
		noIgnoreEOS = fs.Bool("disable-ignore-eos", false, "do not send ignore_eos")
		extraBody   = fs.String("extra-request-body", "", "JSON object merged into every request body")
		timeout     = fs.Duration("request-timeout", 30*time.Minute, "per-request timeout")
		sloTTFT     = fs.Float64("slo-ttft-ms", 0, "TTFT SLO for goodput, ms; 0 = none")
		sloTPOT     = fs.Float64("slo-tpot-ms", 0, "TPOT SLO for goodput, ms; 0 = none")
		outFile     = fs.String("output-file", "", "append the run's results as one JSON line to this file")
		details     = fs.Bool("output-details", false, "include per-request arrays in --output-file")
		plot        = fs.String("plot", "", "write latency CDFs and throughput over time to this HTML file")
		ds          loadgen.DatasetConfig
	)
	fs.StringVar(&ds.Name, "dataset-name", "random", "random, generated-shared-prefix, sharegpt or trace")
	fs.StringVar(&ds.Path, "dataset-path", "", "ShareGPT JSON file, or trace JSONL (timestamp in ms, input_len, output_len)")
	fs.IntVar(&ds.NumPrompts, "num-prompts", 1000, "requests to send (generated-shared-prefix sends groups × prompts per group; a trace at most this many)")
	fs.IntVar(&ds.RandomInputLen, "random-input-len", 1024, "random: input tokens (words)")
	fs.IntVar(&ds.RandomOutputLen, "random-output-len", 1024, "random: output tokens")
	fs.Float64Var(&ds.RandomRangeRatio, "random-range-ratio", 0, "random: lengths are uniform in [len*ratio, len]")
	fs.IntVar(&ds.GSPNumGroups, "gsp-num-groups", 64, "generated-shared-prefix: groups (one system prompt each)")
	fs.IntVar(&ds.GSPPromptsPerGroup, "gsp-prompts-per-group", 16, "generated-shared-prefix: questions per group")
	fs.IntVar(&ds.GSPSystemPromptLen, "gsp-system-prompt-len", 2048, "generated-shared-prefix: system prompt tokens")
	fs.IntVar(&ds.GSPQuestionLen, "gsp-question-len", 128, "generated-shared-prefix: question tokens")
	fs.IntVar(&ds.GSPOutputLen, "gsp-output-len", 256, "generated-shared-prefix: output tokens")
	fs.IntVar(&ds.ShareGPTOutputLen, "sharegpt-output-len", 0, "sharegpt: fixed output tokens; 0 = the reply's length")
	fs.Float64Var(&ds.TraceSpeedup, "trace-speedup", 1, "trace: replay this many times faster")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	be, err := loadgen.ParseBackend(*backend)
	if err != nil {
		return err
	}
	opts := loadgen.BodyOptions{Model: *model, Stream: !*noStream, IgnoreEOS: !*noIgnoreEOS}
	if *extraBody != "" {
		if err := json.Unmarshal([]byte(*extraBody), &opts.ExtraBody); err != nil {
			return fmt.Errorf("--extra-request-body: %w", err)
		}
	}
	prompts, err := ds.Load(rand.New(rand.NewPCG(*seed, 1)))
	if err != nil {
		return err
	}
	apiKey := os.Getenv("OPENAI_API_KEY")
	if opts.Model == "" {
		if opts.Model, err = loadgen.DiscoverModel(ctx, *baseURL, apiKey); err != nil {
			if be != loadgen.SGLang { // /generate needs no model name
				return fmt.Errorf("%w (pass --model)", err)
			}
			fmt.Fprintln(stderr, "pdbench: no model name:", err)
		}
	}
	reqs, err := loadgen.BuildRequests(be, prompts, opts)
	if err != nil {
		return err
	}
	var at []time.Duration
	if ds.Name == "trace" {
		at = loadgen.TraceSchedule(reqs)
	} else {
		at = loadgen.Schedule(rand.New(rand.NewPCG(*seed, 2)), len(reqs), *rate)
	}
	sender := loadgen.NewSender(loadgen.SenderConfig{BaseURL: *baseURL, Backend: be, APIKey: apiKey,
		Timeout: *timeout, MaxConns: max(*maxConc, min(len(reqs), 1024))})
	defer sender.Close()
	info := loadgen.Info{Backend: be, Dataset: ds.Name, BaseURL: *baseURL, Model: opts.Model,
		RequestRate: *rate, MaxConcurrency: *maxConc, NumPrompts: len(reqs), DatasetArgs: ds.Args(),
		SLO: loadgen.SLO{TTFT: msDuration(*sloTTFT), TPOT: msDuration(*sloTPOT)}}

	progress := loadgen.StartProgress(stderr, tty, len(reqs))
	out, err := loadgen.Run(ctx, loadgen.RunConfig{Sender: sender, Requests: reqs, At: at,
		Warmup: *warmupN, MaxConcurrency: *maxConc, Progress: progress})
	progress.Stop()
	if err != nil {
		return err
	}
	m := loadgen.Compute(out.Results, out.Duration, info.SLO)
	loadgen.PrintTable(stdout, info, out, m)
	var errs []error
	if *outFile != "" {
		errs = append(errs, loadgen.AppendRecord(*outFile, loadgen.Record(info, out, m, *details)))
	}
	if *plot != "" {
		errs = append(errs, writePlot(*plot, info, out))
	}
	return errors.Join(errs...)
}

func msDuration(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func writePlot(path string, info loadgen.Info, out *loadgen.Outcome) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := loadgen.WritePlot(f, info, out); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
