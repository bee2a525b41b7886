// Package packexporter is spanguard's Collector exporter: each batch goes to Kafka as one record
// per partition of the input topic, holding every trace of the batch that lives there, so the
// worker decides it where it lands instead of splitting it through its repartition topic.
package packexporter

import (
	"context"
	"time"

	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/config/configoptional"
	"go.opentelemetry.io/collector/config/configretry"
	"go.opentelemetry.io/collector/consumer"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/exporter/exporterhelper"
)

const typeName = "spanguard_pack"

var componentType = component.MustNewType(typeName)

// NewFactory is what the Collector Builder's manifest names.
func NewFactory() exporter.Factory {
	return exporter.NewFactory(
		componentType,
		createDefaultConfig,
		exporter.WithTraces(createTracesExporter, component.StabilityLevelDevelopment),
	)
}

func createDefaultConfig() component.Config {
	return &Config{
		TimeoutConfig:    exporterhelper.NewDefaultTimeoutConfig(),
		QueueBatchConfig: configoptional.Some(exporterhelper.NewDefaultQueueConfig()),
		BackOffConfig:    configretry.NewDefaultBackOffConfig(),
		Brokers:          []string{"localhost:9092"},
		ClientID:         "spanguard-collector",
		Topic:            "otlp_spans",
		MetadataRefresh:  10 * time.Second,
		Linger:           5 * time.Millisecond,
		// The worker's own records stay under this (spanguard/detection/pipeline.py).
		MaxRecordBytes: 900_000,
	}
}

func createTracesExporter(ctx context.Context, set exporter.Settings, cfg component.Config) (exporter.Traces, error) {
	config := *cfg.(*Config)
	exp := newPackExporter(config, set.Logger)
	return exporterhelper.NewTraces(ctx, set, &config, exp.pushTraces,
		exporterhelper.WithCapabilities(consumer.Capabilities{MutatesData: false}),
		exporterhelper.WithTimeout(config.TimeoutConfig),
		exporterhelper.WithRetry(config.BackOffConfig),
		exporterhelper.WithQueue(config.QueueBatchConfig),
		exporterhelper.WithStart(exp.start),
		exporterhelper.WithShutdown(exp.shutdown),
	)
}
