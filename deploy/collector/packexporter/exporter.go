package packexporter

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/pdata/ptrace"
	"go.uber.org/zap"
)

// HeaderPack marks a packed record; its value, "PARTITION/PARTITIONS", is the partition the
// record was written to and the topic's partition count when it was packed. The worker decides
// a record in place only when PARTITION is the one it read it from and every trace in it lives
// there; otherwise it repartitions the record's traces as it does a stock Collector's batch.
const HeaderPack = "spanguard-pack"

type packExporter struct {
	config Config
	logger *zap.Logger
	client *kgo.Client

	mu          sync.Mutex
	partitions  int32
	refreshedAt time.Time
}

func newPackExporter(config Config, logger *zap.Logger) *packExporter {
	return &packExporter{config: config, logger: logger}
}

func (e *packExporter) start(ctx context.Context, host component.Host) error {
	opts := []kgo.Opt{
		kgo.SeedBrokers(e.config.Brokers...),
		kgo.ClientID(e.config.ClientID),
		kgo.DefaultProduceTopic(e.config.Topic),
		kgo.RecordPartitioner(kgo.ManualPartitioner()),
		kgo.ProducerLinger(e.config.Linger),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// franz-go compresses with snappy unless told; the worker's client (aiokafka) reads
		// no snappy without a library it does not ship with, as the stock exporter's
		// default (none) never asks of it.
		kgo.ProducerBatchCompression(kgo.NoCompression()),
	}
	if tlsConfig := e.config.TLS.Get(); tlsConfig != nil {
		loaded, err := tlsConfig.LoadTLSConfig(ctx)
		if err != nil {
			return fmt.Errorf("spanguard_pack: tls: %w", err)
		}
		opts = append(opts, kgo.DialTLSConfig(loaded))
	}
	client, err := kgo.NewClient(opts...)
	if err != nil {
		return fmt.Errorf("spanguard_pack: kafka client: %w", err)
	}
	e.client = client
	return nil
}

func (e *packExporter) shutdown(context.Context) error {
	if e.client != nil {
		e.client.Close()
	}
	return nil
}

// partitionCount is the topic's partition count from the cluster, read again once it is older
// than MetadataRefresh: partitions added to the topic move traces, as they do for keyed records.
func (e *packExporter) partitionCount(ctx context.Context) (int32, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.partitions > 0 && time.Since(e.refreshedAt) < e.config.MetadataRefresh {
		return e.partitions, nil
	}
	count, err := topicPartitions(ctx, e.client, e.config.Topic)
	if err != nil {
		if e.partitions > 0 {
			e.logger.Warn("partition count not refreshed; keeping the last one",
				zap.String("topic", e.config.Topic), zap.Int32("partitions", e.partitions), zap.Error(err))
			return e.partitions, nil
		}
		return 0, err
	}
	if e.partitions != 0 && count != e.partitions {
		e.logger.Info("the topic's partition count changed",
			zap.String("topic", e.config.Topic), zap.Int32("from", e.partitions), zap.Int32("to", count))
	}
	e.partitions, e.refreshedAt = count, time.Now()
	return count, nil
}

func topicPartitions(ctx context.Context, client *kgo.Client, topic string) (int32, error) {
	request := kmsg.NewPtrMetadataRequest()
	requested := kmsg.NewMetadataRequestTopic()
	requested.Topic = kmsg.StringPtr(topic)
	request.Topics = append(request.Topics, requested)
	response, err := request.RequestWith(ctx, client)
	if err != nil {
		return 0, fmt.Errorf("metadata of topic %s: %w", topic, err)
	}
	for _, found := range response.Topics {
		if found.Topic == nil || *found.Topic != topic {
			continue
		}
		if err := kerr.ErrorForCode(found.ErrorCode); err != nil {
			return 0, fmt.Errorf("metadata of topic %s: %w", topic, err)
		}
		if len(found.Partitions) == 0 {
			return 0, fmt.Errorf("topic %s has no partitions", topic)
		}
		return int32(len(found.Partitions)), nil
	}
	return 0, fmt.Errorf("metadata of topic %s: not in the broker's answer", topic)
}

func (e *packExporter) pushTraces(ctx context.Context, td ptrace.Traces) error {
	if td.SpanCount() == 0 {
		return nil
	}
	partitions, err := e.partitionCount(ctx)
	if err != nil {
		return err
	}
	packs, err := PackBatch(td, partitions, e.config.MaxRecordBytes)
	if err != nil {
		return err
	}
	records := Records(packs, partitions)
	return errors.Join(firstErrors(e.client.ProduceSync(ctx, records...))...)
}

// Records are the packs as Kafka records, each on its partition and marked with HeaderPack.
func Records(packs []Pack, partitions int32) []*kgo.Record {
	records := make([]*kgo.Record, 0, len(packs))
	for _, pack := range packs {
		mark := strconv.Itoa(int(pack.Partition)) + "/" + strconv.Itoa(int(partitions))
		records = append(records, &kgo.Record{
			Partition: pack.Partition,
			Value:     pack.Value,
			Headers:   []kgo.RecordHeader{{Key: HeaderPack, Value: []byte(mark)}},
		})
	}
	return records
}

// firstErrors: one error per failed record would repeat itself; one per distinct error is enough.
func firstErrors(results kgo.ProduceResults) []error {
	var errs []error
	seen := map[string]bool{}
	for _, result := range results {
		if result.Err != nil && !seen[result.Err.Error()] {
			seen[result.Err.Error()] = true
			errs = append(errs, result.Err)
		}
	}
	return errs
}
