package packexporter

import (
	"context"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"go.opentelemetry.io/collector/component/componenttest"
	"go.opentelemetry.io/collector/config/configoptional"
	"go.opentelemetry.io/collector/exporter/exporterhelper"
	"go.opentelemetry.io/collector/exporter/exportertest"
)

const topic = "otlp_spans"

// exporterOn starts the exporter, as the Collector would, against a fake cluster whose topic has
// `partitions` partitions; nothing in its configuration says how many.
func exporterOn(t *testing.T, partitions int32) (*kfake.Cluster, func(context.Context) error) {
	t.Helper()
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(partitions, topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cluster.Close)
	factory := NewFactory()
	config := factory.CreateDefaultConfig().(*Config)
	config.Brokers = cluster.ListenAddrs()
	config.QueueBatchConfig = configoptional.None[exporterhelper.QueueBatchConfig]() // push synchronously
	config.BackOffConfig.Enabled = false
	if err := config.Validate(); err != nil {
		t.Fatal(err)
	}
	exp, err := factory.CreateTraces(context.Background(), exportertest.NewNopSettings(componentType), config)
	if err != nil {
		t.Fatal(err)
	}
	if err := exp.Start(context.Background(), componenttest.NewNopHost()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = exp.Shutdown(context.Background()) })
	return cluster, func(ctx context.Context) error {
		return exp.ConsumeTraces(ctx, batch(t, someTraceIDs(50), 2))
	}
}

func readAll(t *testing.T, cluster *kfake.Cluster, want int) []*kgo.Record {
	t.Helper()
	client, err := kgo.NewClient(kgo.SeedBrokers(cluster.ListenAddrs()...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var records []*kgo.Record
	for len(records) < want {
		fetches := client.PollFetches(ctx)
		if ctx.Err() != nil {
			t.Fatalf("read %d records, want %d", len(records), want)
		}
		records = append(records, fetches.Records()...)
	}
	return records
}

func TestOneMarkedRecordPerPartitionWithTheCountFromTheCluster(t *testing.T) {
	for _, partitions := range []int32{3, 8} {
		cluster, push := exporterOn(t, partitions)
		if err := push(context.Background()); err != nil {
			t.Fatal(err)
		}
		// 50 traces over at most 8 partitions: every partition gets some.
		records := readAll(t, cluster, int(partitions))
		spans, seen := 0, map[int32]bool{}
		for _, record := range records {
			if seen[record.Partition] {
				t.Errorf("%d partitions: two records on partition %d", partitions, record.Partition)
			}
			seen[record.Partition] = true
			if codec := record.Attrs.CompressionType(); codec != 0 {
				t.Errorf("partition %d: compressed with codec %d; the worker reads uncompressed", record.Partition, codec)
			}
			want := []kgo.RecordHeader{{Key: HeaderPack, Value: []byte(
				Records([]Pack{{Partition: record.Partition}}, partitions)[0].Headers[0].Value)}}
			if len(record.Headers) != 1 || string(record.Headers[0].Value) != string(want[0].Value) {
				t.Errorf("partition %d: headers %+v, want %+v", record.Partition, record.Headers, want)
			}
			packed := unpack(t, record.Value)
			spans += packed.SpanCount()
			for _, rs := range packed.ResourceSpans().All() {
				for _, span := range rs.ScopeSpans().At(0).Spans().All() {
					if p := Partition(span.TraceID(), partitions); p != record.Partition {
						t.Errorf("trace of partition %d written to %d", p, record.Partition)
					}
				}
			}
		}
		if len(records) != int(partitions) || spans != 50*2*2 {
			t.Errorf("%d partitions: %d records with %d spans, want %d with 200", partitions, len(records), spans, partitions)
		}
	}
}

func TestAMissingTopicFailsTheBatchForARetry(t *testing.T) {
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()
	exp := newPackExporter(*createDefaultConfig().(*Config), nil)
	exp.config.Brokers = cluster.ListenAddrs()
	exp.config.Topic = "no_such_topic"
	if err := exp.start(context.Background(), componenttest.NewNopHost()); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = exp.shutdown(context.Background()) }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := exp.pushTraces(ctx, batch(t, someTraceIDs(3), 1)); err == nil {
		t.Fatal("a batch for a topic the cluster lacks was taken")
	}
}

func TestConfigNeedsBrokersAndATopic(t *testing.T) {
	config := createDefaultConfig().(*Config)
	config.Brokers = nil
	if config.Validate() == nil {
		t.Error("no brokers validated")
	}
	config = createDefaultConfig().(*Config)
	config.Topic = ""
	if config.Validate() == nil {
		t.Error("no topic validated")
	}
}
