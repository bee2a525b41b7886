package killswitch

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io"
	"log"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// The KillSwitch against a real broker: SPANGUARD_TEST_BOOTSTRAP, else scripts/kafka.sh's
// 127.0.0.1:9092 (`make kafka-up`). A topic of its own per test, three partitions.

const testKey = "go-killswitch-test-key-00000001"

func bootstrap() []string {
	if servers := os.Getenv("SPANGUARD_TEST_BOOTSTRAP"); servers != "" {
		return strings.Split(servers, ",")
	}
	return []string{"127.0.0.1:9092"}
}

func randomHex(t *testing.T, n int) string {
	buffer := make([]byte, n)
	if _, err := rand.Read(buffer); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(buffer)
}

type harness struct {
	t        *testing.T
	topic    string
	producer *kgo.Client
	admin    *kadm.Client
}

func newHarness(t *testing.T) *harness {
	security, err := SecurityFromEnv()
	if err != nil {
		t.Fatal(err)
	}
	options, err := security.Options()
	if err != nil {
		t.Fatal(err)
	}
	client, err := kgo.NewClient(append(options, kgo.SeedBrokers(bootstrap()...), kgo.RecordPartitioner(kgo.ManualPartitioner()))...)
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, topic: "go-killswitch-" + randomHex(t, 4), producer: client, admin: kadm.NewClient(client)}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := h.admin.CreateTopic(ctx, 3, 1, nil, h.topic); err != nil {
		t.Fatalf("create topic (is the broker up? make kafka-up): %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, _ = h.admin.DeleteTopics(ctx, h.topic)
		client.Close()
	})
	return h
}

func (h *harness) send(partition int32, value []byte) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	record := &kgo.Record{Topic: h.topic, Partition: partition, Value: value}
	if err := h.producer.ProduceSync(ctx, record).FirstErr(); err != nil {
		h.t.Fatal(err)
	}
}

func (h *harness) signal(traceID string, key string, changes map[string]any) []byte {
	now := time.Now().UTC()
	record := map[string]any{
		"schema_version": int64(2),
		"signal_id":      randomHex(h.t, 16),
		"trace_id":       traceID,
		"kind":           "kill",
		"rule":           "tool_loop",
		"reason":         "search_docs called 4x in last 4 steps",
		"evidence":       map[string]any{"span_id": randomHex(h.t, 8), "hits": int64(4)},
		"agent":          map[string]any{"service": "go-agent", "name": nil},
		"detected_at":    now.Format("2006-01-02T15:04:05.000000Z07:00"),
		"expires_at":     now.Add(time.Hour).Format("2006-01-02T15:04:05.000000Z07:00"),
		"system_message": nil,
	}
	for name, value := range changes {
		record[name] = value
	}
	if key != "" {
		signed, err := Sign(record, []byte(key))
		if err != nil {
			h.t.Fatal(err)
		}
		record = signed
	}
	text, err := json.Marshal(record)
	if err != nil {
		h.t.Fatal(err)
	}
	return text
}

func until(t *testing.T, condition func() bool, what string) {
	deadline := time.Now().Add(20 * time.Second)
	for !condition() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestRefusesToStartWithoutAKey(t *testing.T) {
	_, err := New(context.Background(), Config{Brokers: bootstrap()})
	if !errors.Is(err, ErrSettings) {
		t.Fatalf("got %v", err)
	}
	_, err = New(context.Background(), Config{Brokers: bootstrap(), SigningKeys: [][]byte{[]byte(testKey)}, AllowUnsigned: true})
	if !errors.Is(err, ErrSettings) {
		t.Fatalf("got %v", err)
	}
}

func TestEveryPartitionFromItsEndWithoutAGroupBadRecordsCostOnlyThemselves(t *testing.T) {
	h := newHarness(t)
	early := randomHex(t, 16)
	h.send(0, h.signal(early, testKey, nil)) // before start: another process's
	ctx := context.Background()
	groupsBefore, err := h.admin.ListGroups(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k, err := New(ctx, Config{Brokers: bootstrap(), Topic: h.topic, SigningKeys: [][]byte{[]byte(testKey)}, Logger: log.New(io.Discard, "", 0)})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	killed, steered := randomHex(t, 16), randomHex(t, 16)
	junk := [][]byte{
		{0xff, 0xfe},
		[]byte("not json"),
		[]byte(`{"a":1,"a":2}`),
		h.signal(killed, "an-other-key-of-enough-length", nil),
		[]byte(strings.Replace(string(h.signal(killed, testKey, nil)), "search_docs called", "tampered", 1)),
		h.signal(killed, "", nil),
		h.signal(killed, testKey, map[string]any{"expires_at": "2020-01-01T00:00:00Z"}),
	}
	for i, value := range junk {
		h.send(int32(i%3), value)
	}
	message := "You called search_docs 4 times; try something else."
	h.send(1, h.signal(steered, testKey, map[string]any{"kind": "downgrade", "system_message": message}))
	h.send(2, h.signal(killed, testKey, nil))
	until(t, func() bool { return k.Received() == int64(len(junk)+2) }, "every record")
	var agentKilled *AgentKilled
	for range 2 { // remembered
		if _, err := k.Check(killed); !errors.As(err, &agentKilled) {
			t.Fatalf("not killed: %v (ignored %v)", err, k.Ignored())
		}
	}
	if got, _ := k.Check(steered); got != message {
		t.Fatalf("downgrade message %q", got)
	}
	if got, _ := k.Check(steered); got != "" {
		t.Fatalf("second read %q", got)
	}
	if got, err := k.Check(early); got != "" || err != nil {
		t.Fatalf("a signal sent before start was seen: %q %v", got, err)
	}
	want := map[string]int{"not_utf8": 1, "not_json": 2, "unknown_key": 1, "forged": 1, "unsigned": 1, "expired": 1}
	got := k.Ignored()
	delete(got, "consumer_error")
	if len(got) != len(want) {
		t.Fatalf("ignored %v, want %v", got, want)
	}
	for kind, n := range want {
		if got[kind] != n {
			t.Fatalf("ignored %v, want %v", got, want)
		}
	}
	if k.Malformed() != 3 || k.Rejected() != 3 || k.Expired() != 1 {
		t.Fatalf("malformed %d rejected %d expired %d", k.Malformed(), k.Rejected(), k.Expired())
	}
	groupsAfter, err := h.admin.ListGroups(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(groupsAfter.Groups()) != len(groupsBefore.Groups()) {
		t.Fatalf("a consumer group appeared: %v -> %v", groupsBefore.Groups(), groupsAfter.Groups())
	}
}

func TestReleaseAndRotation(t *testing.T) {
	h := newHarness(t)
	previous := "previous-key-still-accepted-01"
	k, err := New(context.Background(), Config{
		Brokers: bootstrap(), Topic: h.topic, Logger: log.New(io.Discard, "", 0),
		SigningKeys: [][]byte{[]byte(testKey), []byte(previous)},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	trace := randomHex(t, 16)
	if _, err := k.Check(trace); err != nil {
		t.Fatal(err)
	}
	kill := h.signal(trace, previous, nil) // rotation: signed with the old key
	h.send(0, kill)
	until(t, func() bool { return k.Signals.IsKilled(trace) }, "the kill")
	release := h.signal(trace, testKey, map[string]any{
		"kind": "release", "rule": "manual", "operator": "oncall@example.com", "reason": "released",
		"evidence": map[string]any{"span_id": strings.Repeat("0", 16)},
	})
	h.send(1, release)
	h.send(2, kill) // redelivered old kill: a duplicate
	until(t, func() bool { return k.Received() == 3 }, "release and redelivery")
	if _, err := k.Check(trace); err != nil {
		t.Fatalf("still killed after release: %v", err)
	}
	h.send(0, h.signal(trace, testKey, map[string]any{"reason": "killed again"}))
	until(t, func() bool { return k.Received() == 4 }, "the second kill")
	if _, err := k.Check(strings.ToUpper(trace)); err == nil || !strings.Contains(err.Error(), "killed again") {
		t.Fatalf("not killed again: %v", err)
	}
}

func TestPauseThenReleaseEndsTheWait(t *testing.T) {
	h := newHarness(t)
	k, err := New(context.Background(), Config{
		Brokers: bootstrap(), Topic: h.topic, Logger: log.New(io.Discard, "", 0),
		SigningKeys: [][]byte{[]byte(testKey)},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	trace, other := randomHex(t, 16), randomHex(t, 16)
	if _, err := k.Check(trace); err != nil {
		t.Fatal(err)
	}
	pauseUntil := time.Now().UTC().Add(10 * time.Minute).Format("2006-01-02T15:04:05.000000Z07:00")
	pause := map[string]any{"kind": "pause", "pause_until": pauseUntil, "pause_fallback": "kill"}
	// Signed for a short pause, then stretched: the deadline is inside the signature.
	stretched := strings.Replace(string(h.signal(other, testKey, pause)), pauseUntil, "2099-01-01T00:00:00Z", 1)
	h.send(2, []byte(stretched))
	h.send(0, h.signal(trace, testKey, pause))
	until(t, func() bool { return k.Received() == 2 }, "the pauses")
	if got := k.Ignored(); got["forged"] != 1 || k.Rejected() != 1 {
		t.Fatalf("the stretched pause was not refused as forged: %v", got)
	}
	if _, err := k.Check(other); err != nil {
		t.Fatalf("a forged pause was obeyed: %v", err)
	}
	var paused *AgentPaused
	if _, err := k.Check(trace); !errors.As(err, &paused) || paused.Until != pauseUntil || paused.Fallback != "kill" {
		t.Fatalf("not paused until %s: %v", pauseUntil, err)
	}
	type ended struct {
		message string
		err     error
		at      time.Time
	}
	done := make(chan ended, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	go func() {
		message, err := k.Wait(ctx, trace)
		done <- ended{message, err, time.Now()}
	}()
	select {
	case result := <-done:
		t.Fatalf("the wait ended before any answer: %q %v", result.message, result.err)
	case <-time.After(300 * time.Millisecond):
	}
	sentAt := time.Now()
	h.send(1, h.signal(trace, testKey, map[string]any{
		"kind": "release", "rule": "manual", "operator": "oncall@example.com", "reason": "looked fine",
		"evidence": map[string]any{"span_id": strings.Repeat("0", 16)},
	}))
	result := <-done
	if result.err != nil || result.message != "" {
		t.Fatalf("the wait did not end on the release: %q %v", result.message, result.err)
	}
	t.Logf("the wait returned %v after the release was sent", result.at.Sub(sentAt))
	if _, err := k.Check(trace); err != nil {
		t.Fatalf("still paused after release: %v", err)
	}
}

func TestConversationAndAgentKillsStopTheirScopeOnlyUntilReleased(t *testing.T) {
	h := newHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	triage := &Agent{Service: "go-agent", Name: "triage"}
	k, err := New(ctx, Config{Brokers: bootstrap(), Topic: h.topic, SigningKeys: [][]byte{[]byte(testKey)}, Logger: log.New(io.Discard, "", 0), Agent: triage})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	conversation := "conv-" + randomHex(t, 4)
	manual := map[string]any{"rule": "manual", "operator": "alice", "evidence": map[string]any{"span_id": strings.Repeat("0", 16)}}
	scoped := func(changes map[string]any) map[string]any {
		merged := map[string]any{}
		for name, value := range manual {
			merged[name] = value
		}
		for name, value := range changes {
			merged[name] = value
		}
		return merged
	}
	noTrace := strings.Repeat("0", 32)
	h.send(0, h.signal(noTrace, testKey, scoped(map[string]any{"scope": "conversation", "conversation_id": conversation})))
	h.send(1, h.signal(noTrace, testKey, scoped(map[string]any{"scope": "agent", "agent": map[string]any{"service": "go-agent", "name": "triage"}})))
	until(t, func() bool { return k.Received() >= 2 }, "the scoped kills")
	var killed *AgentKilled
	if _, err := k.Check(randomHex(t, 16)); !errors.As(err, &killed) || killed.Scope() != "agent" {
		t.Fatalf("the switch's agent: got %v", err)
	}
	billing := &Agent{Service: "go-agent", Name: "billing"}
	if _, err := k.CheckIn(randomHex(t, 16), CheckScope{ConversationID: conversation, Agent: billing}); !errors.As(err, &killed) || killed.Scope() != "conversation" {
		t.Fatalf("the conversation: got %v", err)
	}
	if _, err := k.CheckIn(randomHex(t, 16), CheckScope{ConversationID: "another", Agent: billing}); err != nil {
		t.Fatalf("another agent outside the conversation: %v", err)
	}
	later := time.Now().UTC().Add(time.Second).Format("2006-01-02T15:04:05.000000Z07:00")
	h.send(2, h.signal(noTrace, testKey, scoped(map[string]any{"kind": "release", "detected_at": later, "scope": "agent", "agent": map[string]any{"service": "go-agent", "name": "triage"}})))
	until(t, func() bool { return k.Received() >= 3 }, "the release")
	if _, err := k.Check(randomHex(t, 16)); err != nil {
		t.Fatalf("after the release: %v", err)
	}
}

// What an instrumented Go agent has: a TracerProvider built with its resource, baggage naming
// its conversation, and the agent span in the context of each CheckContext.
func TestCheckContextFindsTheConversationInBaggageAndTheAgentInTheResource(t *testing.T) {
	h := newHarness(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res := resource.NewSchemaless(attribute.String("service.name", "go-otel-agent"), attribute.String("gen_ai.agent.name", "triage"))
	provider := sdktrace.NewTracerProvider(sdktrace.WithResource(res))
	defer provider.Shutdown(context.Background())
	k, err := New(ctx, Config{Brokers: bootstrap(), Topic: h.topic, SigningKeys: [][]byte{[]byte(testKey)}, Logger: log.New(io.Discard, "", 0)})
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	inConversation := func(id string) (context.Context, func()) {
		member, err := baggage.NewMember("gen_ai.conversation.id", id)
		if err != nil {
			t.Fatal(err)
		}
		bag, err := baggage.New(member)
		if err != nil {
			t.Fatal(err)
		}
		spanContext, span := provider.Tracer("test").Start(baggage.ContextWithBaggage(ctx, bag), "invoke_agent triage")
		return spanContext, func() { span.End() }
	}
	conversation := "conv-" + randomHex(t, 4)
	agentContext, end := inConversation(conversation)
	defer end()
	otherContext, endOther := inConversation("another")
	defer endOther()
	if _, err := k.CheckContext(agentContext); err != nil {
		t.Fatalf("before any kill: %v", err)
	}
	noTrace := strings.Repeat("0", 32)
	manual := func(changes map[string]any) map[string]any {
		changes["rule"], changes["operator"] = "manual", "alice"
		changes["evidence"] = map[string]any{"span_id": strings.Repeat("0", 16)}
		return changes
	}
	h.send(0, h.signal(noTrace, testKey, manual(map[string]any{"scope": "conversation", "conversation_id": conversation})))
	until(t, func() bool { return k.Received() >= 1 }, "the conversation kill")
	var killed *AgentKilled
	if _, err := k.CheckContext(agentContext); !errors.As(err, &killed) || killed.Scope() != "conversation" {
		t.Fatalf("the baggage's conversation: got %v", err)
	}
	if _, err := k.CheckContext(otherContext); err != nil {
		t.Fatalf("another conversation: %v", err)
	}
	// Every agent of the service: this one, named by the resource of its span.
	h.send(1, h.signal(noTrace, testKey, manual(map[string]any{"scope": "agent", "agent": map[string]any{"service": "go-otel-agent", "name": nil}})))
	until(t, func() bool { return k.Received() >= 2 }, "the agent kill")
	if _, err := k.CheckContext(otherContext); !errors.As(err, &killed) || killed.Scope() != "agent" {
		t.Fatalf("the span's resource names the agent: got %v", err)
	}
	if _, err := k.Check(randomHex(t, 16)); err != nil {
		t.Fatalf("no context, no resource in the Config: the agent is unknown, got %v", err)
	}
	if _, err := k.CheckContext(context.Background()); err != nil || k.Unguarded() != 1 {
		t.Fatalf("no span in the context: %v, unguarded %d", err, k.Unguarded())
	}
}
