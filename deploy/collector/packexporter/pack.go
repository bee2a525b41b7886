package packexporter

import (
	"hash/fnv"

	"go.opentelemetry.io/collector/pdata/pcommon"
	"go.opentelemetry.io/collector/pdata/ptrace"
)

// Partition is where the stock kafka exporter's keyed records land and where the worker keeps a
// trace's state (streams/partitioner.py): sarama's hash partitioner over the hex trace id,
// abs(int32(fnv1a(key)) % n) with Go's truncating remainder.
func Partition(traceID pcommon.TraceID, partitions int32) int32 {
	hasher := fnv.New32a()
	_, _ = hasher.Write([]byte(traceID.String()))
	partition := int32(hasher.Sum32()) % partitions
	if partition < 0 {
		partition = -partition
	}
	return partition
}

// group copies the spans of td into one Traces per key, keeping each resource and scope once per
// group, in the order the keys are first met.
func group[K comparable](td ptrace.Traces, keyOf func(pcommon.TraceID) K) ([]K, map[K]ptrace.Traces) {
	var order []K
	groups := map[K]ptrace.Traces{}
	for _, resourceSpans := range td.ResourceSpans().All() {
		resources := map[K]ptrace.ResourceSpans{}
		for _, scopeSpans := range resourceSpans.ScopeSpans().All() {
			scopes := map[K]ptrace.ScopeSpans{}
			for _, span := range scopeSpans.Spans().All() {
				key := keyOf(span.TraceID())
				scope, ok := scopes[key]
				if !ok {
					resource, seen := resources[key]
					if !seen {
						traces, known := groups[key]
						if !known {
							traces = ptrace.NewTraces()
							groups[key] = traces
							order = append(order, key)
						}
						resource = traces.ResourceSpans().AppendEmpty()
						resourceSpans.Resource().CopyTo(resource.Resource())
						resource.SetSchemaUrl(resourceSpans.SchemaUrl())
						resources[key] = resource
					}
					scope = resource.ScopeSpans().AppendEmpty()
					scopeSpans.Scope().CopyTo(scope.Scope())
					scope.SetSchemaUrl(scopeSpans.SchemaUrl())
					scopes[key] = scope
				}
				span.CopyTo(scope.Spans().AppendEmpty())
			}
		}
	}
	return order, groups
}

// Pack is one record's worth: every trace of a batch bound for one partition, as a serialized
// ExportTraceServiceRequest.
type Pack struct {
	Partition int32
	Value     []byte
	Traces    int
}

// PackBatch splits a batch into one request per partition holding every trace placed there.
// A partition whose request would exceed maxBytes gets several, each of whole traces (serialized
// requests concatenate into one, so the worker reads them alike); a single trace over maxBytes
// stays one request, for the broker to refuse.
func PackBatch(td ptrace.Traces, partitions int32, maxBytes int) ([]Pack, error) {
	marshaler := ptrace.ProtoMarshaler{}
	order, byPartition := group(td, func(id pcommon.TraceID) int32 { return Partition(id, partitions) })
	packs := make([]Pack, 0, len(order))
	for _, partition := range order {
		traces := byPartition[partition]
		value, err := marshaler.MarshalTraces(traces)
		if err != nil {
			return nil, err
		}
		count := countTraces(traces)
		if len(value) <= maxBytes || count == 1 {
			packs = append(packs, Pack{Partition: partition, Value: value, Traces: count})
			continue
		}
		chunks, err := chunkByTrace(traces, maxBytes)
		if err != nil {
			return nil, err
		}
		for _, chunk := range chunks {
			packs = append(packs, Pack{Partition: partition, Value: chunk.Value, Traces: chunk.Traces})
		}
	}
	return packs, nil
}

// chunkByTrace serializes each trace on its own and joins them, in order, into requests of at
// most maxBytes (a trace larger than that alone in its own).
func chunkByTrace(td ptrace.Traces, maxBytes int) ([]Pack, error) {
	marshaler := ptrace.ProtoMarshaler{}
	order, byTrace := group(td, func(id pcommon.TraceID) pcommon.TraceID { return id })
	var chunks []Pack
	var current Pack
	for _, traceID := range order {
		value, err := marshaler.MarshalTraces(byTrace[traceID])
		if err != nil {
			return nil, err
		}
		if current.Traces > 0 && len(current.Value)+len(value) > maxBytes {
			chunks = append(chunks, current)
			current = Pack{}
		}
		current.Value = append(current.Value, value...)
		current.Traces++
	}
	if current.Traces > 0 {
		chunks = append(chunks, current)
	}
	return chunks, nil
}

func countTraces(td ptrace.Traces) int {
	seen := map[pcommon.TraceID]struct{}{}
	for _, resourceSpans := range td.ResourceSpans().All() {
		for _, scopeSpans := range resourceSpans.ScopeSpans().All() {
			for _, span := range scopeSpans.Spans().All() {
				seen[span.TraceID()] = struct{}{}
			}
		}
	}
	return len(seen)
}
