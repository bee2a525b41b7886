package packexporter

import (
	"encoding/hex"
	"fmt"
	"testing"

	"go.opentelemetry.io/collector/pdata/pcommon"
	"go.opentelemetry.io/collector/pdata/ptrace"
)

func traceID(t *testing.T, hexID string) pcommon.TraceID {
	t.Helper()
	raw, err := hex.DecodeString(hexID)
	if err != nil || len(raw) != 16 {
		t.Fatalf("bad trace id %q", hexID)
	}
	var id pcommon.TraceID
	copy(id[:], raw)
	return id
}

func TestPartitionMatchesTheWorkers(t *testing.T) {
	for _, tc := range []struct {
		id         string
		partitions int32
		want       int32
	}{
		{"0af7651916cd43dd8448eb211c80319c", 8, 3},
		{"4bf92f3577b34da6a3ce929d0e0e4736", 8, 6},
		{"00000000000000000000000000000001", 8, 6},
		{"ffffffffffffffffffffffffffffffff", 3, 0},
	} {
		got := Partition(traceID(t, tc.id), tc.partitions)
		if got != tc.want {
			t.Errorf("Partition(%s, %d) = %d, want %d", tc.id, tc.partitions, got, tc.want)
		}
	}
}

// batch is a request of two resources and, for each trace id, spans spread over both.
func batch(t *testing.T, ids []string, spansPerTrace int) ptrace.Traces {
	t.Helper()
	td := ptrace.NewTraces()
	for r := 0; r < 2; r++ {
		resource := td.ResourceSpans().AppendEmpty()
		resource.Resource().Attributes().PutStr("service.name", fmt.Sprintf("agent-%d", r))
		scope := resource.ScopeSpans().AppendEmpty()
		scope.Scope().SetName("spanguard-test")
		for i := 0; i < spansPerTrace; i++ {
			for _, id := range ids {
				span := scope.Spans().AppendEmpty()
				span.SetTraceID(traceID(t, id))
				span.SetName(fmt.Sprintf("call-%d-%d", r, i))
				span.Attributes().PutStr("gen_ai.prompt", "some words the rules may read")
			}
		}
	}
	return td
}

func someTraceIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("%032x", uint64(i)*0x9e3779b97f4a7c15+1)
	}
	return ids
}

func unpack(t *testing.T, value []byte) ptrace.Traces {
	t.Helper()
	td, err := (&ptrace.ProtoUnmarshaler{}).UnmarshalTraces(value)
	if err != nil {
		t.Fatalf("a pack does not parse: %v", err)
	}
	return td
}

func TestPackBatchPutsEveryTraceOnItsPartitionOnce(t *testing.T) {
	ids := someTraceIDs(40)
	const partitions = 8
	td := batch(t, ids, 3)
	packs, err := PackBatch(td, partitions, 900_000)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int32]bool{}
	spans := 0
	for _, pack := range packs {
		if seen[pack.Partition] {
			t.Errorf("partition %d has two records for one batch", pack.Partition)
		}
		seen[pack.Partition] = true
		packed := unpack(t, pack.Value)
		spans += packed.SpanCount()
		if got := packed.ResourceSpans().Len(); got != 2 {
			t.Errorf("pack of partition %d: %d resources, want each of the 2 once", pack.Partition, got)
		}
		if countTraces(packed) != pack.Traces {
			t.Errorf("pack of partition %d says %d traces, holds %d", pack.Partition, pack.Traces, countTraces(packed))
		}
		for _, rs := range packed.ResourceSpans().All() {
			for _, ss := range rs.ScopeSpans().All() {
				for _, span := range ss.Spans().All() {
					if p := Partition(span.TraceID(), partitions); p != pack.Partition {
						t.Errorf("trace %s (partition %d) packed for partition %d", span.TraceID(), p, pack.Partition)
					}
				}
			}
		}
	}
	if spans != td.SpanCount() {
		t.Errorf("packs hold %d spans, the batch %d", spans, td.SpanCount())
	}
}

func TestPackKeepsATracesSpanOrder(t *testing.T) {
	ids := someTraceIDs(5)
	packs, err := PackBatch(batch(t, ids, 4), 2, 900_000)
	if err != nil {
		t.Fatal(err)
	}
	for _, pack := range packs {
		for _, rs := range unpack(t, pack.Value).ResourceSpans().All() {
			last := map[pcommon.TraceID]string{}
			for _, span := range rs.ScopeSpans().At(0).Spans().All() {
				if prev, ok := last[span.TraceID()]; ok && prev >= span.Name() {
					t.Errorf("trace %s: %s after %s", span.TraceID(), span.Name(), prev)
				}
				last[span.TraceID()] = span.Name()
			}
		}
	}
}

func TestAnOversizedPackIsCutBetweenTraces(t *testing.T) {
	ids := someTraceIDs(30)
	td := batch(t, ids, 5)
	whole, err := PackBatch(td, 1, 1<<30)
	if err != nil || len(whole) != 1 {
		t.Fatalf("one partition, no limit: %d packs (%v)", len(whole), err)
	}
	limit := len(whole[0].Value) / 4
	packs, err := PackBatch(td, 1, limit)
	if err != nil {
		t.Fatal(err)
	}
	if len(packs) < 4 {
		t.Fatalf("%d packs under a quarter of the size, want at least 4", len(packs))
	}
	traces, spans := map[pcommon.TraceID]int{}, 0
	for index, pack := range packs {
		if len(pack.Value) > limit {
			t.Errorf("pack %d: %d bytes over the %d limit", index, len(pack.Value), limit)
		}
		packed := unpack(t, pack.Value)
		spans += packed.SpanCount()
		for _, rs := range packed.ResourceSpans().All() {
			for _, span := range rs.ScopeSpans().At(0).Spans().All() {
				if first, ok := traces[span.TraceID()]; ok && first != index {
					t.Errorf("trace %s cut across packs %d and %d", span.TraceID(), first, index)
				}
				traces[span.TraceID()] = index
			}
		}
	}
	if spans != td.SpanCount() || len(traces) != len(ids) {
		t.Errorf("packs hold %d spans of %d traces, want %d of %d", spans, len(traces), td.SpanCount(), len(ids))
	}
}

func TestRecordsAreMarkedWithTheirPartition(t *testing.T) {
	records := Records([]Pack{{Partition: 5, Value: []byte("x"), Traces: 1}}, 8)
	if len(records) != 1 || records[0].Partition != 5 {
		t.Fatalf("records: %+v", records)
	}
	header := records[0].Headers
	if len(header) != 1 || header[0].Key != HeaderPack || string(header[0].Value) != "5/8" {
		t.Errorf("headers %+v, want %s: 5/8", header, HeaderPack)
	}
}
