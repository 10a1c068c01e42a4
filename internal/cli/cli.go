// Package cli parses command lines the way Python's argparse does, so that
// pdrouter accepts exactly what `python -m sglang_router.launch_router`
// accepts: --flag value and --flag=value, unique prefixes of long flags,
// nargs "+" and "*" lists, repeatable (append) flags, choices, and usage
// errors that exit with status 2.
package cli

import (
	"cmp"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
)

// nargs says how many values a flag takes.
type nargs int

const (
	zero nargs = iota // store_true
	one               // exactly one value
	oneOrMore
	anyCount
)

// Flag is one option.
type Flag struct {
	Name    string // without the leading dashes
	Help    string
	Group   string
	Metavar string
	Choices []string
	// ChoiceHelp describes choices, one line each in --help.
	ChoiceHelp map[string]string
	Default    string // shown in --help
	// Ignored flags are accepted and reported by Parser.Ignored: pdrouter
	// does not implement what they configure.
	Ignored bool

	nargs  nargs
	append bool
	set    func(vals []string) error
	seen   bool
}

// UsageError is a bad command line; the program prints it and exits 2.
type UsageError struct{ Msg string }

func (e *UsageError) Error() string { return e.Msg }

// Parser holds the flags of one program.
type Parser struct {
	Prog        string
	Description string
	flags       []*Flag
	byName      map[string]*Flag
	groups      []string
}

func New(prog, description string) *Parser {
	return &Parser{Prog: prog, Description: description, byName: map[string]*Flag{}}
}

func (p *Parser) add(f *Flag) *Flag {
	if _, dup := p.byName[f.Name]; dup {
		panic("cli: duplicate flag --" + f.Name)
	}
	if !slices.Contains(p.groups, f.Group) {
		p.groups = append(p.groups, f.Group)
	}
	p.flags = append(p.flags, f)
	p.byName[f.Name] = f
	return f
}

// Bool is a store_true flag.
func (p *Parser) Bool(group, name string, dst *bool, help string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, nargs: zero, set: func([]string) error { *dst = true; return nil }})
}

// String takes one value.
func (p *Parser) String(group, name string, dst *string, help string, choices ...string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, Choices: choices, Default: *dst, nargs: one,
		set: func(v []string) error { *dst = v[0]; return nil }})
}

// OptString takes one value and records that it was given.
func (p *Parser) OptString(group, name string, dst **string, help string, choices ...string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, Choices: choices, nargs: one,
		set: func(v []string) error { s := v[0]; *dst = &s; return nil }})
}

// Int takes one integer.
func (p *Parser) Int(group, name string, dst *int, help string) *Flag {
	return addInt(p, group, name, dst, strconv.IntSize, help)
}

// Int64 takes one 64-bit integer.
func (p *Parser) Int64(group, name string, dst *int64, help string) *Flag {
	return addInt(p, group, name, dst, 64, help)
}

func addInt[T int | int64](p *Parser, group, name string, dst *T, bits int, help string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, Default: strconv.FormatInt(int64(*dst), 10), nargs: one,
		set: func(v []string) error {
			n, err := parseInt(v[0], bits)
			if err == nil {
				*dst = T(n)
			}
			return err
		}})
}

// Duration takes a whole number of units, as sglang-router's *_secs and *_ms
// flags do, and stores it as a time.Duration.
func (p *Parser) Duration(group, name string, dst *time.Duration, unit time.Duration, help string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, Default: strconv.FormatInt(int64(*dst/unit), 10), nargs: one,
		set: func(v []string) error {
			n, err := parseInt(v[0], 64)
			if err != nil {
				return err
			}
			if n > math.MaxInt64/int64(unit) || n < math.MinInt64/int64(unit) {
				return fmt.Errorf("value out of range: '%s'", v[0])
			}
			*dst = time.Duration(n) * unit
			return nil
		}})
}

// parseInt reads a decimal integer with argparse's message on error.
func parseInt(s string, bits int) (int64, error) {
	n, err := strconv.ParseInt(s, 10, bits)
	if err != nil {
		return 0, fmt.Errorf("invalid int value: '%s'", s)
	}
	return n, nil
}

// Float takes one number.
func (p *Parser) Float(group, name string, dst *float64, help string) *Flag {
	return p.add(&Flag{Group: group, Name: name, Help: help, Default: strconv.FormatFloat(*dst, 'g', -1, 64), nargs: one,
		set: func(v []string) error {
			f, err := strconv.ParseFloat(v[0], 64)
			if err != nil || math.IsNaN(f) {
				return fmt.Errorf("invalid float value: '%s'", v[0])
			}
			*dst = f
			return nil
		}})
}

// Strings takes a list: nargs "+" when atLeastOne, else "*".
func (p *Parser) Strings(group, name string, dst *[]string, atLeastOne bool, help string) *Flag {
	n := anyCount
	if atLeastOne {
		n = oneOrMore
	}
	return p.add(&Flag{Group: group, Name: name, Help: help, nargs: n,
		set: func(v []string) error { *dst = append([]string(nil), v...); return nil }})
}

// Append is a repeatable flag taking one or more values each time
// (argparse nargs="+", action="append"); exactlyOne gives nargs=1.
func (p *Parser) Append(group, name string, dst *[][]string, exactlyOne bool, help string) *Flag {
	n := oneOrMore
	if exactlyOne {
		n = one
	}
	return p.add(&Flag{Group: group, Name: name, Help: help, nargs: n, append: true,
		set: func(v []string) error { *dst = append(*dst, append([]string(nil), v...)); return nil }})
}

// isFlag tells an option from a value the way argparse does: a leading
// dash, unless the token is a negative number.
func isFlag(tok string) bool {
	if len(tok) < 2 || tok[0] != '-' {
		return false
	}
	if _, err := strconv.ParseFloat(tok, 64); err == nil {
		return false
	}
	return true
}

// lookup resolves a long flag name, allowing a unique prefix.
func (p *Parser) lookup(name string) (*Flag, error) {
	if f, ok := p.byName[name]; ok {
		return f, nil
	}
	var matches []string
	for _, f := range p.flags {
		if strings.HasPrefix(f.Name, name) {
			matches = append(matches, "--"+f.Name)
		}
	}
	switch len(matches) {
	case 1:
		return p.byName[matches[0][2:]], nil
	case 0:
		return nil, &UsageError{"unrecognized arguments: --" + name}
	}
	return nil, &UsageError{fmt.Sprintf("ambiguous option: --%s could match %s", name, strings.Join(matches, ", "))}
}

// ErrHelp is returned when -h or --help was given; the caller prints Help.
var ErrHelp = &UsageError{"help requested"}

// Parse reads args (without the program name).
func (p *Parser) Parse(args []string) error {
	for i := 0; i < len(args); i++ {
		tok := args[i]
		if tok == "-h" || tok == "--help" {
			return ErrHelp
		}
		if !strings.HasPrefix(tok, "--") || len(tok) == 2 {
			return &UsageError{"unrecognized arguments: " + tok}
		}
		name, inline, hasInline := strings.Cut(tok[2:], "=")
		f, err := p.lookup(name)
		if err != nil {
			return err
		}
		var vals []string
		switch {
		case f.nargs == zero:
			if hasInline {
				return &UsageError{fmt.Sprintf("argument --%s: ignored explicit argument '%s'", f.Name, inline)}
			}
		case hasInline:
			vals = []string{inline}
		case f.nargs == one:
			if i+1 >= len(args) || isFlag(args[i+1]) {
				return &UsageError{fmt.Sprintf("argument --%s: expected one argument", f.Name)}
			}
			i++
			vals = []string{args[i]}
		default:
			for i+1 < len(args) && !isFlag(args[i+1]) {
				i++
				vals = append(vals, args[i])
			}
			if f.nargs == oneOrMore && len(vals) == 0 {
				return &UsageError{fmt.Sprintf("argument --%s: expected at least one argument", f.Name)}
			}
		}
		if len(f.Choices) > 0 {
			for _, v := range vals {
				if !slices.Contains(f.Choices, v) {
					return &UsageError{fmt.Sprintf("argument --%s: invalid choice: '%s' (choose from %s)",
						f.Name, v, "'"+strings.Join(f.Choices, "', '")+"'")}
				}
			}
		}
		if err := f.set(vals); err != nil {
			return &UsageError{fmt.Sprintf("argument --%s: %v", f.Name, err)}
		}
		f.seen = true
	}
	return nil
}

// Ignored lists the given flags that pdrouter accepts but does not act on.
func (p *Parser) Ignored() []string {
	var out []string
	for _, f := range p.flags {
		if f.seen && f.Ignored {
			out = append(out, "--"+f.Name)
		}
	}
	return out
}

// Usage writes the one-line usage and an error, as argparse does.
func (p *Parser) Usage(w io.Writer, err error) {
	fmt.Fprintf(w, "usage: %s [options]\n%s: error: %v\n", p.Prog, p.Prog, err)
}

// Help writes the full option list by group.
func (p *Parser) Help(w io.Writer) {
	fmt.Fprintf(w, "usage: %s [options]\n\n%s\n\noptions:\n  -h, --help  show this help message and exit\n", p.Prog, p.Description)
	for _, g := range p.groups {
		fmt.Fprintf(w, "\n%s:\n", g)
		for _, f := range p.flags {
			if f.Group != g {
				continue
			}
			spec := "--" + f.Name
			meta := cmp.Or(f.Metavar, strings.ToUpper(strings.ReplaceAll(f.Name, "-", "_")))
			switch f.nargs {
			case one:
				spec += " " + meta
			case oneOrMore:
				spec += " " + meta + " [" + meta + " ...]"
			case anyCount:
				spec += " [" + meta + " ...]"
			}
			if len(f.Choices) > 0 {
				spec = "--" + f.Name + " {" + strings.Join(f.Choices, ",") + "}"
			}
			help := f.Help
			if f.Default != "" {
				help += " (default: " + f.Default + ")"
			}
			if f.Ignored {
				help += " [accepted, not implemented by pdrouter]"
			}
			fmt.Fprintf(w, "  %s\n      %s\n", spec, help)
			for _, c := range f.Choices {
				if h, ok := f.ChoiceHelp[c]; ok {
					fmt.Fprintf(w, "        %s: %s\n", c, h)
				}
			}
		}
	}
}
