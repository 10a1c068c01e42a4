package loadgen

import (
	"fmt"
	"html"
	"io"
	"slices"
	"strings"
	"time"
)

// WritePlot writes a self-contained HTML page (inline SVG, no scripts or external assets) with the
// CDFs of TTFT, ITL, TPOT and E2E and the throughput over time of a run.
func WritePlot(w io.Writer, info Info, o *Outcome) error {
	var ttft, itl, tpot, e2e []time.Duration
	for i := range o.Results {
		r := &o.Results[i]
		if r.Err != "" {
			continue
		}
		ttft, e2e = append(ttft, r.TTFT), append(e2e, r.Latency)
		itl = append(itl, r.ITL...)
		if r.OutputLen > 1 {
			tpot = append(tpot, tpotOf(r))
		}
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<!DOCTYPE html><html><head><meta charset="utf-8"><title>pdbench %s</title>
<style>body{font:14px sans-serif;margin:2em}svg{margin:0 1em 1em 0;background:#fafafa}
text{font:11px sans-serif}.t{font:bold 13px sans-serif}</style></head><body>
<h2>pdbench: %s %s on %s</h2><p>rate %v, max concurrency %d, %d completed, %d failed, %.1f s%s</p>
`, html.EscapeString(info.BaseURL), html.EscapeString(string(info.Backend)), html.EscapeString(info.Dataset),
		html.EscapeString(info.BaseURL), rateValue(info.RequestRate), info.MaxConcurrency, len(ttft),
		len(o.Results)-len(ttft), o.Duration.Seconds(), map[bool]string{true: " (interrupted)"}[o.Partial])
	for _, c := range []struct {
		name string
		ds   []time.Duration
	}{{"TTFT", ttft}, {"ITL", itl}, {"TPOT", tpot}, {"E2E latency", e2e}} {
		cdfSVG(&b, c.name, c.ds)
	}
	b.WriteString("<br>")
	throughputSVG(&b, o)
	b.WriteString("</body></html>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

const (
	plotW, plotH = 480, 280
	padL, padB   = 60, 40
	padT, padR   = 30, 20
)

// frame draws the axes, a title and tick labels for x in [0, xmax] and y in [0, ymax].
func frame(b *strings.Builder, title, xlabel string, xmax, ymax float64, yfmt string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d">`, plotW, plotH)
	fmt.Fprintf(b, `<text class="t" x="%d" y="18">%s</text>`, padL, html.EscapeString(title))
	x0, y0, x1, y1 := padL, plotH-padB, plotW-padR, padT
	fmt.Fprintf(b, `<path d="M%d %dV%dH%d" fill="none" stroke="#333"/>`, x0, y1, y0, x1)
	for i := 0; i <= 4; i++ {
		x := float64(x0) + float64(x1-x0)*float64(i)/4
		y := float64(y0) - float64(y0-y1)*float64(i)/4
		fmt.Fprintf(b, `<text x="%.0f" y="%d" text-anchor="middle">%.3g</text>`, x, y0+14, xmax*float64(i)/4)
		fmt.Fprintf(b, `<text x="%d" y="%.0f" text-anchor="end">`+yfmt+`</text>`, x0-4, y+4, ymax*float64(i)/4)
		fmt.Fprintf(b, `<path d="M%d %.0fH%d" stroke="#ddd"/>`, x0, y, x1)
	}
	fmt.Fprintf(b, `<text x="%d" y="%d" text-anchor="middle">%s</text>`, (x0+x1)/2, plotH-6, html.EscapeString(xlabel))
}

// point maps data coordinates to the plot area.
func point(x, y, xmax, ymax float64) (float64, float64) {
	return padL + x/xmax*(plotW-padL-padR), plotH - padB - y/ymax*(plotH-padB-padT)
}

func cdfSVG(b *strings.Builder, name string, ds []time.Duration) {
	s := make([]float64, len(ds))
	for i, d := range ds {
		s[i] = ms(d)
	}
	slices.Sort(s)
	xmax := 1.0
	if len(s) > 0 && s[len(s)-1] > 0 {
		xmax = s[len(s)-1]
	}
	frame(b, name+" CDF", name+" (ms)", xmax, 1, "%.2f")
	if len(s) > 0 {
		b.WriteString(`<polyline fill="none" stroke="#1565c0" stroke-width="1.5" points="`)
		step := max(len(s)/400, 1) // at most ~400 vertices per curve keeps the page small
		for i := 0; i < len(s); i += step {
			x, y := point(s[i], float64(i+1)/float64(len(s)), xmax, 1)
			fmt.Fprintf(b, "%.1f,%.1f ", x, y)
		}
		x, y := point(s[len(s)-1], 1, xmax, 1)
		fmt.Fprintf(b, `%.1f,%.1f"/>`, x, y)
	}
	b.WriteString("</svg>\n")
}

// throughputSVG plots completed requests/s and output tokens/s in up to 100 time buckets. Tokens
// are placed at the arrival of the chunks that carried them, each chunk weighted by the request's
// output tokens over its chunks.
func throughputSVG(b *strings.Builder, o *Outcome) {
	var t0 time.Time
	for i := range o.Results {
		if st := o.Results[i].Start; !st.IsZero() && (t0.IsZero() || st.Before(t0)) {
			t0 = st
		}
	}
	const n = 100
	bucket := max(o.Duration/n, 10*time.Millisecond)
	reqs, toks := make([]float64, n), make([]float64, n)
	at := func(t time.Time) int { return min(max(int(t.Sub(t0)/bucket), 0), n-1) }
	for i := range o.Results {
		r := &o.Results[i]
		if r.Err != "" {
			continue
		}
		reqs[at(r.Start.Add(r.Latency))]++
		per := float64(r.OutputLen) / float64(len(r.ITL)+1)
		t := r.Start.Add(r.TTFT)
		toks[at(t)] += per
		for _, g := range r.ITL {
			t = t.Add(g)
			toks[at(t)] += per
		}
	}
	sec := bucket.Seconds()
	line := func(title string, ys []float64, color string) {
		ymax := 1.0
		for _, y := range ys {
			ymax = max(ymax, y/sec)
		}
		xmax := bucket.Seconds() * n
		frame(b, title, "time (s)", xmax, ymax, "%.0f")
		fmt.Fprintf(b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="`, color)
		for i, y := range ys {
			x, py := point((float64(i)+0.5)*sec, y/sec, xmax, ymax)
			fmt.Fprintf(b, "%.1f,%.1f ", x, py)
		}
		b.WriteString(`"/></svg>` + "\n")
	}
	line("Completed requests/s", reqs, "#2e7d32")
	line("Output tokens/s", toks, "#c62828")
}
