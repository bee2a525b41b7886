// A Go agent for the end-to-end test (tests/deploy/test_e2e_languages.py): OpenTelemetry Go
// SDK spans with the GenAI conventions, exported over OTLP/HTTP to the Collector; the Go
// killswitch reads the worker's signals and Check runs before each tool call. Its "model"
// asks for the same search again and again (an empty index), thinking -step-delay each time.
//
// SPANGUARD_SIGNING_KEY is the worker's key. The last line of stdout is one JSON object:
// {agent, status: killed|gave_up, calls, reason, trace_id, kill_latency_s}.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"spanguard.dev/killswitch"
)

const agent = "support-agent"

type result struct {
	Agent        string   `json:"agent"`
	Status       string   `json:"status"`
	Calls        int      `json:"calls"`
	Reason       *string  `json:"reason"`
	TraceID      string   `json:"trace_id"`
	KillLatencyS *float64 `json:"kill_latency_s"`
}

func main() {
	endpoint := flag.String("endpoint", "http://127.0.0.1:4318", "the Collector's OTLP/HTTP endpoint")
	bootstrap := flag.String("bootstrap", "127.0.0.1:9092", "Kafka bootstrap servers")
	killTopic := flag.String("kill-topic", "agent-kill-signals", "the kill-signal topic")
	stepDelay := flag.Duration("step-delay", time.Second, "the model's thinking time per step")
	maxCalls := flag.Int("max-calls", 12, "calls before the agent gives up")
	flag.Parse()
	if err := run(*endpoint, *bootstrap, *killTopic, *stepDelay, *maxCalls); err != nil {
		fmt.Fprintln(os.Stderr, "go agent:", err)
		os.Exit(1)
	}
}

func run(endpoint, bootstrap, killTopic string, stepDelay time.Duration, maxCalls int) error {
	ctx := context.Background()
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(strings.TrimRight(endpoint, "/")+"/v1/traces"))
	if err != nil {
		return err
	}
	// A short export delay: a span waiting in the agent is detection latency.
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter, sdktrace.WithBatchTimeout(50*time.Millisecond)),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "support-bot-go"))),
	)
	defer provider.Shutdown(context.Background())
	tracer := provider.Tracer("spanguard.e2e")

	k, err := killswitch.New(ctx, killswitch.Config{
		Brokers:     strings.Split(bootstrap, ","),
		Topic:       killTopic,
		SigningKeys: [][]byte{[]byte(os.Getenv("SPANGUARD_SIGNING_KEY"))},
	})
	if err != nil {
		return err
	}
	defer k.Close()

	out := result{Agent: agent, Status: "gave_up"}
	agentContext, root := tracer.Start(ctx, "invoke_agent "+agent)
	root.SetAttributes(attribute.String("gen_ai.operation.name", "invoke_agent"), attribute.String("gen_ai.agent.name", agent))
	out.TraceID = root.SpanContext().TraceID().String()
	var trippedAt time.Time
	for step := 0; step < maxCalls; step++ {
		// The model "thinks"; watch for the signal meanwhile, to measure the kill latency.
		deadline := time.Now().Add(stepDelay)
		for time.Now().Before(deadline) {
			if !trippedAt.IsZero() && out.KillLatencyS == nil && k.Signals.IsKilled(out.TraceID) {
				latency := time.Since(trippedAt).Seconds()
				out.KillLatencyS = &latency
			}
			time.Sleep(5 * time.Millisecond)
		}
		_, chat := tracer.Start(agentContext, "chat scripted")
		chat.SetAttributes(
			attribute.String("gen_ai.operation.name", "chat"),
			attribute.Int("gen_ai.usage.input_tokens", 800),
			attribute.Int("gen_ai.usage.output_tokens", 60),
		)
		chat.End()
		// Before each tool call: the trace of the span in the context, and its scope.
		if _, err := k.CheckContext(agentContext); err != nil {
			var killed *killswitch.AgentKilled
			if !errors.As(err, &killed) {
				return err
			}
			out.Status, out.Reason = "killed", &killed.Signal.Reason
			fmt.Printf("[%s] KILLED before call %d: %s\n", agent, out.Calls+1, killed.Signal.Reason)
			break
		}
		_, tool := tracer.Start(agentContext, "execute_tool search_docs")
		tool.SetAttributes(
			attribute.String("gen_ai.operation.name", "execute_tool"),
			attribute.String("gen_ai.tool.name", "search_docs"),
			attribute.String("gen_ai.tool.call.id", fmt.Sprintf("call_%d", step)),
			attribute.String("gen_ai.tool.call.arguments", `{"query":"refund policy"}`),
			attribute.String("gen_ai.tool.call.result", `"no results"`),
		)
		tool.End()
		out.Calls++
		fmt.Printf("[%s] call %d: search_docs(\"refund policy\") -> no results\n", agent, out.Calls)
		if out.Calls == 3 { // the default loop.threshold: this call trips it
			trippedAt = time.Now()
		}
	}
	root.End()
	line, err := json.Marshal(out)
	if err != nil {
		return err
	}
	fmt.Println(string(line))
	return nil
}
