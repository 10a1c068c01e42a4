package splice

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"
)

func inject(t testing.TB, body string, host string, port, batch int) (map[string]any, string) {
	t.Helper()
	var info Info
	if err := Inspect([]byte(body), &info); err != nil {
		t.Fatalf("Inspect(%s): %v", body, err)
	}
	out, _ := AppendBootstrap(nil, []byte(body), &info, host, port, batch)
	var m map[string]any
	dec := json.NewDecoder(strings.NewReader(string(out)))
	dec.UseNumber()
	if err := dec.Decode(&m); err != nil {
		t.Fatalf("output is not JSON: %v\n%s", err, out)
	}
	return m, string(out)
}

func TestInjectTypesAndOrder(t *testing.T) {
	m, out := inject(t, `{"text":"hi","zeta":{"a":[1,2]},"sampling_params":{"max_new_tokens":8,"weird":1e3}}`, "10.0.0.1", 8998, 1)
	if m["bootstrap_host"] != "10.0.0.1" {
		t.Errorf("host = %#v", m["bootstrap_host"])
	}
	if p, ok := m["bootstrap_port"].(json.Number); !ok || p.String() != "8998" {
		t.Errorf("port = %#v, want integer 8998", m["bootstrap_port"])
	}
	room, ok := m["bootstrap_room"].(json.Number)
	if !ok || strings.ContainsAny(room.String(), ".eE-") {
		t.Fatalf("room = %#v, want a non-negative integer", m["bootstrap_room"])
	}
	want := `{"text":"hi","zeta":{"a":[1,2]},"sampling_params":{"max_new_tokens":8,"weird":1e3},"bootstrap_host":"10.0.0.1","bootstrap_port":8998,"bootstrap_room":` + room.String() + `}`
	if out != want {
		t.Errorf("body not spliced byte for byte:\n got %s\nwant %s", out, want)
	}
}

func TestInjectNullPortAndIPv6Host(t *testing.T) {
	m, _ := inject(t, `{}`, "[::1]", NoPort, 1)
	if v, present := m["bootstrap_port"]; !present || v != nil {
		t.Errorf("port = %#v, want JSON null", v)
	}
	if m["bootstrap_host"] != "[::1]" {
		t.Errorf("host = %#v", m["bootstrap_host"])
	}
}

func TestInjectOverwritesClientFieldsInPlace(t *testing.T) {
	body := `{"bootstrap_room":"evil","text":"x","bootstrap_host":null, "bootstrap_port":{"a":1}}`
	m, out := inject(t, body, "h", 1234, 1)
	if m["bootstrap_host"] != "h" || m["bootstrap_port"].(json.Number).String() != "1234" {
		t.Errorf("client values survived: %s", out)
	}
	if _, isNum := m["bootstrap_room"].(json.Number); !isNum {
		t.Errorf("room not replaced: %s", out)
	}
	if !strings.HasPrefix(out, `{"bootstrap_room":`) || strings.Count(out, "bootstrap_room") != 1 {
		t.Errorf("key order or uniqueness broken: %s", out)
	}
}

func TestInjectBatchHasFreshRooms(t *testing.T) {
	m, _ := inject(t, `{"input_ids":[[1],[2],[3],[4]]}`, "h", NoPort, 4)
	hosts := m["bootstrap_host"].([]any)
	ports := m["bootstrap_port"].([]any)
	rooms := m["bootstrap_room"].([]any)
	if len(hosts) != 4 || len(ports) != 4 || len(rooms) != 4 {
		t.Fatalf("lengths %d %d %d, want 4", len(hosts), len(ports), len(rooms))
	}
	seen := map[string]bool{}
	for i := range 4 {
		if hosts[i] != "h" || ports[i] != nil {
			t.Errorf("element %d: host %v port %v", i, hosts[i], ports[i])
		}
		seen[rooms[i].(json.Number).String()] = true
	}
	if len(seen) != 4 {
		t.Errorf("rooms not distinct: %v", rooms)
	}
}

func TestRoomRange(t *testing.T) {
	for range 10000 {
		if r := NewRoom(); r >= 1<<63 {
			t.Fatalf("room %d outside [0, 2^63-1]", r)
		}
	}
}

func TestInspectFields(t *testing.T) {
	body := []byte(` {"stream" : true, "n": 3, "return_logprob":true, "logprobs":false, "model":"m",
		"messages":[{"role":"user","content":"hello there"}], "prompt":["p1","p2"], "query":"q"} `)
	var info Info
	if err := Inspect(body, &info); err != nil {
		t.Fatal(err)
	}
	if !info.Stream || info.N != 3 || !info.ReturnLogprob || info.Logprobs {
		t.Errorf("flags: %+v", info)
	}
	if got := string(ChatRoutingText(body, info.Messages)); got != "hello there" {
		t.Errorf("chat text %q", got)
	}
	if got := string(FirstString(body, info.Prompt)); got != "p1" {
		t.Errorf("prompt text %q", got)
	}
	if n, _ := ArrayLen(body, info.Prompt); n != 2 {
		t.Errorf("prompt len %d", n)
	}
	if got := string(FirstString(body, info.Model)); got != "m" {
		t.Errorf("model %q", got)
	}
}

func TestChatRoutingTextSkipsAssistantAndParts(t *testing.T) {
	for body, want := range map[string]string{
		`{"messages":[{"role":"assistant","content":"a"}]}`:                     "",
		`{"messages":[{"content":"s","role":"system"}]}`:                        "s",
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`: "",
	} {
		var info Info
		if err := Inspect([]byte(body), &info); err != nil {
			t.Fatal(err)
		}
		if got := string(ChatRoutingText([]byte(body), info.Messages)); got != want {
			t.Errorf("%s: got %q want %q", body, got, want)
		}
	}
}

func TestInspectRejects(t *testing.T) {
	cases := map[string]error{
		``:                 ErrBadJSON,
		`[1,2]`:            ErrNotObject,
		`"str"`:            ErrNotObject,
		`{"a":1`:           ErrBadJSON,
		`{"a":1}{}`:        ErrBadJSON,
		`{"a":01}`:         ErrBadJSON,
		`{"a":"\x"}`:       ErrBadJSON,
		"{\"a\":\"\x01\"}": ErrBadJSON,
		`{"a":tru}`:        ErrBadJSON,
		`{"a":1,}`:         ErrBadJSON,
		`{a:1}`:            ErrBadJSON,
		`{"a":[1,]}`:       ErrBadJSON,
		`{"a":-}`:          ErrBadJSON,
		`{"a":1.}`:         ErrBadJSON,
		`{"a":"\u12G4"}`:   ErrBadJSON,
		strings.Repeat(`{"a":`, 600) + "1" + strings.Repeat("}", 600): ErrTooDeep,
	}
	for body, want := range cases {
		var info Info
		if err := Inspect([]byte(body), &info); !errors.Is(err, want) {
			t.Errorf("Inspect(%.40q) = %v, want %v", body, err, want)
		}
	}
}

func FuzzSplice(f *testing.F) {
	for _, s := range []string{`{}`, `{"text":"a","bootstrap_room":1}`, `{"input_ids":[[1,2],[3]]}`, `[1]`, `{"a":`,
		`{"a":"\u00e9","b":[true,false,null,-1.5e-3]}`, `{"bootstrap_host":1,"bootstrap_port":2,"bootstrap_room":3}`} {
		f.Add([]byte(s), uint8(1))
	}
	f.Fuzz(func(t *testing.T, body []byte, batch uint8) {
		var info Info
		err := Inspect(body, &info)
		valid := json.Valid(body)
		if err != nil {
			// Our scanner may reject only what is invalid JSON, or valid JSON
			// that is not an object (or nests absurdly deep).
			if valid && !errors.Is(err, ErrNotObject) && !errors.Is(err, ErrTooDeep) {
				t.Fatalf("rejected valid JSON %q: %v", body, err)
			}
			return
		}
		if !valid {
			t.Fatalf("accepted invalid JSON %q", body)
		}
		var b Body
		b.Reset(body)
		SetBootstrap(&b, &info, "host", 8998, int(batch%5))
		if !info.RID.OK() {
			SetNewRID(&b)
		}
		out := b.AppendTo(nil)
		if len(out) != b.Len() {
			t.Fatalf("Len %d, body %d bytes", b.Len(), len(out))
		}
		var m map[string]json.RawMessage
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("output not a JSON object: %v\nin:  %s\nout: %s", err, body, out)
		}
		for _, k := range bootstrapKeys {
			if _, ok := m[k]; !ok {
				t.Fatalf("missing %s in %s", k, out)
			}
		}
	})
}
