package killswitch

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	oteltrace "go.opentelemetry.io/otel/trace"
)

// A wait that should end on a step of `meanwhile` gets this long before the test calls it stuck.
const safetyTimeout = 10 * time.Second

// sequenceStep is one step of a sequence (see tests/support/signal_vectors.py).
type sequenceStep struct {
	Deliver string `json:"deliver"`
	New     bool   `json:"new"`
	Check   string `json:"check"`
	// The checking trace's conversation and agent, when it has them.
	Conversation string `json:"conversation"`
	Agent        *struct {
		Service string  `json:"service"`
		Name    *string `json:"name"`
	} `json:"agent"`
	Wait      string         `json:"wait"`
	Timeout   *float64       `json:"timeout"`
	Meanwhile []sequenceStep `json:"meanwhile"`
	Clock     string         `json:"clock"`
	Expect    string         `json:"expect"`
	Reason    *string        `json:"reason"`
	Until     *string        `json:"until"`
	Fallback  *string        `json:"fallback"`
	// A tool sequence's check: the tool called, and its server when known.
	Tool   string  `json:"tool"`
	Server *string `json:"server"`
}

// vectorsJSON is the shared vectors file's bytes, read by every test below.
func vectorsJSON(t *testing.T) []byte {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "schemas", "testdata", "kill-signal-vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// The shared kill-signal vectors (schemas/testdata/kill-signal-vectors.json): every killswitch
// must reach each verdict, so a record no two languages would read alike is decided alike.
type vectorFile struct {
	Now     string            `json:"now"`
	Keys    map[string]string `json:"keys"`
	KeyIDs  map[string]string `json:"key_ids"`
	Vectors []struct {
		Name        string         `json:"name"`
		Keys        []string       `json:"keys"`
		Value       *string        `json:"value"`
		ValueBase64 *string        `json:"value_base64"`
		Verdict     string         `json:"verdict"`
		Signal      map[string]any `json:"signal"`
	} `json:"vectors"`
	Sequences []struct {
		Name    string            `json:"name"`
		Signals map[string]string `json:"signals"`
		Steps   []sequenceStep    `json:"steps"`
	} `json:"sequences"`
	// Checks naming the tool about to be called, against tool signals.
	ToolSequences []struct {
		Name    string            `json:"name"`
		Signals map[string]string `json:"signals"`
		Steps   []sequenceStep    `json:"steps"`
	} `json:"tool_sequences"`
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	data := vectorsJSON(t)
	var file vectorFile
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	return file
}

func (f vectorFile) ring(t *testing.T, names []string) map[string][]byte {
	keys := make([][]byte, 0, len(names))
	for _, name := range names {
		keys = append(keys, []byte(f.Keys[name]))
	}
	ring, err := Keyring(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ring
}

func TestKeyIDs(t *testing.T) {
	file := loadVectors(t)
	for name, key := range file.Keys {
		if got := KeyID([]byte(key)); got != file.KeyIDs[name] {
			t.Errorf("%s: key id %s, want %s", name, got, file.KeyIDs[name])
		}
	}
}

func TestVectors(t *testing.T) {
	file := loadVectors(t)
	now, ok := ParseDateTime(file.Now)
	if !ok {
		t.Fatal("bad now")
	}
	for _, vector := range file.Vectors {
		t.Run(vector.Name, func(t *testing.T) {
			var value []byte
			if vector.ValueBase64 != nil {
				decoded, err := base64.StdEncoding.DecodeString(*vector.ValueBase64)
				if err != nil {
					t.Fatal(err)
				}
				value = decoded
			} else {
				// encoding/json turns a lone surrogate escape into U+FFFD: the vectors hold none
				// in `value` itself (their records spell surrogates as escapes inside the text).
				value = []byte(*vector.Value)
			}
			var keys map[string][]byte
			if vector.Keys != nil {
				keys = file.ring(t, vector.Keys)
			}
			signal, err := ReadSignal(value, keys, now)
			verdict := "obey"
			if err != nil {
				var badSignal *BadSignal
				if !errors.As(err, &badSignal) {
					t.Fatalf("not a BadSignal: %v", err)
				}
				verdict = badSignal.Kind
			}
			if verdict != vector.Verdict {
				t.Fatalf("verdict %s (%v), want %s", verdict, err, vector.Verdict)
			}
			if signal == nil {
				return
			}
			got := map[string]*string{
				"kind": &signal.Kind, "trace_id": &signal.TraceID, "signal_id": &signal.SignalID,
				"rule": &signal.Rule, "reason": &signal.Reason, "system_message": signal.SystemMessage,
				"expires_at": &signal.ExpiresAt, "pause_until": signal.PauseUntil,
				"pause_fallback": signal.PauseFallback, "scope": signal.Scope,
				"conversation_id": signal.ConversationID, "agent_service": &signal.AgentService,
				"agent_name": signal.AgentName,
			}
			for name, want := range vector.Signal {
				var have any = deref(got[name])
				if name == "tool" && signal.Tool != nil {
					have = map[string]any{"name": signal.Tool.Name, "server": signal.Tool.Server}
				}
				if !reflect.DeepEqual(have, want) {
					t.Errorf("%s: got %v, want %v", name, have, want)
				}
			}
		})
	}
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

// testClock is the sequence's time: the steps give it, nothing sleeps for it.
type testClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *testClock) get() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *testClock) set(at time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = at
}

// checkOutcome fails the test unless a check or wait ended as step expects.
func checkOutcome(t *testing.T, where string, step sequenceStep, message string, err error) {
	t.Helper()
	var killed *AgentKilled
	var paused *AgentPaused
	var contained *ToolContained
	switch {
	case step.Expect == "contained":
		if !errors.As(err, &contained) {
			t.Fatalf("%s: not contained (%q, %v)", where, message, err)
		}
		if step.Reason != nil && contained.Killed.Signal.Reason != *step.Reason {
			t.Fatalf("%s: reason %q, want %q", where, contained.Killed.Signal.Reason, *step.Reason)
		}
	case step.Expect == "killed":
		if errors.As(err, &contained) || !errors.As(err, &killed) {
			t.Fatalf("%s: not killed (%q, %v)", where, message, err)
		}
		if step.Reason != nil && killed.Signal.Reason != *step.Reason {
			t.Fatalf("%s: reason %q, want %q", where, killed.Signal.Reason, *step.Reason)
		}
	case step.Expect == "paused":
		if !errors.As(err, &paused) {
			t.Fatalf("%s: not paused (%q, %v)", where, message, err)
		}
		if step.Until != nil && (paused.Until != *step.Until || paused.Fallback != *step.Fallback) {
			t.Fatalf("%s: paused until %s then %s, want %s then %s", where, paused.Until, paused.Fallback, *step.Until, *step.Fallback)
		}
	case err != nil:
		t.Fatalf("%s: %v", where, err)
	case step.Expect == "pass" && message != "":
		t.Fatalf("%s: message %q", where, message)
	case step.Expect != "pass" && message != step.Expect:
		t.Fatalf("%s: message %q, want %q", where, message, step.Expect)
	}
}

// clockOrDelivery plays a sequence step that sets the clock or delivers a signal to the book;
// false: the step is neither, and is the caller's to play.
func clockOrDelivery(t *testing.T, where string, step sequenceStep, signals map[string]string, keys map[string][]byte, clock *testClock, book *SignalBook) bool {
	switch {
	case step.Clock != "":
		at, ok := ParseDateTime(step.Clock)
		if !ok {
			t.Fatalf("%s: bad clock %q", where, step.Clock)
		}
		clock.set(at)
	case step.Deliver != "":
		signal, err := ReadSignal([]byte(signals[step.Deliver]), keys, clock.get())
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		if got := book.Deliver(signal); got != step.New {
			t.Fatalf("%s: deliver %s returned %v", where, step.Deliver, got)
		}
	default:
		return false
	}
	return true
}

func TestSequences(t *testing.T) {
	file := loadVectors(t)
	now, _ := ParseDateTime(file.Now)
	keys := file.ring(t, []string{"current"})
	for _, sequence := range file.Sequences {
		t.Run(sequence.Name, func(t *testing.T) {
			clock := &testClock{now: now}
			book := NewSignalBook(0)
			book.Clock = clock.get
			var run func(where string, step sequenceStep)
			run = func(where string, step sequenceStep) {
				if clockOrDelivery(t, where, step, sequence.Signals, keys, clock, book) {
					return
				}
				switch {
				case step.Check != "":
					scope := CheckScope{ConversationID: step.Conversation}
					if step.Agent != nil {
						scope.Agent = &Agent{Service: step.Agent.Service}
						if step.Agent.Name != nil {
							scope.Agent.Name = *step.Agent.Name
						}
					}
					message, err := book.CheckIn(step.Check, scope)
					checkOutcome(t, where, step, message, err)
				case step.Meanwhile == nil:
					ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*step.Timeout*float64(time.Second)))
					message, err := book.Wait(ctx, step.Wait)
					cancel()
					checkOutcome(t, where, step, message, err)
				default:
					type ended struct {
						message string
						err     error
					}
					done := make(chan ended, 1)
					ctx, cancel := context.WithTimeout(context.Background(), safetyTimeout)
					defer cancel()
					go func() {
						message, err := book.Wait(ctx, step.Wait)
						done <- ended{message, err}
					}()
					time.Sleep(50 * time.Millisecond) // let it block; either order ends it the same way
					for i, inner := range step.Meanwhile {
						run(fmt.Sprintf("%s meanwhile %d", where, i), inner)
					}
					result := <-done
					checkOutcome(t, where, step, result.message, result.err)
				}
			}
			for i, step := range sequence.Steps {
				run(fmt.Sprintf("step %d", i), step)
			}
		})
	}
}

func TestExpiryIsExactToTheMicrosecond(t *testing.T) {
	expires, _ := ParseDateTime("2026-06-01T12:00:00.000001Z")
	if !time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC).Before(expires) {
		t.Fatal("a microsecond before expiry must still be valid")
	}
}

// scopeCase is one case of the vectors' scope_resolution: where a check finds its
// conversation and agent (tests/support/signal_vectors.py, _scope_resolution).
type scopeCase struct {
	Name  string `json:"name"`
	Given struct {
		Conversation string      `json:"conversation"`
		Agent        *agentEntry `json:"agent"`
	} `json:"given"`
	Switch struct {
		Conversation string            `json:"conversation"`
		Agent        *agentEntry       `json:"agent"`
		Resource     map[string]string `json:"resource"`
	} `json:"switch"`
	Baggage map[string]string `json:"baggage"`
	// The resource of the provider whose span is active in the check's context (nil: none).
	SpanResource map[string]string `json:"span_resource"`
	Expect       struct {
		Conversation *string     `json:"conversation"`
		Agent        *agentEntry `json:"agent"`
	} `json:"expect"`
}

type agentEntry struct {
	Service string  `json:"service"`
	Name    *string `json:"name"`
}

func (a *agentEntry) agent() *Agent {
	if a == nil {
		return nil
	}
	agent := &Agent{Service: a.Service}
	if a.Name != nil {
		agent.Name = *a.Name
	}
	return agent
}

func TestScopeResolution(t *testing.T) {
	data := vectorsJSON(t)
	var file struct {
		Cases []scopeCase `json:"scope_resolution"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.Cases) == 0 {
		t.Fatal("no scope_resolution cases in the vectors")
	}
	for _, c := range file.Cases {
		t.Run(c.Name, func(t *testing.T) {
			k := &KillSwitch{scope: scopeDefaultsOf(Config{
				ConversationID: c.Switch.Conversation,
				Agent:          c.Switch.Agent.agent(),
				Resource:       resourceOf(c.Switch.Resource),
			})}
			members := make([]baggage.Member, 0, len(c.Baggage))
			for key, value := range c.Baggage {
				member, err := baggage.NewMemberRaw(key, value)
				if err != nil {
					t.Fatal(err)
				}
				members = append(members, member)
			}
			bag, err := baggage.New(members...)
			if err != nil {
				t.Fatal(err)
			}
			ctx := baggage.ContextWithBaggage(context.Background(), bag)
			if c.SpanResource != nil {
				provider := sdktrace.NewTracerProvider(sdktrace.WithResource(resourceOf(c.SpanResource)))
				defer provider.Shutdown(context.Background())
				var span oteltrace.Span
				ctx, span = provider.Tracer("test").Start(ctx, "invoke_agent")
				defer span.End()
			}
			got := k.Scope(ctx, CheckScope{ConversationID: c.Given.Conversation, Agent: c.Given.Agent.agent()})
			want := ""
			if c.Expect.Conversation != nil {
				want = *c.Expect.Conversation
			}
			if got.ConversationID != want {
				t.Errorf("conversation %q, want %q", got.ConversationID, want)
			}
			if wantAgent := c.Expect.Agent.agent(); !sameAgent(got.Agent, wantAgent) {
				t.Errorf("agent %+v, want %+v", got.Agent, wantAgent)
			}
		})
	}
}

// resourceOf is a real SDK resource with exactly these attributes.
func resourceOf(entries map[string]string) *resource.Resource {
	attributes := make([]attribute.KeyValue, 0, len(entries))
	for key, value := range entries {
		attributes = append(attributes, attribute.String(key, value))
	}
	return resource.NewSchemaless(attributes...)
}

func TestTheVectorsHoldScopeCasesWithAnActiveSpan(t *testing.T) {
	var file struct {
		Cases []scopeCase `json:"scope_resolution"`
	}
	data := vectorsJSON(t)
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	withSpan := 0
	for _, c := range file.Cases {
		if c.SpanResource != nil {
			withSpan++
		}
	}
	if withSpan < 3 {
		t.Fatalf("%d scope cases with an active span", withSpan)
	}
}

// unguardedStep is a step of the vectors' unguarded_checks: a check whose trace is null finds
// no trace to check (Check and CheckIn given "").
type unguardedStep struct {
	sequenceStep
	Check     *string `json:"check"`
	Unguarded int64   `json:"unguarded"`
	Warnings  int     `json:"warnings"`
}

// lineCounter counts the lines a log.Logger writes, and keeps the first.
type lineCounter struct {
	mu    sync.Mutex
	lines int
	first string
}

func (c *lineCounter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.lines == 0 {
		c.first = string(p)
	}
	c.lines++
	return len(p), nil
}

// A check with no trace: counted in Unguarded every time, warned about once through the
// Config's Logger, its scope still checked (a switch not started: the book is fed directly).
func TestUnguardedChecks(t *testing.T) {
	data := vectorsJSON(t)
	var file struct {
		Now       string            `json:"now"`
		Keys      map[string]string `json:"keys"`
		Sequences []struct {
			Name    string            `json:"name"`
			Signals map[string]string `json:"signals"`
			Steps   []unguardedStep   `json:"steps"`
		} `json:"unguarded_checks"`
	}
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	if len(file.Sequences) == 0 {
		t.Fatal("no unguarded_checks in the vectors")
	}
	now, _ := ParseDateTime(file.Now)
	keys, err := Keyring([]byte(file.Keys["current"]))
	if err != nil {
		t.Fatal(err)
	}
	for _, sequence := range file.Sequences {
		for _, method := range []string{"Check", "CheckIn"} {
			t.Run(method+": "+sequence.Name, func(t *testing.T) {
				book := NewSignalBook(0)
				book.Clock = func() time.Time { return now }
				logged := &lineCounter{}
				k := &KillSwitch{Signals: book, logger: log.New(logged, "", 0), scope: scopeDefaultsOf(Config{})}
				for i, step := range sequence.Steps {
					where := fmt.Sprintf("step %d", i)
					if step.Deliver != "" {
						signal, err := ReadSignal([]byte(sequence.Signals[step.Deliver]), keys, now)
						if err != nil {
							t.Fatalf("%s: %v", where, err)
						}
						if got := book.Deliver(signal); got != step.New {
							t.Fatalf("%s: deliver %s returned %v", where, step.Deliver, got)
						}
						continue
					}
					traceID := ""
					if step.Check != nil {
						traceID = *step.Check
					}
					scope := CheckScope{ConversationID: step.Conversation}
					if step.Agent != nil {
						scope.Agent = &Agent{Service: step.Agent.Service}
						if step.Agent.Name != nil {
							scope.Agent.Name = *step.Agent.Name
						}
					}
					var message string
					var err error
					if method == "Check" && scope.ConversationID == "" && scope.Agent == nil {
						message, err = k.Check(traceID)
					} else {
						message, err = k.CheckIn(traceID, scope)
					}
					checkOutcome(t, where, step.sequenceStep, message, err)
					if got := k.Unguarded(); got != step.Unguarded {
						t.Fatalf("%s: Unguarded() %d, want %d", where, got, step.Unguarded)
					}
					if logged.lines != step.Warnings {
						t.Fatalf("%s: %d warnings, want %d", where, logged.lines, step.Warnings)
					}
				}
				if logged.lines > 0 && !strings.Contains(logged.first, "NOT guarded") {
					t.Fatalf("the warning: %q", logged.first)
				}
			})
		}
	}
}

// CheckContext with no span in its context is counted with the others and warned about once
// in its own words; with a span it is not counted.
func TestCheckContextWithoutASpanIsCountedAndWarnedOnce(t *testing.T) {
	logged := &lineCounter{}
	k := &KillSwitch{Signals: NewSignalBook(0), logger: log.New(logged, "", 0), scope: scopeDefaultsOf(Config{})}
	for i := 0; i < 3; i++ {
		if message, err := k.CheckContext(context.Background()); message != "" || err != nil {
			t.Fatalf("no span: %q, %v", message, err)
		}
	}
	if k.Unguarded() != 3 || logged.lines != 1 || !strings.Contains(logged.first, "CheckContext found no trace") {
		t.Fatalf("unguarded %d, %d warnings: %q", k.Unguarded(), logged.lines, logged.first)
	}
	if _, err := k.Check(""); err != nil || k.Unguarded() != 4 || logged.lines != 2 {
		t.Fatalf("Check(\"\") after CheckContext: %v, unguarded %d, %d warnings", err, k.Unguarded(), logged.lines)
	}
	provider := sdktrace.NewTracerProvider()
	defer provider.Shutdown(context.Background())
	ctx, span := provider.Tracer("test").Start(context.Background(), "invoke_agent")
	defer span.End()
	if _, err := k.CheckContext(ctx); err != nil || k.Unguarded() != 4 {
		t.Fatalf("with a span: %v, unguarded %d", err, k.Unguarded())
	}
}

func sameAgent(a, b *Agent) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// Without a Resource in the Config, the agent is the resource of the SDK span in the context:
// the one its TracerProvider was built with.
func TestScopeReadsTheResourceOfTheSpanInTheContext(t *testing.T) {
	provider := sdktrace.NewTracerProvider(sdktrace.WithResource(resource.NewSchemaless(
		attribute.String("service.name", "support-agent"), attribute.String("gen_ai.agent.name", "triage"),
	)))
	defer provider.Shutdown(context.Background())
	ctx, span := provider.Tracer("test").Start(context.Background(), "invoke_agent triage")
	defer span.End()
	k := &KillSwitch{scope: scopeDefaultsOf(Config{})}
	if got := k.Scope(ctx, CheckScope{}).Agent; !sameAgent(got, &Agent{Service: "support-agent", Name: "triage"}) {
		t.Fatalf("agent %+v", got)
	}
	if got := k.Scope(context.Background(), CheckScope{}).Agent; got != nil {
		t.Fatalf("no span, no resource: agent %+v", got)
	}
	configured := &KillSwitch{scope: scopeDefaultsOf(Config{Resource: resource.NewSchemaless(attribute.String("service.name", "configured"))})}
	if got := configured.Scope(ctx, CheckScope{}).Agent; !sameAgent(got, &Agent{Service: "configured"}) {
		t.Fatalf("the Config's resource comes first: agent %+v", got)
	}
}

func TestToolSequences(t *testing.T) {
	file := loadVectors(t)
	now, _ := ParseDateTime(file.Now)
	keys := file.ring(t, []string{"current"})
	if len(file.ToolSequences) == 0 {
		t.Fatal("no tool sequences in the vectors")
	}
	for _, sequence := range file.ToolSequences {
		t.Run(sequence.Name, func(t *testing.T) {
			clock := &testClock{now: now}
			book := NewSignalBook(0)
			book.Clock = clock.get
			refused := 0
			for i, step := range sequence.Steps {
				where := fmt.Sprintf("step %d %+v", i, step)
				if clockOrDelivery(t, where, step, sequence.Signals, keys, clock, book) {
					continue
				}
				message, err := book.CheckIn(step.Check, CheckScope{Tool: step.Tool, Server: step.Server})
				checkOutcome(t, where, step, message, err)
				var contained *ToolContained
				if errors.As(err, &contained) {
					refused++
					if contained.Tool != step.Tool || !strings.HasPrefix(err.Error(), "tool "+step.Tool+" is contained by spanguard") {
						t.Fatalf("%s: %v", where, err)
					}
				}
			}
			if book.ToolCallsRefused != refused {
				t.Fatalf("refused %d, counted %d", refused, book.ToolCallsRefused)
			}
		})
	}
}
