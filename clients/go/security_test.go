package killswitch

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TLS and SASL settings: refused when they cannot work together (the same refusals as
// config/kafka_security.py), before any connection.

func TestSecurityRefusals(t *testing.T) {
	missing := filepath.Join(t.TempDir(), "nope.pem")
	cases := []struct {
		name     string
		security Security
		message  string
	}{
		{"an unknown protocol", Security{Protocol: "TLS"}, "security.protocol must be one of"},
		{"SASL without a mechanism", Security{Protocol: "SASL_SSL", SASLUsername: "u", SASLPassword: "p"}, "needs sasl.mechanism"},
		{"SASL without a password", Security{Protocol: "SASL_PLAINTEXT", SASLMechanism: "PLAIN", SASLUsername: "u"}, "needs sasl.username and sasl.password"},
		{"a SASL mechanism over PLAINTEXT", Security{Protocol: "PLAINTEXT", SASLMechanism: "PLAIN"}, "use SASL_SSL"},
		{"a CA over PLAINTEXT", Security{SSLCALocation: missing}, "use SSL or SASL_SSL"},
		{"a certificate without its key", Security{Protocol: "SSL", SSLCertificateLocation: missing}, "go together"},
		{"a CA file that is not there", Security{Protocol: "SSL", SSLCALocation: missing}, "no such file"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.security.Options()
			if err == nil || !strings.Contains(err.Error(), c.message) {
				t.Fatalf("got %v, want an error saying %q", err, c.message)
			}
		})
	}
}

func TestSecurityMapsSASLAndTLS(t *testing.T) {
	for _, mechanism := range []string{"PLAIN", "scram-sha-256", "SCRAM-SHA-512"} {
		options, err := Security{Protocol: "sasl_plaintext", SASLMechanism: mechanism, SASLUsername: "u", SASLPassword: "p"}.Options()
		if err != nil || len(options) != 1 {
			t.Fatalf("%s: %v %d", mechanism, err, len(options))
		}
	}
	options, err := Security{}.Options()
	if err != nil || len(options) != 0 {
		t.Fatalf("plaintext: %v %d", err, len(options))
	}
}

func TestSecurityFromEnvReadsThePasswordFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "password")
	if err := os.WriteFile(file, []byte("s3cret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("SPANGUARD_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
	t.Setenv("SPANGUARD_KAFKA_SASL_MECHANISM", "PLAIN")
	t.Setenv("SPANGUARD_KAFKA_SASL_USERNAME", "agent")
	t.Setenv("SPANGUARD_KAFKA_SASL_PASSWORD_FILE", file)
	security, err := SecurityFromEnv()
	if err != nil || security.SASLPassword != "s3cret" || security.SASLUsername != "agent" {
		t.Fatalf("%+v %v", security, err)
	}
}
