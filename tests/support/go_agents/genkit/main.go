// Span fixtures from a Go agent framework: Genkit for Go, its own tracing ("genkit-tracer"),
// over a scripted model (no network). The Go counterpart of tests/support/ts_agents/generate.mjs,
// driven by `python -m tests.support.instrumented_agents --go`, which hands it the scenarios
// and turns each scenario's OTLP protobuf request into the JSON fixture:
//
//	go run . -scenarios FILE -out DIR   # DIR/genkit/capture/<scenario>.pb
//
// The spans leave through the OTel Go SDK's own OTLP/HTTP exporter to a local receiver here,
// which merges what one scenario exported into one request.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync"

	"github.com/firebase/genkit/go/ai"
	"github.com/firebase/genkit/go/genkit"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlptrace/otlptracehttp"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	collector "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	"google.golang.org/protobuf/proto"
)

type call struct {
	Tool      string         `json:"tool"`
	Arguments map[string]any `json:"arguments"`
	Result    string         `json:"result"`
}

// script is a scenario's calls in order: the model's next request and the tool's next result.
type script struct {
	calls   []call
	turn    int
	results int
}

func (s *script) nextCall() *call {
	if s.turn >= len(s.calls) {
		return nil
	}
	s.turn++
	return &s.calls[s.turn-1]
}

func (s *script) result() string {
	s.results++
	return s.calls[s.results-1].Result
}

// receiver is an OTLP/HTTP endpoint that keeps every span it is sent, merged into one request.
type receiver struct {
	mu      sync.Mutex
	request collector.ExportTraceServiceRequest
}

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	body, err := io.ReadAll(req.Body)
	var part collector.ExportTraceServiceRequest
	if err == nil {
		err = proto.Unmarshal(body, &part)
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	r.request.ResourceSpans = append(r.request.ResourceSpans, part.ResourceSpans...)
	r.mu.Unlock()
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(nil)
}

func (r *receiver) take() []byte {
	r.mu.Lock()
	defer r.mu.Unlock()
	data, err := proto.Marshal(&r.request)
	if err != nil {
		panic(err)
	}
	r.request.Reset()
	return data
}

type searchInput struct {
	Query     string  `json:"query"`
	RequestID *string `json:"request_id,omitempty"`
}

type docInput struct {
	DocID string `json:"doc_id"`
}

type jobInput struct {
	JobID string `json:"job_id"`
}

func main() {
	scenariosPath := flag.String("scenarios", "", "the scenarios (JSON, from instrumented_agents.py)")
	out := flag.String("out", "", "the fixtures' root folder")
	flag.Parse()
	if err := run(*scenariosPath, *out); err != nil {
		fmt.Fprintln(os.Stderr, "genkit fixtures:", err)
		os.Exit(1)
	}
}

func run(scenariosPath, out string) error {
	data, err := os.ReadFile(scenariosPath)
	if err != nil {
		return err
	}
	var scenarios map[string][]call
	if err := json.Unmarshal(data, &scenarios); err != nil {
		return err
	}
	ctx := context.Background()
	sink := &receiver{}
	server := httptest.NewServer(sink)
	defer server.Close()
	exporter, err := otlptracehttp.New(ctx, otlptracehttp.WithEndpointURL(server.URL+"/v1/traces"))
	if err != nil {
		return err
	}
	provider := sdktrace.NewTracerProvider(
		sdktrace.WithBatcher(exporter),
		sdktrace.WithResource(resource.NewSchemaless(attribute.String("service.name", "scripted-agent"))),
	)
	otel.SetTracerProvider(provider) // Genkit traces through the global SDK provider
	defer provider.Shutdown(ctx)

	var current *script
	g := genkit.Init(ctx)
	model := genkit.DefineModel(g, "scripted/model", &ai.ModelOptions{
		Label:    "scripted",
		Supports: &ai.ModelSupports{Multiturn: true, Tools: true, SystemRole: true},
	}, func(ctx context.Context, request *ai.ModelRequest, _ ai.ModelStreamCallback) (*ai.ModelResponse, error) {
		usage := &ai.GenerationUsage{InputTokens: 120, OutputTokens: 20, TotalTokens: 140}
		next := current.nextCall()
		if next == nil {
			return &ai.ModelResponse{
				Request: request, Usage: usage, FinishReason: ai.FinishReasonStop,
				Message: ai.NewModelTextMessage("That is all I could find."),
			}, nil
		}
		part := ai.NewToolRequestPart(&ai.ToolRequest{Name: next.Tool, Input: next.Arguments, Ref: fmt.Sprintf("call_%d", current.turn)})
		return &ai.ModelResponse{
			Request: request, Usage: usage, FinishReason: ai.FinishReasonStop,
			Message: &ai.Message{Role: ai.RoleModel, Content: []*ai.Part{part}},
		}, nil
	})
	tools := []ai.ToolRef{
		genkit.DefineTool(g, "search_docs", "Search the knowledge base.",
			func(_ *ai.ToolContext, _ searchInput) (string, error) { return current.result(), nil }),
		genkit.DefineTool(g, "read_doc", "Read one document of the knowledge base.",
			func(_ *ai.ToolContext, _ docInput) (string, error) { return current.result(), nil }),
		genkit.DefineTool(g, "get_job_status", "Status of a background job.",
			func(_ *ai.ToolContext, _ jobInput) (string, error) { return current.result(), nil }),
	}
	folder := filepath.Join(out, "genkit", "capture")
	if err := os.MkdirAll(folder, 0o755); err != nil {
		return err
	}
	for name, calls := range scenarios {
		current = &script{calls: calls}
		_, err := genkit.Generate(ctx, g,
			ai.WithModel(model), ai.WithTools(tools...), ai.WithMaxTurns(100),
			ai.WithPrompt("What is the refund policy?"))
		if err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		if current.turn != len(calls) || current.results != len(calls) {
			return fmt.Errorf("%s: the agent stopped at call %d", name, current.turn)
		}
		if err := provider.ForceFlush(ctx); err != nil {
			return err
		}
		if err := os.WriteFile(filepath.Join(folder, name+".pb"), sink.take(), 0o644); err != nil {
			return err
		}
	}
	fmt.Println("genkit: capture")
	return nil
}
