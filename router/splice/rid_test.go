package splice

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

func TestSetNewRID(t *testing.T) {
	newRID := func(body string) (out, rid []byte) {
		var b Body
		b.Reset([]byte(body))
		rid = SetNewRID(&b)
		return b.AppendTo(nil), rid
	}
	for _, body := range []string{`{"text":"hi"}`, `{}`, "{ }\n", `{"a":{"b":1}}  `} {
		out, rid := newRID(body)
		var m map[string]any
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("%q -> %q: %v", body, out, err)
		}
		got, _ := m["rid"].(string)
		if len(got) != RIDLen || strings.Trim(got, "0123456789abcdef") != "" {
			t.Fatalf("%q -> rid %q", out, got)
		}
		if string(rid) != `"`+got+`"` {
			t.Fatalf("returned value %s, body has %q", rid, got)
		}
	}
	_, a := newRID(`{}`)
	_, b := newRID(`{}`)
	if string(a) == string(b) {
		t.Fatal("two rids alike")
	}
}

func TestRIDs(t *testing.T) {
	collect := func(val string, batch, limit int) []string {
		var out []string
		RIDs([]byte(val), batch, limit, func(r []byte) { out = append(out, string(r)) })
		return out
	}
	for _, c := range []struct {
		val          string
		batch, limit int
		want         string
	}{
		{`"abc"`, 1, 8, `"abc"`},
		{`"abc"`, 3, 8, `"abc_0" "abc_1" "abc_2"`},
		{`"abc"`, 3, 2, `"abc_0" "abc_1"`},
		{`["x", 5, "y\"z"]`, 3, 8, `"x" "y\"z"`},
		{`["x","y"]`, 2, 1, `"x"`},
		{`[]`, 1, 8, ``},
		{`null`, 1, 8, ``},
		{`12`, 1, 8, ``},
	} {
		if got := strings.Join(collect(c.val, c.batch, c.limit), " "); got != c.want {
			t.Errorf("RIDs(%s, %d, %d) = %s, want %s", c.val, c.batch, c.limit, got, c.want)
		}
	}
}

func TestInspectRecordsRID(t *testing.T) {
	body := []byte(`{"text":"a","rid":"r1"}`)
	var info Info
	if err := Inspect(body, &info); err != nil {
		t.Fatal(err)
	}
	if got := string(body[info.RID.Start:info.RID.End]); got != `"r1"` {
		t.Fatalf("rid span %q", got)
	}
}

func TestSuffixRID(t *testing.T) {
	for in, want := range map[string]string{
		`"abc"`:           `"abc-retry1"`,
		`"a\"b"`:          `"a\"b-retry1"`,
		`["a", 7, "b\\"]`: `["a-retry1", 7, "b\\-retry1"]`,
		`[]`:              `[]`,
		`7`:               ``,
		`{"x":1}`:         ``,
		`["a",`:           `["a-retry1",`,
	} {
		if got := string(SuffixRID([]byte(in), "-retry1")); got != want {
			t.Errorf("SuffixRID(%s) = %s, want %s", in, got, want)
		}
	}
}

func FuzzSuffixRID(f *testing.F) {
	for _, s := range []string{`"abc"`, `["a","b"]`, `[1,{"a":"b"},"c"]`, `"`, `[`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, val []byte) {
		out := SuffixRID(val, "-x")
		if out == nil {
			return
		}
		var names, suffixed int
		RIDs(val, 1, 1<<20, func([]byte) { names++ })
		RIDs(out, 1, 1<<20, func(r []byte) {
			if bytes.HasSuffix(r, []byte(`-x"`)) {
				suffixed++
			}
		})
		if suffixed != names {
			t.Fatalf("SuffixRID(%q) = %q: %d of %d ids suffixed", val, out, suffixed, names)
		}
	})
}
