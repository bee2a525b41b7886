// Package killswitch is spanguard's killswitch for Go agents: it reads the signed kill signals
// the spanguard worker writes on the agent-kill-signals topic, and an agent calls Check before
// each tool call.
//
// The contract is schemas/kill-signal.schema.json, read strictly; every spanguard killswitch
// (Python, TypeScript, Go) decides the shared vectors in
// schemas/testdata/kill-signal-vectors.json alike.
package killswitch

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"maps"
	"regexp"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

const (
	MaxSignalBytes          = 64 * 1024
	MaxSignalDepth          = 8
	KillSignalSchemaVersion = 2
	keyIDText               = "spanguard kill-signal key id"
)

// MalformedKinds are bad records that are not a kill signal at all; RejectedKinds are signals
// unsigned, signed with a key the agent does not hold, or forged.
var (
	MalformedKinds = map[string]bool{"empty": true, "too_large": true, "not_utf8": true, "not_json": true, "too_deep": true, "not_object": true, "invalid": true}
	RejectedKinds  = map[string]bool{"unsigned": true, "unknown_key": true, "forged": true}
)

var (
	hex32    = regexp.MustCompile(`^[0-9a-f]{32}$`)
	hex16    = regexp.MustCompile(`^[0-9a-f]{16}$`)
	dateTime = regexp.MustCompile(`^([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]{1,6})?(Z|([+-])([0-9]{2}):([0-9]{2}))$`)
	kinds    = map[string]bool{"kill": true, "downgrade": true, "release": true, "pause": true}
	rules    = map[string]bool{"tool_loop": true, "cycle": true, "tool_polling": true, "no_progress": true, "token_budget": true, "cost_budget": true, "handoff_cycle": true, "delegation_depth": true, "agent_fan_out": true, "agent_budget": true, "manual": true, "tool_failing": true, "loop_signature": true}
	scopes   = map[string]bool{"trace": true, "conversation": true, "agent": true, "tool": true}
	// The fleet rules: their signals contain a tool, and their release is the tool's recovery.
	fleetRules = map[string]bool{"tool_failing": true, "loop_signature": true}
	fields     = map[string]bool{
		"schema_version": true, "signal_id": true, "trace_id": true, "kind": true, "rule": true,
		"reason": true, "evidence": true, "agent": true, "detected_at": true, "expires_at": true,
		"system_message": true, "operator": true, "pause_until": true, "pause_fallback": true,
		"scope": true, "conversation_id": true, "tool": true, "key_id": true, "signature": true,
	}
	required = []string{"schema_version", "signal_id", "trace_id", "kind", "rule", "reason", "evidence", "agent", "detected_at", "expires_at"}
	// evidence field -> "string", "hex16", or the minimum of an integer
	evidenceFields = map[string]any{
		"span_id": "hex16", "tool_name": "string", "args_hash": "hex16", "result_hash": "hex16",
		"hits": int64(1), "window": int64(1), "steps": int64(1), "tokens": int64(0), "token_budget": int64(1),
		"cost_micro_usd": int64(0), "budget_micro_usd": int64(1),
	}
)

// Signal is a kill, downgrade, release or pause an agent may act on.
type Signal struct {
	SignalID      string
	TraceID       string
	Kind          string // kill, downgrade, release or pause
	Rule          string
	Reason        string
	Evidence      map[string]any
	AgentService  string
	AgentName     *string
	DetectedAt    string
	ExpiresAt     string
	SystemMessage *string
	Operator      *string
	PauseUntil    *string // kind pause: until when the agent waits for an operator
	PauseFallback *string // kind pause: what applies then, "kill" or "release"
	// What it stops: nil or "trace" its trace; "conversation" every trace of ConversationID;
	// "agent" every trace of AgentService/AgentName (a nil name: every agent of the service).
	// "tool": every call to Tool (it contains the tool; the agent goes on).
	Scope          *string
	ConversationID *string
	Tool           *Tool // scope "tool": the tool contained or released
}

// Tool names a tool a tool signal contains; Server is "" when it has none (then the contain
// holds for the name on every server).
type Tool struct {
	Name   string
	Server string
}

// maxConversationIDChars bounds a conversation id (characters, as JSON Schema's maxLength).
const maxConversationIDChars = 200

// maxToolNameChars bounds a tool's name and its server's (characters).
const maxToolNameChars = 200

// BadSignal is a record on the kill topic that is not a signal this agent may act on.
type BadSignal struct {
	Kind   string
	Detail string
}

func (b *BadSignal) Error() string { return b.Kind + ": " + b.Detail }

func bad(kind, format string, args ...any) *BadSignal {
	// The detail quotes attacker-controlled text: keep it short and printable.
	detail := []rune(fmt.Sprintf(format, args...))
	for i, r := range detail {
		if r < 0x20 || r > 0x7e {
			detail[i] = '?'
		}
	}
	if len(detail) > 200 {
		detail = detail[:200]
	}
	return &BadSignal{Kind: kind, Detail: string(detail)}
}

// KeyID is the id a signed signal names its key by: 16 hex chars of HMAC-SHA256(key, a fixed text).
func KeyID(key []byte) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(keyIDText))
	return hex.EncodeToString(mac.Sum(nil))[:16]
}

// Keyring maps key id -> key for one key or several (rotation: new and old).
func Keyring(keys ...[]byte) (map[string][]byte, error) {
	ring := map[string][]byte{}
	for _, key := range keys {
		if len(key) == 0 {
			return nil, fmt.Errorf("a signing key must not be empty")
		}
		ring[KeyID(key)] = key
	}
	return ring, nil
}

func hmacHex(key []byte, text string) string {
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(text))
	return hex.EncodeToString(mac.Sum(nil))
}

// Sign returns record with its key's key_id and an HMAC-SHA256 signature over its canonical JSON.
func Sign(record map[string]any, key []byte) (map[string]any, error) {
	named := maps.Clone(record)
	delete(named, "signature")
	named["key_id"] = KeyID(key)
	text, err := CanonicalJSON(named)
	if err != nil {
		return nil, err
	}
	named["signature"] = hmacHex(key, text)
	return named, nil
}

// Verify says how record's signature stands against keys: valid, unsigned, unknown_key or forged.
func Verify(record map[string]any, keys map[string][]byte) string {
	signature, signed := record["signature"]
	if !signed {
		return "unsigned"
	}
	id, _ := record["key_id"].(string)
	key, known := keys[id]
	if !known {
		return "unknown_key"
	}
	given, isString := signature.(string)
	if !isString {
		return "forged"
	}
	unsigned := maps.Clone(record)
	delete(unsigned, "signature")
	text, err := CanonicalJSON(unsigned)
	if err != nil {
		return "forged"
	}
	if hmac.Equal([]byte(given), []byte(hmacHex(key, text))) {
		return "valid"
	}
	return "forged"
}

// ParseDateTime reads an RFC 3339 date-time with a zone (at most 6 fractional digits) that
// exists on the calendar.
func ParseDateTime(text string) (time.Time, bool) {
	m := dateTime.FindStringSubmatch(text)
	if m == nil {
		return time.Time{}, false
	}
	n := func(s string) int { v, _ := strconv.Atoi(s); return v }
	year, month, day, hour, minute, second := n(m[1]), n(m[2]), n(m[3]), n(m[4]), n(m[5]), n(m[6])
	if month < 1 || month > 12 || hour > 23 || minute > 59 || second > 59 {
		return time.Time{}, false
	}
	nanos := 0
	if m[7] != "" {
		nanos = n((m[7][1:] + "000000")[:6]) * 1000
	}
	offset := 0
	if m[8] != "Z" {
		if n(m[10]) > 23 || n(m[11]) > 59 {
			return time.Time{}, false
		}
		offset = n(m[10])*3600 + n(m[11])*60
		if m[9] == "-" {
			offset = -offset
		}
	}
	at := time.Date(year, time.Month(month), day, hour, minute, second, nanos, time.FixedZone("", offset))
	if at.Day() != day || int(at.Month()) != month { // 30 February rolls over: not a date
		return time.Time{}, false
	}
	return at, true
}

func invalid(where, message string) *BadSignal {
	return bad("invalid", "field %s: %s", where, message)
}

func isInteger(value any, minimum int64) bool {
	n, ok := value.(int64)
	return ok && n >= minimum
}

func checkSchema(record map[string]any) *BadSignal {
	for _, name := range required {
		if _, ok := record[name]; !ok {
			return invalid("(top level)", fmt.Sprintf("'%s' is a required property", name))
		}
	}
	for name := range record {
		if !fields[name] {
			return invalid("(top level)", fmt.Sprintf("additional property '%s'", name))
		}
	}
	if v, ok := record["schema_version"].(int64); !ok || v != KillSignalSchemaVersion {
		return invalid("schema_version", "must be 2")
	}
	for _, name := range []string{"signal_id", "trace_id"} {
		if v, ok := record[name].(string); !ok || !hex32.MatchString(v) {
			return invalid(name, "not 32 lowercase hex")
		}
	}
	kind, _ := record["kind"].(string)
	if !kinds[kind] {
		return invalid("kind", "not kill, downgrade, release or pause")
	}
	rule, _ := record["rule"].(string)
	if !rules[rule] {
		return invalid("rule", "not a rule")
	}
	if v, ok := record["reason"].(string); !ok || v == "" {
		return invalid("reason", "not a non-empty string")
	}
	evidence, ok := record["evidence"].(map[string]any)
	if !ok {
		return invalid("evidence", "not an object")
	}
	if _, ok := evidence["span_id"]; !ok {
		return invalid("evidence", "'span_id' is a required property")
	}
	for name, value := range evidence {
		rule, known := evidenceFields[name]
		if !known {
			return invalid("evidence", fmt.Sprintf("additional property '%s'", name))
		}
		var fine bool
		switch r := rule.(type) {
		case string:
			text, isText := value.(string)
			fine = isText && (r == "string" || hex16.MatchString(text))
		case int64:
			fine = isInteger(value, r)
		}
		if !fine {
			return invalid("evidence."+name, "wrong type or value")
		}
	}
	agent, ok := record["agent"].(map[string]any)
	if !ok {
		return invalid("agent", "not an object")
	}
	if _, ok := agent["service"].(string); !ok {
		return invalid("agent.service", "not a string")
	}
	for name, value := range agent {
		if name != "service" && name != "name" {
			return invalid("agent", fmt.Sprintf("additional property '%s'", name))
		}
		if _, isText := value.(string); name == "name" && value != nil && !isText {
			return invalid("agent.name", "not a string or null")
		}
	}
	for _, name := range []string{"detected_at", "expires_at"} {
		text, _ := record[name].(string)
		if _, ok := ParseDateTime(text); !ok {
			return invalid(name, "not an RFC 3339 date-time with a zone")
		}
	}
	if value, present := record["system_message"]; present && value != nil {
		if _, isText := value.(string); !isText {
			return invalid("system_message", "not a string or null")
		}
	}
	if _, isText := record["system_message"].(string); kind == "downgrade" && !isText {
		return invalid("system_message", "a downgrade carries one")
	}
	operator, hasOperator := record["operator"]
	if hasOperator {
		if text, isText := operator.(string); !isText || text == "" {
			return invalid("operator", "not a non-empty string")
		}
	}
	recovery := record["scope"] == "tool" && fleetRules[rule]
	if kind == "release" && !recovery && (rule != "manual" || !hasOperator) {
		return invalid("kind", "a release is manual and names its operator")
	}
	pauseUntil, hasPauseUntil := record["pause_until"]
	if hasPauseUntil {
		text, _ := pauseUntil.(string)
		if _, ok := ParseDateTime(text); !ok {
			return invalid("pause_until", "not an RFC 3339 date-time with a zone")
		}
	}
	pauseFallback, hasPauseFallback := record["pause_fallback"]
	if hasPauseFallback && pauseFallback != "kill" && pauseFallback != "release" {
		return invalid("pause_fallback", "not kill or release")
	}
	if kind == "pause" && (!hasPauseUntil || !hasPauseFallback) {
		return invalid("kind", "a pause carries pause_until and pause_fallback")
	}
	scope, hasScope := record["scope"]
	scopeText, _ := scope.(string)
	if hasScope && !scopes[scopeText] {
		return invalid("scope", "not trace, conversation, agent or tool")
	}
	if problem := checkTool(record, scopeText, rule); problem != nil {
		return problem
	}
	conversation, hasConversation := record["conversation_id"]
	if hasConversation {
		text, isText := conversation.(string)
		if !isText || text == "" || utf8.RuneCountInString(text) > maxConversationIDChars {
			return invalid("conversation_id", fmt.Sprintf("not a string of 1 to %d characters", maxConversationIDChars))
		}
	}
	if (scopeText == "conversation") != hasConversation {
		return invalid("conversation_id", "a conversation signal, and only it, names its conversation")
	}
	if scopeText == "agent" {
		if service, _ := record["agent"].(map[string]any)["service"].(string); service == "" {
			return invalid("agent.service", "an agent signal names its service")
		}
	}
	if (scopeText == "conversation" || scopeText == "agent" || scopeText == "tool") && kind != "kill" && kind != "release" {
		return invalid("kind", "a scoped signal is a kill or a release")
	}
	_, hasKeyID := record["key_id"]
	_, hasSignature := record["signature"]
	if hasKeyID != hasSignature {
		return invalid("(top level)", "key_id and signature go together")
	}
	if hasKeyID {
		if text, isText := record["key_id"].(string); !isText || !hex16.MatchString(text) {
			return invalid("key_id", "not 16 lowercase hex")
		}
		if _, isText := record["signature"].(string); !isText {
			return invalid("signature", "not a string")
		}
	}
	return nil
}

// checkTool: a tool signal names its tool ({name, server}), and only it; fleet rules only
// contain tools.
func checkTool(record map[string]any, scope, rule string) *BadSignal {
	value, hasTool := record["tool"]
	if hasTool {
		tool, isObject := value.(map[string]any)
		if !isObject {
			return invalid("tool", "not an object")
		}
		for _, name := range []string{"name", "server"} {
			if _, has := tool[name]; !has {
				return invalid("tool", fmt.Sprintf("'%s' is a required property", name))
			}
		}
		for name := range tool {
			if name != "name" && name != "server" {
				return invalid("tool", fmt.Sprintf("additional property '%s'", name))
			}
		}
		name, isText := tool["name"].(string)
		if !isText || name == "" || utf8.RuneCountInString(name) > maxToolNameChars {
			return invalid("tool.name", fmt.Sprintf("not a string of 1 to %d characters", maxToolNameChars))
		}
		server, isText := tool["server"].(string)
		if !isText || utf8.RuneCountInString(server) > maxToolNameChars {
			return invalid("tool.server", fmt.Sprintf("not a string of at most %d characters", maxToolNameChars))
		}
	}
	if (scope == "tool") != hasTool {
		return invalid("tool", "a tool signal, and only it, names its tool")
	}
	if scope == "tool" && !fleetRules[rule] && rule != "manual" {
		return invalid("rule", "a tool signal is a fleet rule's or manual")
	}
	if fleetRules[rule] && scope != "tool" {
		return invalid("scope", "a fleet rule contains a tool")
	}
	return nil
}

func optionalText(value any) *string {
	if text, ok := value.(string); ok {
		return &text
	}
	return nil
}

// ReadSignal is the signal in value (any bytes), or a *BadSignal naming the kind of bad record.
// keys (see Keyring) are those a signal must be signed with; nil obeys unsigned signals.
func ReadSignal(value []byte, keys map[string][]byte, now time.Time) (*Signal, error) {
	if len(value) == 0 {
		return nil, bad("empty", "no value")
	}
	if len(value) > MaxSignalBytes {
		return nil, bad("too_large", "%d bytes (at most %d)", len(value), MaxSignalBytes)
	}
	if !utf8.Valid(value) {
		return nil, bad("not_utf8", "not UTF-8")
	}
	parsed, loneSurrogate, err := parseStrict(string(value))
	if err != nil {
		e := err.(*jsonError)
		return nil, bad(e.kind, "%s", e.detail)
	}
	record, isObject := parsed.(map[string]any)
	if !isObject {
		return nil, bad("not_object", "a JSON %T, not an object", parsed)
	}
	if depthOf(record) > MaxSignalDepth {
		return nil, bad("too_deep", "nested more than %d levels", MaxSignalDepth)
	}
	if loneSurrogate {
		return nil, bad("not_utf8", "a string holds a lone surrogate escape")
	}
	if problem := checkSchema(record); problem != nil {
		return nil, problem
	}
	traceID := record["trace_id"].(string)
	if keys != nil {
		if check := Verify(record, keys); check != "valid" {
			detail := "signal for trace " + traceID
			if check == "unknown_key" {
				detail += fmt.Sprintf(", signed with key id %s, not one of this agent's", record["key_id"])
			}
			return nil, bad(check, "%s", detail)
		}
	}
	expires, _ := ParseDateTime(record["expires_at"].(string))
	if !now.Before(expires) {
		return nil, bad("expired", "signal for trace %s expired at %s", traceID, record["expires_at"])
	}
	agent := record["agent"].(map[string]any)
	return &Signal{
		SignalID:       record["signal_id"].(string),
		TraceID:        traceID,
		Kind:           record["kind"].(string),
		Rule:           record["rule"].(string),
		Reason:         record["reason"].(string),
		Evidence:       maps.Clone(record["evidence"].(map[string]any)),
		AgentService:   agent["service"].(string),
		AgentName:      optionalText(agent["name"]),
		DetectedAt:     record["detected_at"].(string),
		ExpiresAt:      record["expires_at"].(string),
		SystemMessage:  optionalText(record["system_message"]),
		Operator:       optionalText(record["operator"]),
		PauseUntil:     optionalText(record["pause_until"]),
		PauseFallback:  optionalText(record["pause_fallback"]),
		Scope:          optionalText(record["scope"]),
		ConversationID: optionalText(record["conversation_id"]),
		Tool:           toolOf(record["tool"]),
	}, nil
}

func toolOf(value any) *Tool {
	tool, ok := value.(map[string]any)
	if !ok {
		return nil
	}
	return &Tool{Name: tool["name"].(string), Server: tool["server"].(string)}
}

// normalizeTraceID is how the book keys traces: lower case.
func normalizeTraceID(traceID string) string { return strings.ToLower(traceID) }
