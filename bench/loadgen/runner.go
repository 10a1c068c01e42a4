package loadgen

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// RunConfig is one benchmark run.
type RunConfig struct {
	Sender   *Sender
	Requests []Request
	// At is when to send each request, as offsets from the start (Schedule or TraceSchedule).
	At []time.Duration
	// Warmup requests are sent concurrently before the clock starts and are not measured.
	Warmup int
	// MaxConcurrency caps requests in flight; 0 means no cap. With a burst schedule it makes the
	// run a closed loop of that many clients.
	MaxConcurrency int
	// Progress, when set, is told about every finished request.
	Progress *Progress
}

// Outcome is what a run measured.
type Outcome struct {
	Results  []Result // requests that finished (successes and failures), in send order
	Duration time.Duration
	Sent     int
	Partial  bool // the run was stopped before every request was sent and answered
}

// Run sends the requests on their schedule and waits for the replies. Cancelling ctx (Ctrl-C)
// stops sending, aborts requests in flight and returns what finished before, marked Partial.
func Run(ctx context.Context, c RunConfig) (*Outcome, error) {
	if len(c.At) != len(c.Requests) || len(c.Requests) == 0 {
		return nil, fmt.Errorf("run: %d requests, %d send times", len(c.Requests), len(c.At))
	}
	if err := warmup(ctx, c); err != nil {
		return nil, err
	}
	if ctx.Err() != nil {
		return &Outcome{Partial: true}, nil
	}
	now := c.Sender.now
	var sem chan struct{}
	if c.MaxConcurrency > 0 {
		sem = make(chan struct{}, c.MaxConcurrency)
	}
	results := make([]Result, len(c.Requests))
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	start := now()
	sent := 0
send:
	for i := range c.Requests {
		if d := c.At[i] - now().Sub(start); d > 0 {
			timer.Reset(d)
			select {
			case <-timer.C:
			case <-ctx.Done():
				break send
			}
		}
		if sem != nil {
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				break send
			}
		} else if ctx.Err() != nil {
			break
		}
		sent++
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = c.Sender.Send(ctx, &c.Requests[i])
			if sem != nil {
				<-sem
			}
			if c.Progress != nil && results[i].Err != errCancelled {
				c.Progress.add(results[i].Err != "")
			}
		}()
	}
	finished := make(chan struct{})
	go func() { wg.Wait(); close(finished) }()
	var end time.Time
	select {
	case <-finished:
		end = now()
	case <-ctx.Done():
		end = now()
		<-finished
	}
	o := &Outcome{Duration: end.Sub(start), Sent: sent, Partial: ctx.Err() != nil}
	for _, r := range results[:sent] {
		if r.Err != errCancelled {
			o.Results = append(o.Results, r)
		}
	}
	return o, nil
}

// warmup sends c.Warmup requests at once (at most MaxConcurrency) and fails the run when all of
// them fail, since then the endpoint or the flags are wrong and measuring would be meaningless.
func warmup(ctx context.Context, c RunConfig) error {
	n := c.Warmup
	if n <= 0 {
		return nil
	}
	par := n
	if c.MaxConcurrency > 0 {
		par = min(n, c.MaxConcurrency)
	}
	results := make([]Result, n)
	var wg sync.WaitGroup
	next := make(chan int)
	for range par {
		wg.Go(func() {
			for i := range next {
				results[i] = c.Sender.Send(ctx, &c.Requests[i%len(c.Requests)])
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	for _, r := range results {
		if r.Err == "" || r.Err == errCancelled {
			return nil
		}
	}
	return fmt.Errorf("warm-up: all %d requests failed, first: %s: %s", n, results[0].Err, results[0].Msg)
}
