package cli

import (
	"bytes"
	"errors"
	"strings"
	"testing"
	"time"
)

type fixture struct {
	pd       bool
	port     int
	ratio    float64
	policy   string
	urls     []string
	prefill  [][]string
	decode   [][]string
	optional *string
}

func newFixture() (*Parser, *fixture) {
	f := &fixture{port: 8000, ratio: 1.5, policy: "cache_aware"}
	p := New("prog", "test")
	p.Bool("g", "pd-disaggregation", &f.pd, "")
	p.Int("g", "port", &f.port, "")
	p.Float("g", "balance-rel-threshold", &f.ratio, "")
	p.String("g", "policy", &f.policy, "", "random", "cache_aware")
	p.Strings("g", "worker-urls", &f.urls, false, "")
	p.Append("g", "prefill", &f.prefill, false, "")
	p.Append("g", "decode", &f.decode, true, "")
	p.OptString("g", "api-key", &f.optional, "")
	p.Bool("h", "enable-trace", new(bool), "").Ignored = true
	return p, f
}

func TestParseLikeArgparse(t *testing.T) {
	p, f := newFixture()
	err := p.Parse(strings.Fields("--pd --prefill http://a:1 8998 --prefill http://b:1 --decode http://d:1 --decode http://e:1 " +
		"--port=9000 --balance-rel 2 --policy random --worker-urls --api-key k3y --enable-trace"))
	if err != nil {
		t.Fatal(err)
	}
	if !f.pd || f.port != 9000 || f.ratio != 2 || f.policy != "random" || len(f.urls) != 0 {
		t.Errorf("parsed %+v", f)
	}
	if len(f.prefill) != 2 || strings.Join(f.prefill[0], " ") != "http://a:1 8998" || len(f.prefill[1]) != 1 {
		t.Errorf("prefill %v", f.prefill)
	}
	if len(f.decode) != 2 || f.decode[1][0] != "http://e:1" {
		t.Errorf("decode %v", f.decode)
	}
	if f.optional == nil || *f.optional != "k3y" {
		t.Errorf("api key %v", f.optional)
	}
	if got := p.Ignored(); len(got) != 1 || got[0] != "--enable-trace" {
		t.Errorf("ignored %v", got)
	}
}

func TestNegativeNumbersAreValues(t *testing.T) {
	p, f := newFixture()
	if err := p.Parse([]string{"--port", "-1"}); err != nil || f.port != -1 {
		t.Errorf("err %v port %d", err, f.port)
	}
}

func TestUsageErrors(t *testing.T) {
	for args, want := range map[string]string{
		"--nope":                      "unrecognized arguments: --nope",
		"stray":                       "unrecognized arguments: stray",
		"--p 1":                       "ambiguous option: --p could match --pd-disaggregation, --port, --policy, --prefill",
		"--port":                      "argument --port: expected one argument",
		"--port x":                    "argument --port: invalid int value: 'x'",
		"--balance-rel-threshold nan": "invalid float value: 'nan'",
		"--policy best":               "invalid choice: 'best' (choose from 'random', 'cache_aware')",
		"--prefill":                   "argument --prefill: expected at least one argument",
		"--pd-disaggregation=1":       "ignored explicit argument '1'",
	} {
		p, _ := newFixture()
		err := p.Parse(strings.Fields(args))
		var ue *UsageError
		if !errors.As(err, &ue) || ue.Msg != want && !strings.Contains(ue.Msg, want) {
			t.Errorf("%q: got %v, want %q", args, err, want)
		}
	}
}

func TestHelpListsEveryFlag(t *testing.T) {
	p, _ := newFixture()
	if err := p.Parse([]string{"--help"}); err != ErrHelp {
		t.Fatalf("got %v", err)
	}
	var b bytes.Buffer
	p.Help(&b)
	for _, f := range p.flags {
		if !strings.Contains(b.String(), "--"+f.Name) {
			t.Errorf("help lacks --%s", f.Name)
		}
	}
	if !strings.Contains(b.String(), "not implemented by pdrouter") {
		t.Error("help does not mark ignored flags")
	}
}

func FuzzParse(f *testing.F) {
	f.Add("--pd --prefill http://a 1 --decode x --port=3")
	f.Add("--policy random --worker-urls a b c")
	f.Fuzz(func(t *testing.T, line string) {
		p, _ := newFixture()
		err := p.Parse(strings.Fields(line))
		var ue *UsageError
		if err != nil && !errors.As(err, &ue) {
			t.Fatalf("non-usage error %T %v", err, err)
		}
	})
}

func TestInt64AndDurationFlags(t *testing.T) {
	size, timeout, backoff := int64(1<<26), 30*time.Second, 50*time.Millisecond
	p := New("prog", "test")
	p.Int64("g", "max-tree-size", &size, "")
	p.Duration("g", "timeout-secs", &timeout, time.Second, "")
	p.Duration("g", "backoff-ms", &backoff, time.Millisecond, "")
	var b bytes.Buffer
	p.Help(&b)
	for _, want := range []string{"(default: 67108864)", "(default: 30)", "(default: 50)"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("help lacks %q:\n%s", want, b.String())
		}
	}
	if err := p.Parse(strings.Fields("--max-tree-size 8589934592 --timeout-secs 7 --backoff-ms=-3")); err != nil {
		t.Fatal(err)
	}
	if size != 1<<33 || timeout != 7*time.Second || backoff != -3*time.Millisecond {
		t.Errorf("parsed %d %v %v", size, timeout, backoff)
	}
	for args, want := range map[string]string{
		"--timeout-secs 1.5":                  "argument --timeout-secs: invalid int value: '1.5'",
		"--timeout-secs 9223372036854775807":  "argument --timeout-secs: value out of range: '9223372036854775807'",
		"--max-tree-size 9223372036854775808": "argument --max-tree-size: invalid int value: '9223372036854775808'",
	} {
		if err := p.Parse(strings.Fields(args)); err == nil || err.Error() != want {
			t.Errorf("%q: got %v, want %q", args, err, want)
		}
	}
	if timeout != 7*time.Second || size != 1<<33 {
		t.Errorf("a rejected value was stored: %v %d", timeout, size)
	}
}

func TestHelpDescribesChoices(t *testing.T) {
	policy := "a"
	p := New("prog", "test")
	p.String("g", "policy", &policy, "Policy", "a", "b").ChoiceHelp = map[string]string{"a": "first letter", "b": "second letter"}
	var b bytes.Buffer
	p.Help(&b)
	if !strings.Contains(b.String(), "--policy {a,b}\n      Policy (default: a)\n        a: first letter\n        b: second letter\n") {
		t.Errorf("help:\n%s", b.String())
	}
}
