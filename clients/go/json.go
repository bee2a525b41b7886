package killswitch

// A strict JSON reader for kill-signal records.
//
// encoding/json keeps the last of duplicate keys and replaces a lone surrogate escape with
// U+FFFD; another language's parser may keep the first key or fail. A record that parsers read
// differently must be refused by every killswitch alike (schemas/testdata/kill-signal-vectors.json),
// so this reader refuses duplicate keys, keeps every number that is not an integer within
// +-(2**53 - 1) as a rawNumber (the schema then refuses it), and reports lone surrogates.

import (
	"fmt"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

const maxParseDepth = 512
const maxSafeInteger = 1<<53 - 1

// rawNumber is a JSON number that is not a safe integer, as written.
type rawNumber string

type jsonError struct {
	kind   string // "not_json" or "too_deep"
	detail string
}

func (e *jsonError) Error() string { return e.kind + ": " + e.detail }

var numberPattern = regexp.MustCompile(`^-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?`)
var integerPattern = regexp.MustCompile(`^-?(?:0|[1-9][0-9]*)$`)

type parser struct {
	text          string
	at            int
	loneSurrogate bool
}

// parseStrict parses text; the second result says whether a string held a lone surrogate.
func parseStrict(text string) (value any, loneSurrogate bool, err error) {
	p := &parser{text: text}
	defer func() {
		if r := recover(); r != nil {
			if e, ok := r.(*jsonError); ok {
				value, err = nil, e
				return
			}
			panic(r)
		}
	}()
	value = p.value(0)
	p.space()
	if p.at != len(p.text) {
		p.fail("extra data after the document")
	}
	return value, p.loneSurrogate, nil
}

func (p *parser) fail(what string) {
	panic(&jsonError{"not_json", fmt.Sprintf("%s at offset %d", what, p.at)})
}

func (p *parser) space() {
	for p.at < len(p.text) {
		switch p.text[p.at] {
		case ' ', '\t', '\n', '\r':
			p.at++
		default:
			return
		}
	}
}

func (p *parser) value(depth int) any {
	p.space()
	if p.at >= len(p.text) {
		p.fail("unexpected end")
	}
	switch c := p.text[p.at]; {
	case c == '{' || c == '[':
		if depth >= maxParseDepth {
			panic(&jsonError{"too_deep", "nested too deeply to decode"})
		}
		if c == '{' {
			return p.object(depth + 1)
		}
		return p.array(depth + 1)
	case c == '"':
		return p.str()
	case strings.HasPrefix(p.text[p.at:], "true"):
		p.at += 4
		return true
	case strings.HasPrefix(p.text[p.at:], "false"):
		p.at += 5
		return false
	case strings.HasPrefix(p.text[p.at:], "null"):
		p.at += 4
		return nil
	}
	literal := numberPattern.FindString(p.text[p.at:])
	if literal == "" || literal == "-" {
		p.fail("unexpected character")
	}
	p.at += len(literal)
	if integerPattern.MatchString(literal) {
		if n, err := strconv.ParseInt(literal, 10, 64); err == nil && n >= -maxSafeInteger && n <= maxSafeInteger {
			return n
		}
	}
	return rawNumber(literal)
}

func (p *parser) str() string {
	p.at++ // the opening quote
	var out strings.Builder
	start := p.at
	for {
		if p.at >= len(p.text) {
			p.fail("unterminated string")
		}
		c := p.text[p.at]
		if c == '"' {
			out.WriteString(p.text[start:p.at])
			p.at++
			return out.String()
		}
		if c < 0x20 {
			p.fail("control character in a string")
		}
		if c != '\\' {
			p.at++
			continue
		}
		out.WriteString(p.text[start:p.at])
		if p.at+1 >= len(p.text) {
			p.fail("bad escape")
		}
		escape := p.text[p.at+1]
		p.at += 2
		switch escape {
		case '"', '\\', '/':
			out.WriteByte(escape)
		case 'b':
			out.WriteByte('\b')
		case 'f':
			out.WriteByte('\f')
		case 'n':
			out.WriteByte('\n')
		case 'r':
			out.WriteByte('\r')
		case 't':
			out.WriteByte('\t')
		case 'u':
			unit := p.hex4()
			if utf16.IsSurrogate(rune(unit)) {
				if unit < 0xdc00 && strings.HasPrefix(p.text[p.at:], `\u`) {
					save := p.at
					p.at += 2
					low := p.hex4()
					if low >= 0xdc00 && low <= 0xdfff {
						out.WriteRune(utf16.DecodeRune(rune(unit), rune(low)))
						break
					}
					p.at = save
				}
				p.loneSurrogate = true
				out.WriteRune(utf8.RuneError)
				break
			}
			out.WriteRune(rune(unit))
		default:
			p.fail("bad escape")
		}
		start = p.at
	}
}

func (p *parser) hex4() int {
	if p.at+4 > len(p.text) {
		p.fail("bad \\u escape")
	}
	n, err := strconv.ParseUint(p.text[p.at:p.at+4], 16, 32)
	if err != nil || strings.ContainsAny(p.text[p.at:p.at+4], "+-") {
		p.fail("bad \\u escape")
	}
	p.at += 4
	return int(n)
}

func (p *parser) object(depth int) map[string]any {
	p.at++
	out := map[string]any{}
	p.space()
	if p.eat('}') {
		return out
	}
	for {
		p.space()
		if p.at >= len(p.text) || p.text[p.at] != '"' {
			p.fail("expected a key")
		}
		key := p.str()
		if _, seen := out[key]; seen {
			p.fail(fmt.Sprintf("duplicate key %q", key))
		}
		p.space()
		if !p.eat(':') {
			p.fail("expected ':'")
		}
		out[key] = p.value(depth)
		if !p.more('}') {
			return out
		}
	}
}

func (p *parser) array(depth int) []any {
	p.at++
	out := []any{}
	p.space()
	if p.eat(']') {
		return out
	}
	for {
		out = append(out, p.value(depth))
		if !p.more(']') {
			return out
		}
	}
}

// eat consumes c when it comes next.
func (p *parser) eat(c byte) bool {
	if p.at < len(p.text) && p.text[p.at] == c {
		p.at++
		return true
	}
	return false
}

// more reads what follows a container's member: true after a comma, false after the
// container's close; anything else fails.
func (p *parser) more(end byte) bool {
	p.space()
	if p.eat(',') {
		return true
	}
	if !p.eat(end) {
		p.fail(fmt.Sprintf("expected ',' or '%c'", end))
	}
	return false
}

// depthOf is how deeply containers nest in value (1 for a flat object).
func depthOf(value any) int {
	switch v := value.(type) {
	case map[string]any:
		deepest := 0
		for _, child := range v {
			deepest = max(deepest, depthOf(child))
		}
		return deepest + 1
	case []any:
		deepest := 0
		for _, child := range v {
			deepest = max(deepest, depthOf(child))
		}
		return deepest + 1
	}
	return 0
}

// CanonicalJSON is the text a signature covers: keys sorted by code point, no spaces, only
// quote, backslash and control characters escaped (Python's json.dumps, ensure_ascii=False).
func CanonicalJSON(value any) (string, error) {
	var out strings.Builder
	if err := writeCanonical(&out, value); err != nil {
		return "", err
	}
	return out.String(), nil
}

func writeCanonical(out *strings.Builder, value any) error {
	switch v := value.(type) {
	case nil:
		out.WriteString("null")
	case bool:
		out.WriteString(strconv.FormatBool(v))
	case int64:
		out.WriteString(strconv.FormatInt(v, 10))
	case int:
		out.WriteString(strconv.Itoa(v))
	case string:
		quote(out, v)
	case []any:
		out.WriteByte('[')
		for i, item := range v {
			if i > 0 {
				out.WriteByte(',')
			}
			if err := writeCanonical(out, item); err != nil {
				return err
			}
		}
		out.WriteByte(']')
	case map[string]any:
		keys := make([]string, 0, len(v))
		for key := range v {
			keys = append(keys, key)
		}
		sort.Strings(keys) // bytewise UTF-8 order is code point order
		out.WriteByte('{')
		for i, key := range keys {
			if i > 0 {
				out.WriteByte(',')
			}
			quote(out, key)
			out.WriteByte(':')
			if err := writeCanonical(out, v[key]); err != nil {
				return err
			}
		}
		out.WriteByte('}')
	default:
		return fmt.Errorf("no canonical JSON for a %T", value)
	}
	return nil
}

func quote(out *strings.Builder, text string) {
	out.WriteByte('"')
	for i := 0; i < len(text); i++ {
		c := text[i]
		switch c {
		case '"':
			out.WriteString(`\"`)
		case '\\':
			out.WriteString(`\\`)
		case '\n':
			out.WriteString(`\n`)
		case '\r':
			out.WriteString(`\r`)
		case '\t':
			out.WriteString(`\t`)
		case '\b':
			out.WriteString(`\b`)
		case '\f':
			out.WriteString(`\f`)
		default:
			if c < 0x20 {
				fmt.Fprintf(out, `\u%04x`, c)
			} else {
				out.WriteByte(c)
			}
		}
	}
	out.WriteByte('"')
}
