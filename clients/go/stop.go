package killswitch

// Why an agent stopped, machine-readable (as killswitch/stop.py in Python and stop.js in
// TypeScript): on obeying a kill, a pause or a downgrade, CheckContext adds an event to the span
// in its context, "spanguard.stop" (kill, pause) or "spanguard.downgrade", with the attributes
// spanguard.rule, spanguard.action, spanguard.decision_id, spanguard.scope and spanguard.reason
// (the shared vectors' stop_events keep the three languages alike). An agent run as a process
// exits with ExitKilled (75) and one JSON line on stderr: ExitOnStop does both.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

const (
	StopEvent      = "spanguard.stop"
	DowngradeEvent = "spanguard.downgrade"
	// ExitKilled is EX_TEMPFAIL in sysexits.h: the work was not done, and may be retried once
	// an operator releases it.
	ExitKilled = 75
)

// Rule, Action, DecisionID and Reason: what the spanguard.stop event names.
func (k *AgentKilled) Rule() string       { return k.Signal.Rule }
func (k *AgentKilled) Action() string     { return k.Signal.Kind }
func (k *AgentKilled) DecisionID() string { return k.Signal.SignalID }
func (k *AgentKilled) Reason() string     { return k.Signal.Reason }

func (p *AgentPaused) Rule() string       { return p.Signal.Rule }
func (p *AgentPaused) Action() string     { return "pause" }
func (p *AgentPaused) DecisionID() string { return p.Signal.SignalID }
func (p *AgentPaused) Reason() string     { return p.Signal.Reason }
func (p *AgentPaused) Scope() string      { return signalScope(p.Signal) }

// StopAttributes are the attributes of a signal's span event.
func StopAttributes(signal *Signal) []attribute.KeyValue {
	return []attribute.KeyValue{
		attribute.String("spanguard.rule", signal.Rule),
		attribute.String("spanguard.action", signal.Kind),
		attribute.String("spanguard.decision_id", signal.SignalID), // the worker's decision_id
		attribute.String("spanguard.scope", signalScope(signal)),
		attribute.String("spanguard.reason", signal.Reason),
	}
}

// StopEventName is the event a signal leaves: spanguard.downgrade or spanguard.stop.
func StopEventName(signal *Signal) string {
	if signal.Kind == "downgrade" {
		return DowngradeEvent
	}
	return StopEvent
}

// Spans already told of a decision: a paused agent re-checks while it waits; one event says it.
const maxRecorded = 10_000

var recorded = struct {
	sync.Mutex
	seen  map[string]bool
	order []string
}{seen: map[string]bool{}}

// recordStop adds the signal's event to span, once per span and decision; false when the span
// is not recording.
func recordStop(span trace.Span, signal *Signal) bool {
	if span == nil || !span.IsRecording() {
		return false
	}
	context := span.SpanContext()
	key := context.TraceID().String() + context.SpanID().String() + signal.SignalID
	recorded.Lock()
	if recorded.seen[key] {
		recorded.Unlock()
		return false
	}
	recorded.seen[key] = true
	recorded.order = append(recorded.order, key)
	if len(recorded.order) > maxRecorded {
		delete(recorded.seen, recorded.order[0])
		recorded.order = recorded.order[1:]
	}
	recorded.Unlock()
	span.AddEvent(StopEventName(signal), trace.WithAttributes(StopAttributes(signal)...))
	return true
}

// recordResult records what a check obeyed (its error or its downgrade) on span.
func recordResult(span trace.Span, downgrade *Signal, err error) {
	var killed *AgentKilled
	var paused *AgentPaused
	var contained *ToolContained
	switch {
	case errors.As(err, &contained):
		// A refused tool call: the agent goes on, nothing stopped.
	case errors.As(err, &killed):
		recordStop(span, killed.Signal)
	case errors.As(err, &paused):
		recordStop(span, paused.Signal)
	case downgrade != nil:
		recordStop(span, downgrade)
	}
}

// StopReason is the one-line JSON a stopped agent writes to stderr.
type StopReason struct {
	Spanguard  string `json:"spanguard"` // "stopped"
	Action     string `json:"action"`
	Rule       string `json:"rule"`
	DecisionID string `json:"decision_id"`
	Scope      string `json:"scope"`
	TraceID    string `json:"trace_id"`
	Reason     string `json:"reason"`
}

// FindStop returns the stop reason of the *AgentKilled or *AgentPaused in err's chain.
func FindStop(err error) (StopReason, bool) {
	var killed *AgentKilled
	var paused *AgentPaused
	var signal *Signal
	action := ""
	switch {
	case errors.As(err, &killed):
		signal, action = killed.Signal, killed.Action()
	case errors.As(err, &paused):
		signal, action = paused.Signal, paused.Action()
	default:
		return StopReason{}, false
	}
	return StopReason{"stopped", action, signal.Rule, signal.SignalID, signalScope(signal), signal.TraceID, signal.Reason}, true
}

// StopExitCode writes err's stop reason to w as one JSON line and returns ExitKilled when the
// guard stopped the agent (err wraps *AgentKilled or *AgentPaused); else it returns 0 and
// writes nothing.
func StopExitCode(err error, w io.Writer) int {
	reason, ok := FindStop(err)
	if !ok {
		return 0
	}
	line, _ := json.Marshal(reason)
	fmt.Fprintf(w, "%s\n", line)
	return ExitKilled
}

// ExitOnStop exits the process with ExitKilled, after one JSON line on stderr, when err says
// the guard stopped the agent; otherwise it returns and the caller handles err.
func ExitOnStop(err error) {
	if code := StopExitCode(err, os.Stderr); code != 0 {
		os.Exit(code)
	}
}
