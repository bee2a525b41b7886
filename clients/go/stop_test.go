package killswitch

// The stop reason, machine-readable: the span event a kill, pause or downgrade leaves on the
// span in the check's context (the shared vectors' stop_events, alike in Python and
// TypeScript), the stop's fields, and the exit status. The real SDK, its in-memory exporter.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"testing"
	"time"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

type stopEventCase struct {
	Name   string `json:"name"`
	Signal string `json:"signal"`
	Check  struct {
		Trace        string `json:"trace"`
		Conversation string `json:"conversation"`
	} `json:"check"`
	Expect string `json:"expect"`
	Event  struct {
		Name       string            `json:"name"`
		Attributes map[string]string `json:"attributes"`
	} `json:"event"`
}

func loadStopEvents(t *testing.T) (time.Time, []byte, []stopEventCase) {
	data := vectorsJSON(t)
	var file struct {
		Now        string            `json:"now"`
		Keys       map[string]string `json:"keys"`
		StopEvents []stopEventCase   `json:"stop_events"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.StopEvents) < 3 {
		t.Fatal("no stop_events in the vectors")
	}
	now, _ := ParseDateTime(file.Now)
	return now, []byte(file.Keys["current"]), file.StopEvents
}

func eventsOf(t *testing.T, exporter *tracetest.InMemoryExporter) []map[string]string {
	spans := exporter.GetSpans()
	if len(spans) != 1 {
		t.Fatalf("%d spans", len(spans))
	}
	var out []map[string]string
	for _, event := range spans[0].Events {
		attributes := map[string]string{"": event.Name}
		for _, kv := range event.Attributes {
			attributes[string(kv.Key)] = kv.Value.AsString()
		}
		out = append(out, attributes)
	}
	return out
}

func TestStopEventVectors(t *testing.T) {
	now, key, cases := loadStopEvents(t)
	keys, err := Keyring(key)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cases {
		t.Run(c.Name, func(t *testing.T) {
			exporter := tracetest.NewInMemoryExporter()
			provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
			book := NewSignalBook(0)
			book.Clock = func() time.Time { return now }
			k := &KillSwitch{Signals: book, logger: log.New(&lineCounter{}, "", 0), scope: scopeDefaultsOf(Config{})}
			signal, err := ReadSignal([]byte(c.Signal), keys, now)
			if err != nil {
				t.Fatal(err)
			}
			book.Deliver(signal)
			ctx, span := provider.Tracer("agent").Start(context.Background(), "step")
			for i := 0; i < 2; i++ { // the same check again adds no second event
				message, err := k.checkIn(ctx, c.Check.Trace, CheckScope{ConversationID: c.Check.Conversation}, "CheckContext")
				var killed *AgentKilled
				switch {
				case errors.As(err, &killed):
					a := c.Event.Attributes
					got := []string{killed.Rule(), killed.Action(), killed.DecisionID(), killed.Scope(), killed.Reason()}
					want := []string{a["spanguard.rule"], a["spanguard.action"], a["spanguard.decision_id"], a["spanguard.scope"], a["spanguard.reason"]}
					if fmt.Sprint(got) != fmt.Sprint(want) || c.Expect != "killed" {
						t.Fatalf("AgentKilled %v, want %v (%s)", got, want, c.Expect)
					}
				case err != nil:
					t.Fatal(err)
				case message != "" && c.Expect != "message":
					t.Fatalf("a message, want %s", c.Expect)
				}
			}
			span.End()
			want := map[string]string{"": c.Event.Name}
			for name, value := range c.Event.Attributes {
				want[name] = value
			}
			got := eventsOf(t, exporter)
			if len(got) != 1 || fmt.Sprint(got[0]) != fmt.Sprint(want) {
				t.Fatalf("events %v, want [%v]", got, want)
			}
		})
	}
}

func TestAPauseIsAStopEventOnceAndCarriesItsFields(t *testing.T) {
	exporter := tracetest.NewInMemoryExporter()
	provider := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exporter))
	k := &KillSwitch{Signals: NewSignalBook(0), logger: log.New(&lineCounter{}, "", 0), scope: scopeDefaultsOf(Config{})}
	until := time.Now().Add(time.Minute).UTC().Format("2006-01-02T15:04:05.000Z07:00")
	fallback := "kill"
	pause := &Signal{SignalID: "5555555555555555555555555555555a", TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", Kind: "pause", Rule: "tool_loop",
		Reason: "search_docs called 4x", PauseUntil: &until, PauseFallback: &fallback,
		ExpiresAt: time.Now().Add(time.Hour).UTC().Format("2006-01-02T15:04:05.000Z07:00"), DetectedAt: time.Now().UTC().Format("2006-01-02T15:04:05.000Z07:00")}
	k.Signals.Deliver(pause)
	ctx, span := provider.Tracer("agent").Start(context.Background(), "step")
	var paused *AgentPaused
	for i := 0; i < 3; i++ {
		_, err := k.checkIn(ctx, pause.TraceID, CheckScope{}, "CheckContext")
		if !errors.As(err, &paused) {
			t.Fatalf("%v, want AgentPaused", err)
		}
	}
	span.End()
	if got := []string{paused.Action(), paused.Rule(), paused.DecisionID(), paused.Scope()}; fmt.Sprint(got) != fmt.Sprint([]string{"pause", "tool_loop", pause.SignalID, "trace"}) {
		t.Fatalf("fields %v", got)
	}
	events := eventsOf(t, exporter)
	if len(events) != 1 || events[0][""] != StopEvent || events[0]["spanguard.action"] != "pause" {
		t.Fatalf("events %v", events)
	}
}

func TestStopExitCodeIs75WithOneJSONLine(t *testing.T) {
	now, key, cases := loadStopEvents(t)
	keys, _ := Keyring(key)
	signal, err := ReadSignal([]byte(cases[0].Signal), keys, now)
	if err != nil {
		t.Fatal(err)
	}
	var stderr bytes.Buffer
	wrapped := fmt.Errorf("running tool search_docs: %w", &AgentKilled{Signal: signal})
	if code := StopExitCode(wrapped, &stderr); code != ExitKilled || ExitKilled != 75 {
		t.Fatalf("exit %d", code)
	}
	var reason StopReason
	if err := json.Unmarshal(bytes.TrimSpace(stderr.Bytes()), &reason); err != nil || bytes.Count(stderr.Bytes(), []byte("\n")) != 1 {
		t.Fatalf("%q: %v", stderr.String(), err)
	}
	if reason != (StopReason{"stopped", "kill", "tool_loop", signal.SignalID, "trace", signal.TraceID, signal.Reason}) {
		t.Fatalf("%+v", reason)
	}
	stderr.Reset()
	if code := StopExitCode(errors.New("a bug"), &stderr); code != 0 || stderr.Len() != 0 {
		t.Fatalf("an unrelated error: exit %d, %q", code, stderr.String())
	}
}
