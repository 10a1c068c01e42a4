package splice

import (
	"errors"
	"testing"
)

func TestWalker(t *testing.T) {
	w := NewWalker([]byte(` {"a": "x\"y", "n": 12.5e1, "skip": [1, {"b": null}], "s": 3, "i": "no", "arr": [4, 5]} `))
	var a string
	var n, ints []int
	err := w.Object(func(key []byte) error {
		switch string(key) {
		case "a", "s":
			raw, ok, err := w.String()
			if ok {
				a = string(raw)
			}
			return err
		case "n", "i":
			v, ok, err := w.Int()
			if ok {
				n = append(n, v)
			}
			return err
		case "arr":
			return w.Array(func(int) error {
				v, _, err := w.Int()
				ints = append(ints, v)
				return err
			})
		}
		return w.Skip()
	})
	if err == nil {
		err = w.End()
	}
	if err != nil || a != `x\"y` || len(n) != 1 || n[0] != 12 || len(ints) != 2 || ints[1] != 5 {
		t.Errorf("a %q n %v ints %v err %v", a, n, ints, err)
	}
	for _, bad := range []string{`{"a":1,}`, `{"a" 1}`, `{"a":tru}`, `{"a":"\q"}`, `{"a":1} x`, `{"a":[1 2]}`} {
		w := NewWalker([]byte(bad))
		err := w.Object(func([]byte) error { return w.Skip() })
		if err == nil {
			err = w.End()
		}
		if !errors.Is(err, ErrBadJSON) {
			t.Errorf("%s: %v", bad, err)
		}
	}
}
