package loadgen

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Progress reports a run's progress: a bar redrawn in place on a terminal, else a plain line every
// few seconds so logs stay readable.
type Progress struct {
	w      io.Writer
	tty    bool
	total  int
	start  time.Time
	done   atomic.Int64
	failed atomic.Int64
	stop   chan struct{}
	wg     sync.WaitGroup
}

// StartProgress starts drawing to w until Stop.
func StartProgress(w io.Writer, tty bool, total int) *Progress {
	p := &Progress{w: w, tty: tty, total: total, start: time.Now(), stop: make(chan struct{})}
	every := 5 * time.Second
	if tty {
		every = 200 * time.Millisecond
	}
	p.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		for {
			select {
			case <-t.C:
				p.draw()
			case <-p.stop:
				return
			}
		}
	})
	return p
}

func (p *Progress) add(failed bool) {
	p.done.Add(1)
	if failed {
		p.failed.Add(1)
	}
}

// Stop draws the final state and ends the drawing goroutine.
func (p *Progress) Stop() {
	close(p.stop)
	p.wg.Wait()
	p.draw()
	if p.tty {
		fmt.Fprintln(p.w)
	}
}

func (p *Progress) draw() {
	done, failed := int(p.done.Load()), p.failed.Load()
	el := time.Since(p.start)
	rate := float64(done) / max(el.Seconds(), 1e-9)
	if !p.tty {
		fmt.Fprintf(p.w, "pdbench: %d/%d done, %d failed, %.1f req/s, %s\n", done, p.total, failed, rate, el.Round(time.Second))
		return
	}
	const width = 30
	fill := width * min(done, p.total) / max(p.total, 1)
	fmt.Fprintf(p.w, "\r[%s%s] %d/%d  %d failed  %.1f req/s  %s ", strings.Repeat("=", fill),
		strings.Repeat(" ", width-fill), done, p.total, failed, rate, el.Round(time.Second))
}
