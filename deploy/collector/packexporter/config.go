package packexporter

import (
	"errors"
	"time"

	"go.opentelemetry.io/collector/config/configoptional"
	"go.opentelemetry.io/collector/config/configretry"
	"go.opentelemetry.io/collector/config/configtls"
	"go.opentelemetry.io/collector/exporter/exporterhelper"
)

// Config of the spanguard_pack exporter. The partition count is not set here: it is the topic's,
// read from the cluster's metadata (and read again every MetadataRefresh).
type Config struct {
	exporterhelper.TimeoutConfig `mapstructure:",squash"`
	QueueBatchConfig             configoptional.Optional[exporterhelper.QueueBatchConfig] `mapstructure:"sending_queue"`
	BackOffConfig                configretry.BackOffConfig                                `mapstructure:"retry_on_failure"`

	Brokers  []string `mapstructure:"brokers"`
	ClientID string   `mapstructure:"client_id"`
	Topic    string   `mapstructure:"topic"`
	// TLS to the brokers; unset, plaintext.
	TLS configoptional.Optional[configtls.ClientConfig] `mapstructure:"tls"`
	// How often the topic's partition count is read again from the cluster.
	MetadataRefresh time.Duration `mapstructure:"metadata_refresh"`
	// How long the client holds records for more of the same partition.
	Linger time.Duration `mapstructure:"linger"`
	// A partition's traces of one batch over this many bytes go in several records.
	MaxRecordBytes int `mapstructure:"max_record_bytes"`

	_ struct{}
}

func (c *Config) Validate() error {
	if len(c.Brokers) == 0 {
		return errors.New("brokers: at least one bootstrap broker is required")
	}
	if c.Topic == "" {
		return errors.New("topic must be set")
	}
	if c.MetadataRefresh <= 0 {
		return errors.New("metadata_refresh must be positive")
	}
	if c.MaxRecordBytes <= 0 {
		return errors.New("max_record_bytes must be positive")
	}
	return nil
}
