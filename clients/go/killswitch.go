package killswitch

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"
	"go.opentelemetry.io/otel/baggage"
	"go.opentelemetry.io/otel/sdk/resource"
	"go.opentelemetry.io/otel/trace"
)

// Security is how the reader connects: TLS, mutual TLS and SASL, with the names of the
// SPANGUARD_KAFKA_* variables the worker and the Python killswitch read.
type Security struct {
	Protocol                  string // PLAINTEXT, SSL, SASL_PLAINTEXT or SASL_SSL
	SSLCALocation             string
	SSLCertificateLocation    string
	SSLKeyLocation            string
	SSLEndpointIdentification string // https (default) or none
	SASLMechanism             string // PLAIN, SCRAM-SHA-256 or SCRAM-SHA-512
	SASLUsername              string
	SASLPassword              string
}

// SecurityFromEnv reads SPANGUARD_KAFKA_* (a password also from SPANGUARD_KAFKA_SASL_PASSWORD_FILE).
func SecurityFromEnv() (Security, error) {
	get := func(name string) string { return os.Getenv("SPANGUARD_KAFKA_" + name) }
	password := get("SASL_PASSWORD")
	if file := get("SASL_PASSWORD_FILE"); password == "" && file != "" {
		data, err := os.ReadFile(file)
		if err != nil {
			return Security{}, fmt.Errorf("SPANGUARD_KAFKA_SASL_PASSWORD_FILE: cannot read %q", file)
		}
		password = strings.TrimRight(string(data), "\r\n")
	}
	return Security{
		Protocol:                  get("SECURITY_PROTOCOL"),
		SSLCALocation:             get("SSL_CA_LOCATION"),
		SSLCertificateLocation:    get("SSL_CERTIFICATE_LOCATION"),
		SSLKeyLocation:            get("SSL_KEY_LOCATION"),
		SSLEndpointIdentification: get("SSL_ENDPOINT_IDENTIFICATION_ALGORITHM"),
		SASLMechanism:             get("SASL_MECHANISM"),
		SASLUsername:              get("SASL_USERNAME"),
		SASLPassword:              password,
	}, nil
}

// Options are franz-go client options for s; settings that cannot work together (a SASL
// mechanism over PLAINTEXT, a certificate without its key) are refused before any connection.
func (s Security) Options() ([]kgo.Opt, error) {
	protocol := strings.ToUpper(strings.TrimSpace(s.Protocol))
	if protocol == "" {
		protocol = "PLAINTEXT"
	}
	usesSASL := strings.HasPrefix(protocol, "SASL_")
	usesTLS := protocol == "SSL" || protocol == "SASL_SSL"
	if protocol != "PLAINTEXT" && !usesSASL && !usesTLS || usesSASL && protocol != "SASL_SSL" && protocol != "SASL_PLAINTEXT" {
		return nil, fmt.Errorf("security.protocol must be one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL, not %q", s.Protocol)
	}
	var options []kgo.Opt
	if usesSASL {
		if s.SASLUsername == "" || s.SASLPassword == "" {
			return nil, fmt.Errorf("security.protocol %s needs sasl.username and sasl.password", protocol)
		}
		switch strings.ToUpper(strings.TrimSpace(s.SASLMechanism)) {
		case "PLAIN":
			options = append(options, kgo.SASL(plain.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsMechanism()))
		case "SCRAM-SHA-256":
			options = append(options, kgo.SASL(scram.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsSha256Mechanism()))
		case "SCRAM-SHA-512":
			options = append(options, kgo.SASL(scram.Auth{User: s.SASLUsername, Pass: s.SASLPassword}.AsSha512Mechanism()))
		default:
			return nil, fmt.Errorf("security.protocol %s needs sasl.mechanism, one of PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 (got %q)", protocol, s.SASLMechanism)
		}
	} else if s.SASLMechanism != "" || s.SASLUsername != "" || s.SASLPassword != "" {
		return nil, fmt.Errorf("SASL settings are set but security.protocol is %s: use SASL_SSL (or SASL_PLAINTEXT)", protocol)
	}
	if !usesTLS {
		if s.SSLCALocation != "" || s.SSLCertificateLocation != "" || s.SSLKeyLocation != "" {
			return nil, fmt.Errorf("TLS settings are set but security.protocol is %s: use SSL or SASL_SSL", protocol)
		}
		return options, nil
	}
	if (s.SSLCertificateLocation == "") != (s.SSLKeyLocation == "") {
		return nil, errors.New("ssl.certificate.location and ssl.key.location go together (mutual TLS): set both or neither")
	}
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	if s.SSLCALocation != "" {
		pem, err := os.ReadFile(s.SSLCALocation)
		if err != nil {
			return nil, fmt.Errorf("ssl.ca.location: no such file %q", s.SSLCALocation)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("ssl.ca.location: no certificate in %q", s.SSLCALocation)
		}
		config.RootCAs = pool
	}
	if s.SSLCertificateLocation != "" {
		pair, err := tls.LoadX509KeyPair(s.SSLCertificateLocation, s.SSLKeyLocation)
		if err != nil {
			return nil, fmt.Errorf("ssl.certificate.location / ssl.key.location: %v", err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	switch strings.ToLower(s.SSLEndpointIdentification) {
	case "", "https":
	case "none":
		// The chain is still verified; only the broker's name is not checked against it.
		config.InsecureSkipVerify = true
		roots := config.RootCAs
		config.VerifyPeerCertificate = func(raw [][]byte, _ [][]*x509.Certificate) error {
			return verifyChainWithoutName(raw, roots)
		}
	default:
		return nil, fmt.Errorf("ssl.endpoint.identification.algorithm must be https or none, not %q", s.SSLEndpointIdentification)
	}
	return append(options, kgo.DialTLSConfig(config)), nil
}

func verifyChainWithoutName(raw [][]byte, roots *x509.CertPool) error {
	if len(raw) == 0 {
		return errors.New("the broker sent no certificate")
	}
	certificates := make([]*x509.Certificate, len(raw))
	for i, der := range raw {
		certificate, err := x509.ParseCertificate(der)
		if err != nil {
			return err
		}
		certificates[i] = certificate
	}
	intermediates := x509.NewCertPool()
	for _, certificate := range certificates[1:] {
		intermediates.AddCert(certificate)
	}
	_, err := certificates[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: intermediates})
	return err
}

// Config of a KillSwitch. SigningKeys (the worker's SPANGUARD_SIGNING_KEY; several while
// rotating) or AllowUnsigned (INSECURE: anyone who can write the topic can stop the agent).
type Config struct {
	Brokers       []string
	Topic         string // default agent-kill-signals
	SigningKeys   [][]byte
	AllowUnsigned bool
	Signals       *SignalBook      // default a new book
	Security      *Security        // default SecurityFromEnv
	Clock         func() time.Time // decides expiry (and pause deadlines, in the default book)
	Logger        *log.Logger      // default log.Default()
	StartTimeout  time.Duration
	// This process's conversation and agent, checked on every Check (CheckIn's own win).
	ConversationID string
	Agent          *Agent
	// The resource the agent's TracerProvider was built with (sdktrace.WithResource): its
	// service.name and gen_ai.agent.name name the agent when neither the check nor Agent does.
	// Without it, CheckContext reads the resource of the span in its context.
	Resource *resource.Resource
}

// KillSwitch reads every partition of the kill topic, from the end offsets resolved when New
// returns, with no consumer group (no rebalance, no commits), into a SignalBook; the agent
// calls Check before each tool call. A bad record is counted in Ignored (by kind), logged once
// per kind, and costs only itself: the reader never stops.
type KillSwitch struct {
	Signals  *SignalBook
	topic    string
	keys     map[string][]byte
	clock    func() time.Time
	logger   *log.Logger
	client   *kgo.Client
	cancel   context.CancelFunc
	done     chan struct{}
	mu       sync.Mutex
	ignored  map[string]int
	received atomic.Int64
	scope    scopeDefaults
	// Checks that found no trace to check: tool calls nothing guarded (logged once for
	// Check and CheckIn, once for CheckContext). warnedUnguarded is guarded by mu.
	unguarded       atomic.Int64
	warnedUnguarded map[string]bool
	warnedContained map[string]bool // the tools whose refused call was logged (guarded by mu)
}

// scopeDefaults are a KillSwitch's own conversation and agent: Config's, and the agent its
// Resource names.
type scopeDefaults struct {
	conversationID string
	agent          *Agent
	resourceAgent  *Agent
}

func scopeDefaultsOf(config Config) scopeDefaults {
	return scopeDefaults{config.ConversationID, config.Agent, AgentOf(config.Resource)}
}

// ConversationBaggageKeys name a process's conversation in OpenTelemetry baggage, first
// present wins (the worker reads the same names off spans).
var ConversationBaggageKeys = []string{"gen_ai.conversation.id", "session.id"}

// ConversationOf returns the conversation the OpenTelemetry baggage of ctx names, or "".
func ConversationOf(ctx context.Context) string {
	bag := baggage.FromContext(ctx)
	for _, key := range ConversationBaggageKeys {
		if value := bag.Member(key).Value(); value != "" {
			return value
		}
	}
	return ""
}

// AgentOf returns the agent an OpenTelemetry resource names (service.name, with
// gen_ai.agent.name when set), or nil when it has no service.name.
func AgentOf(res *resource.Resource) *Agent {
	if res == nil {
		return nil
	}
	set := res.Set()
	service, ok := set.Value("service.name")
	if !ok || service.AsString() == "" {
		return nil
	}
	agent := &Agent{Service: service.AsString()}
	if name, ok := set.Value("gen_ai.agent.name"); ok {
		agent.Name = name.AsString()
	}
	return agent
}

// Scope is the conversation and agent a check stands for, each from the first source that
// names it: given, the Config's, then the OpenTelemetry baggage of ctx for the conversation
// (ConversationBaggageKeys) and the Config's Resource, else the resource of the span in ctx,
// for the agent (taken whole from one source).
func (k *KillSwitch) Scope(ctx context.Context, given CheckScope) CheckScope {
	return k.scope.resolve(ctx, given)
}

func (d scopeDefaults) resolve(ctx context.Context, given CheckScope) CheckScope {
	if given.ConversationID == "" {
		given.ConversationID = d.conversationID
	}
	if given.ConversationID == "" {
		given.ConversationID = ConversationOf(ctx)
	}
	if given.Agent == nil {
		given.Agent = d.agent
	}
	if given.Agent == nil {
		given.Agent = d.resourceAgent
	}
	if given.Agent == nil {
		// An SDK span is a ReadOnlySpan: it carries its provider's resource.
		if span, ok := trace.SpanFromContext(ctx).(interface{ Resource() *resource.Resource }); ok {
			given.Agent = AgentOf(span.Resource())
		}
	}
	return given
}

// ErrSettings is wrapped by every refusal of a Config.
var ErrSettings = errors.New("killswitch settings")

// New connects, positions every partition at its end offset, and starts reading.
func New(ctx context.Context, config Config) (*KillSwitch, error) {
	if len(config.SigningKeys) > 0 && config.AllowUnsigned {
		return nil, fmt.Errorf("%w: give signing keys or AllowUnsigned, not both", ErrSettings)
	}
	if len(config.SigningKeys) == 0 && !config.AllowUnsigned {
		return nil, fmt.Errorf("%w: no signing key: pass SigningKeys (the worker's SPANGUARD_SIGNING_KEY), or AllowUnsigned to obey unsigned signals (insecure)", ErrSettings)
	}
	var keys map[string][]byte
	if len(config.SigningKeys) > 0 {
		ring, err := Keyring(config.SigningKeys...)
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrSettings, err)
		}
		keys = ring
	}
	security := config.Security
	if security == nil {
		fromEnv, err := SecurityFromEnv()
		if err != nil {
			return nil, fmt.Errorf("%w: %v", ErrSettings, err)
		}
		security = &fromEnv
	}
	securityOptions, err := security.Options()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSettings, err)
	}
	topic := config.Topic
	if topic == "" {
		topic = "agent-kill-signals"
	}
	timeout := config.StartTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	base := append([]kgo.Opt{kgo.SeedBrokers(config.Brokers...), kgo.ClientID("spanguard-killswitch")}, securityOptions...)
	ends, err := endOffsets(ctx, base, topic, timeout)
	if err != nil {
		return nil, err
	}
	client, err := kgo.NewClient(append(base,
		kgo.ConsumePartitions(map[string]map[int32]kgo.Offset{topic: ends}),
		kgo.FetchMaxWait(50*time.Millisecond),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()),
	)...)
	if err != nil {
		return nil, err
	}
	clock := config.Clock
	if clock == nil {
		clock = time.Now
	}
	signals := config.Signals
	if signals == nil {
		signals = NewSignalBook(0)
		signals.Clock = clock
	}
	logger := config.Logger
	if logger == nil {
		logger = log.Default()
	}
	runContext, cancel := context.WithCancel(context.Background())
	k := &KillSwitch{
		Signals: signals, topic: topic, keys: keys, clock: clock, logger: logger,
		client: client, cancel: cancel, done: make(chan struct{}), ignored: map[string]int{},
		scope: scopeDefaultsOf(config),
	}
	go k.run(runContext)
	return k, nil
}

// endOffsets resolves every partition's end offset now, retrying while a new topic settles; a
// refused password or certificate fails at once.
func endOffsets(ctx context.Context, base []kgo.Opt, topic string, timeout time.Duration) (map[int32]kgo.Offset, error) {
	client, err := kgo.NewClient(base...)
	if err != nil {
		return nil, err
	}
	defer client.Close()
	admin := kadm.NewClient(client)
	deadline := time.Now().Add(timeout)
	for {
		ends := map[int32]kgo.Offset{}
		listed, err := admin.ListEndOffsets(ctx, topic)
		if err == nil {
			listed.Each(func(o kadm.ListedOffset) {
				if o.Err != nil && err == nil {
					err = o.Err
				}
				ends[o.Partition] = kgo.NewOffset().At(o.Offset)
			})
			if err == nil && len(ends) == 0 {
				err = fmt.Errorf("topic %q not found", topic)
			}
		}
		if err == nil {
			return ends, nil
		}
		if errors.Is(err, context.Canceled) || time.Now().After(deadline) || isAuthError(err) {
			return nil, fmt.Errorf("kill-signal topic %q: %w", topic, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

func isAuthError(err error) bool {
	text := err.Error()
	return strings.Contains(text, "SASL") || strings.Contains(text, "certificate") || strings.Contains(text, "tls:")
}

// Check returns *AgentKilled if traceID was killed; a downgrade's system message once; else "".
// It reads memory only: it never waits on Kafka. An empty traceID checks the Config's scope
// only, and the call is counted in Unguarded (logged once): a tool call no trace kill can stop
// is never silent.
func (k *KillSwitch) Check(traceID string) (string, error) {
	return k.checkIn(context.Background(), traceID, CheckScope{}, "Check/CheckIn")
}

// CheckIn is Check for a trace of a conversation or agent (empty fields: the Config's, and
// the agent its Resource names): a conversation or agent kill stops it too. For the baggage of
// a context as well: k.CheckIn(traceID, k.Scope(ctx, scope)). An empty traceID is counted in
// Unguarded, as in Check.
func (k *KillSwitch) CheckIn(traceID string, scope CheckScope) (string, error) {
	return k.checkIn(context.Background(), traceID, scope, "Check/CheckIn")
}

// CheckContext is Check for the trace of the span in ctx, in the scope Scope finds: the
// conversation of its OpenTelemetry baggage, the agent of the Config or of the span's resource.
// Without a valid span in ctx only the scope is checked, and the call is counted in
// Unguarded (logged once): a tool call no trace kill can stop is never silent.
func (k *KillSwitch) CheckContext(ctx context.Context) (string, error) {
	traceID := ""
	if spanContext := trace.SpanContextFromContext(ctx); spanContext.IsValid() {
		traceID = spanContext.TraceID().String()
	}
	return k.checkIn(ctx, traceID, CheckScope{}, "CheckContext")
}

// checkIn checks the scope, then the trace; `where` names the method for the warning about a
// check with no trace. A scope kill returns first: that tool call is stopped, not unguarded.
func (k *KillSwitch) checkIn(ctx context.Context, traceID string, scope CheckScope, where string) (string, error) {
	// The span the stop event goes on (stop.go): ctx's, so CheckContext records and Check,
	// given no context, does not.
	span := trace.SpanFromContext(ctx)
	if err := k.Signals.CheckScopes(k.scope.resolve(ctx, scope)); err != nil {
		recordResult(span, nil, err)
		return "", err
	}
	if traceID == "" {
		k.noteUnguarded(where)
		return "", k.noteContained(k.Signals.CheckTool(scope.Tool, scope.Server))
	}
	message, downgrade, err := k.Signals.checkCall(traceID, scope.Tool, scope.Server)
	recordResult(span, downgrade, err)
	return message, k.noteContained(err)
}

// CheckTool returns *ToolContained if tool (on server; nil: unknown) is contained.
func (k *KillSwitch) CheckTool(tool string, server *string) error {
	return k.noteContained(k.Signals.CheckTool(tool, server))
}

// noteContained logs the first refused call to each tool (the rest are counted in the book's
// ToolCallsRefused) and returns err.
func (k *KillSwitch) noteContained(err error) error {
	var contained *ToolContained
	if !errors.As(err, &contained) {
		return err
	}
	key := contained.Tool + "\x00" + contained.Server
	k.mu.Lock()
	first := !k.warnedContained[key] && len(k.warnedContained) < k.Signals.MaxTraces
	if first {
		if k.warnedContained == nil {
			k.warnedContained = map[string]bool{}
		}
		k.warnedContained[key] = true
	}
	k.mu.Unlock()
	if first {
		k.logger.Printf("spanguard killswitch: %s (rule %s, signal %s); further calls to it are counted in Signals.ToolCallsRefused, not logged", contained, contained.Killed.Signal.Rule, contained.Killed.Signal.SignalID)
	}
	return err
}

// What to do about a check with no trace, by where it found none: Check and CheckIn (given
// no trace id) are one place, CheckContext (no span in its context) the other.
var unguardedAdvice = map[string]string{
	"Check/CheckIn": "given no trace id: pass the run's trace id, or call CheckContext with the agent span's context",
	"CheckContext":  "no span in its context: call it with the agent span's context, or Check(traceID)",
}

// noteUnguarded counts a tool call that could not be checked (no trace) and warns once per
// place (unguardedAdvice): an agent that cannot be told its trace was killed is not guarded.
func (k *KillSwitch) noteUnguarded(where string) {
	k.unguarded.Add(1)
	k.mu.Lock()
	first := !k.warnedUnguarded[where]
	if first {
		if k.warnedUnguarded == nil {
			k.warnedUnguarded = map[string]bool{}
		}
		k.warnedUnguarded[where] = true
	}
	k.mu.Unlock()
	if first {
		k.logger.Printf("spanguard killswitch: %s found no trace to check, so this tool call is NOT guarded against a kill of its trace: %s (further ones are counted in Unguarded(), not logged)", where, unguardedAdvice[where])
	}
}

// Unguarded counts checks that found no trace to check (Check or CheckIn given no trace id,
// CheckContext with no span in its context): tool calls nothing guarded.
func (k *KillSwitch) Unguarded() int64 { return k.unguarded.Load() }

// Wait is Check, and while the trace is paused (*AgentPaused), blocks until an operator's
// release (returns: go on) or kill (*AgentKilled), or the pause's deadline, when the policy's
// fallback applies; ctx bounds the wait (then *AgentPaused again). See SignalBook.Wait.
func (k *KillSwitch) Wait(ctx context.Context, traceID string) (string, error) {
	if traceID == "" {
		return "", nil
	}
	return k.Signals.Wait(ctx, traceID)
}

// Received counts the records read (delivered to the book or ignored).
func (k *KillSwitch) Received() int64 { return k.received.Load() }

// Ignored returns the bad records by kind.
func (k *KillSwitch) Ignored() map[string]int {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make(map[string]int, len(k.ignored))
	for kind, n := range k.ignored {
		out[kind] = n
	}
	return out
}

// Malformed counts records that are not a kill signal at all.
func (k *KillSwitch) Malformed() int { return k.sum(MalformedKinds) }

// Rejected counts signals unsigned, signed with a key the agent lacks, or forged.
func (k *KillSwitch) Rejected() int { return k.sum(RejectedKinds) }

// Expired counts valid signals read after their expires_at.
func (k *KillSwitch) Expired() int { return k.Ignored()["expired"] }

func (k *KillSwitch) sum(kinds map[string]bool) int {
	total := 0
	for kind, n := range k.Ignored() {
		if kinds[kind] {
			total += n
		}
	}
	return total
}

// Close stops the reader.
func (k *KillSwitch) Close() {
	k.cancel()
	<-k.done
	k.client.Close()
}

func (k *KillSwitch) run(ctx context.Context) {
	defer close(k.done)
	for ctx.Err() == nil {
		fetches := k.client.PollFetches(ctx)
		if ctx.Err() != nil {
			return
		}
		for _, fetchError := range fetches.Errors() {
			// Leaders move and brokers restart; franz-go retries: count and go on, never stop.
			k.ignore(&BadSignal{Kind: "consumer_error", Detail: fetchError.Err.Error()})
		}
		fetches.EachRecord(func(record *kgo.Record) { k.accept(record.Value) })
	}
}

func (k *KillSwitch) accept(value []byte) {
	defer k.received.Add(1) // counted once the record is in the book or in Ignored
	defer func() {
		if r := recover(); r != nil { // a bug must cost one record, never the reader
			k.ignore(&BadSignal{Kind: "internal", Detail: fmt.Sprint(r)})
		}
	}()
	signal, err := ReadSignal(value, k.keys, k.clock())
	if err != nil {
		var badSignal *BadSignal
		if errors.As(err, &badSignal) {
			k.ignore(badSignal)
			return
		}
		k.ignore(&BadSignal{Kind: "internal", Detail: err.Error()})
		return
	}
	k.Signals.Deliver(signal)
}

func (k *KillSwitch) ignore(b *BadSignal) {
	k.mu.Lock()
	k.ignored[b.Kind]++
	first := k.ignored[b.Kind] == 1
	k.mu.Unlock()
	if first { // once per kind: a flood of junk must not flood the log
		k.logger.Printf("spanguard killswitch: ignored a kill-signal record (%s): %s; further ones of this kind are counted in Ignored(), not logged", b.Kind, b.Detail)
	}
}
