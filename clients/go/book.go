package killswitch

import (
	"container/list"
	"context"
	"fmt"
	"strings"
	"sync"
	"time"
)

// DefaultMaxTraces bounds each kind of entry of a SignalBook.
const DefaultMaxTraces = 10_000

// waitRecheck: a Wait re-checks at least this often, so a deadline is met even if the clock jumps.
const waitRecheck = time.Second

// AgentKilled is returned by Check in an agent whose trace was killed; it carries the signal.
type AgentKilled struct {
	Signal *Signal
}

func (k *AgentKilled) Error() string {
	return fmt.Sprintf("spanguard killed %s: %s", describeTarget(k.Signal), k.Signal.Reason)
}

// Scope is what a kill stops: "trace", "conversation" or "agent".
func (k *AgentKilled) Scope() string { return signalScope(k.Signal) }

func signalScope(signal *Signal) string {
	if signal.Scope == nil {
		return "trace"
	}
	return *signal.Scope
}

func describeTarget(signal *Signal) string {
	switch signalScope(signal) {
	case "conversation":
		return "conversation " + *signal.ConversationID
	case "tool":
		if signal.Tool.Server != "" {
			return "tool " + signal.Tool.Name + " on " + signal.Tool.Server
		}
		return "tool " + signal.Tool.Name
	case "agent":
		if signal.AgentName != nil && *signal.AgentName != "" {
			return "agent " + signal.AgentService + "/" + *signal.AgentName
		}
		return "agent " + signal.AgentService + " (every agent name)"
	}
	return "trace " + signal.TraceID
}

// ToolContained is returned by a check naming a tool that spanguard contained (a signal of
// scope "tool"): the call to that tool is refused, not the agent. It unwraps to its
// *AgentKilled, so code that looks only for AgentKilled (errors.As) still stops; a framework
// hook hands the model its message as the tool's error instead, so the agent can take another
// path.
type ToolContained struct {
	Killed *AgentKilled
	Tool   string
	Server string // the contain's server ("" when it names none)
}

func (c *ToolContained) Error() string {
	return fmt.Sprintf("tool %s is contained by spanguard: %s; use another tool", c.Tool, c.Killed.Signal.Reason)
}

// Unwrap is the AgentKilled the contain is.
func (c *ToolContained) Unwrap() error { return c.Killed }

func newToolContained(signal *Signal) *ToolContained {
	contained := &ToolContained{Killed: &AgentKilled{Signal: signal}}
	if signal.Tool != nil {
		contained.Tool, contained.Server = signal.Tool.Name, signal.Tool.Server
	}
	return contained
}

// maxServersPerTool bounds the servers remembered per tool name (least recently told forgotten).
const maxServersPerTool = 1000

// toolSignals is what one tool name was told: per server, its newest signal.
type toolSignals struct {
	signalIDs map[string]bool
	byServer  map[string]*Signal
	order     *list.List // of server names, front: least recently told
	elements  map[string]*list.Element
}

// Agent is an agent's identity: service.name and gen_ai.agent.name ("" when it has none).
type Agent struct {
	Service string
	Name    string
}

// ParseAgent reads "SERVICE/NAME" or "SERVICE" (every agent name of the service).
func ParseAgent(text string) (Agent, error) {
	service, name, _ := strings.Cut(text, "/")
	if service == "" {
		return Agent{}, fmt.Errorf("%w: %q names no service: SERVICE or SERVICE/NAME", ErrSettings, text)
	}
	return Agent{Service: service, Name: name}, nil
}

// CheckScope is who checks, beyond the trace: a conversation or agent kill stops every trace
// of it. Empty fields are not checked.
type CheckScope struct {
	ConversationID string
	Agent          *Agent
	// Tool is the tool about to be called ("": none): a contained one returns *ToolContained.
	Tool string
	// Server is its server when known (nil: unknown, a contain of the tool on any server holds).
	Server *string
}

type scopeSignals struct {
	signalIDs map[string]bool
	kill      *Signal
}

func scopeKeyOf(signal *Signal) string {
	if signalScope(signal) == "conversation" {
		return scopeKey("conversation", *signal.ConversationID, "")
	}
	name := ""
	if signal.AgentName != nil {
		name = *signal.AgentName
	}
	return scopeKey("agent", signal.AgentService, name)
}

func scopeKey(scope, id, name string) string {
	return fmt.Sprintf("%s\x00%s\x00%s", scope, id, name)
}

// atOrAfter: whether RFC 3339 time later is at or after earlier (unreadable: true).
func atOrAfter(later, earlier string) bool {
	a, okA := ParseDateTime(later)
	b, okB := ParseDateTime(earlier)
	if !okA || !okB {
		return true
	}
	return !a.Before(b)
}

// unreadMessage is a downgrade's message with its signal (its span event names the decision).
type unreadMessage struct {
	message string
	signal  *Signal
}

// AgentPaused is returned by Check in an agent whose trace is paused: it must wait for an
// operator's `spanguard release` (go on) or `spanguard kill` (stop), or until Until, when the
// policy's Fallback ("kill" or "release") applies. Wait does the waiting.
type AgentPaused struct {
	Signal   *Signal
	Until    string // the pause's pause_until, RFC 3339
	Fallback string
}

func (p *AgentPaused) Error() string {
	return fmt.Sprintf("spanguard paused trace %s: %s; waiting for `spanguard release` or `spanguard kill` until %s, then %s",
		p.Signal.TraceID, p.Signal.Reason, p.Until, p.Fallback)
}

func newAgentPaused(signal *Signal) *AgentPaused {
	paused := &AgentPaused{Signal: signal}
	if signal.PauseUntil != nil {
		paused.Until = *signal.PauseUntil
	}
	if signal.PauseFallback != nil {
		paused.Fallback = *signal.PauseFallback
	}
	return paused
}

type traceSignals struct {
	signalIDs map[string]bool
	kill      *Signal
	unread    []unreadMessage
	pause     *Signal // waiting for an operator (see AgentPaused)
}

// lru is a map that remembers the order entries were last touched: the book's traces, scopes
// and tools, each bounded by MaxTraces.
type lru[E any] struct {
	items map[string]*list.Element // of *lruItem[E]
	order *list.List               // front: least recently touched
}

type lruItem[E any] struct {
	key   string
	entry E
}

func newLRU[E any]() *lru[E] { return &lru[E]{items: map[string]*list.Element{}, order: list.New()} }

func (l *lru[E]) len() int { return len(l.items) }

// get returns the key's entry, or the zero E (nil) when there is none.
func (l *lru[E]) get(key string) E {
	if element, ok := l.items[key]; ok {
		return element.Value.(*lruItem[E]).entry
	}
	var none E
	return none
}

func (l *lru[E]) touch(key string) {
	if element, ok := l.items[key]; ok {
		l.order.MoveToBack(element)
	}
}

func (l *lru[E]) put(key string, entry E, limit int) {
	l.items[key] = l.order.PushBack(&lruItem[E]{key, entry})
	for l.order.Len() > limit {
		oldest := l.order.Front()
		l.order.Remove(oldest)
		delete(l.items, oldest.Value.(*lruItem[E]).key)
	}
}

func (l *lru[E]) remove(key string) E {
	element, ok := l.items[key]
	if !ok {
		var none E
		return none
	}
	l.order.Remove(element)
	delete(l.items, key)
	return element.Value.(*lruItem[E]).entry
}

// SignalBook holds what each trace was told: the agent's Check reads it, the Kafka reader writes
// it. The same semantics as the Python killswitch's SignalBook (killswitch/signals.py):
//   - Deliver records a signal; an id already recorded for its trace is a duplicate (false).
//   - Check returns *AgentKilled once a kill is recorded, on that check and every later one;
//     a downgrade's system message exactly once; else "".
//   - a release lifts the trace's kill until a later kill (a new signal id).
//   - a pause makes Check return *AgentPaused until a release (go on) or a kill, or until its
//     pause_until, when its fallback applies (kill: killed; release: go on); a later pause of
//     the trace replaces it; a pause of a killed trace leaves the kill. Wait blocks through it.
//
// Memory is bounded by MaxTraces per kind of entry; a killed trace this process has checked is
// never forgotten (until Forget). Safe for concurrent use. Clock (nil: time.Now; set it before
// use) decides when a pause's deadline has come.
type SignalBook struct {
	MaxTraces  int
	Clock      func() time.Time
	mu         sync.Mutex
	changed    chan struct{} // closed (and replaced) on every delivery: wakes Wait
	others     *lru[*traceSignals]
	watched    *lru[*traceSignals]
	killed     map[string]*traceSignals
	scopes     *lru[*scopeSignals]
	tools      *lru[*toolSignals]
	Delivered  int
	Duplicates int
	// ToolCallsRefused counts the calls refused because their tool was contained.
	ToolCallsRefused int
}

// NewSignalBook makes an empty book; maxTraces <= 0 means DefaultMaxTraces.
func NewSignalBook(maxTraces int) *SignalBook {
	if maxTraces <= 0 {
		maxTraces = DefaultMaxTraces
	}
	return &SignalBook{
		MaxTraces: maxTraces, others: newLRU[*traceSignals](), watched: newLRU[*traceSignals](),
		killed: map[string]*traceSignals{}, changed: make(chan struct{}),
		scopes: newLRU[*scopeSignals](), tools: newLRU[*toolSignals](),
	}
}

// firstDelivery: a signal id seen before on this entry is a duplicate (counted, not applied);
// a new one is counted and wakes the waiters. The caller holds the lock.
func (b *SignalBook) firstDelivery(seen map[string]bool, signal *Signal) bool {
	if seen[signal.SignalID] {
		b.Duplicates++
		return false
	}
	seen[signal.SignalID] = true
	b.Delivered++
	close(b.changed)
	b.changed = make(chan struct{})
	return true
}

func (b *SignalBook) deliverScoped(signal *Signal) bool {
	key := scopeKeyOf(signal)
	entry := b.scopes.get(key)
	if entry != nil {
		b.scopes.touch(key)
	} else {
		entry = &scopeSignals{signalIDs: map[string]bool{}}
		b.scopes.put(key, entry, b.MaxTraces)
	}
	if !b.firstDelivery(entry.signalIDs, signal) {
		return false
	}
	switch signal.Kind {
	case "release":
		if entry.kill != nil && atOrAfter(signal.DetectedAt, entry.kill.DetectedAt) {
			entry.kill = nil
		}
	case "kill":
		// The longest-lasting kill of the scope holds.
		if entry.kill == nil || !atOrAfter(entry.kill.ExpiresAt, signal.ExpiresAt) {
			entry.kill = signal
		}
	}
	return true
}

// deliverTool records a tool signal: the newest of the tool on its server (by detected_at)
// holds, a contain or a release. The caller holds the lock.
func (b *SignalBook) deliverTool(signal *Signal) bool {
	name, server := signal.Tool.Name, signal.Tool.Server
	entry := b.tools.get(name)
	if entry != nil {
		b.tools.touch(name)
	} else {
		entry = &toolSignals{signalIDs: map[string]bool{}, byServer: map[string]*Signal{}, order: list.New(), elements: map[string]*list.Element{}}
		b.tools.put(name, entry, b.MaxTraces)
	}
	if !b.firstDelivery(entry.signalIDs, signal) {
		return false
	}
	if newest, ok := entry.byServer[server]; ok && !atOrAfter(signal.DetectedAt, newest.DetectedAt) {
		return true // an older signal of the tool: the newer one holds
	}
	entry.byServer[server] = signal
	if element, ok := entry.elements[server]; ok {
		entry.order.MoveToBack(element)
	} else {
		entry.elements[server] = entry.order.PushBack(server)
		for entry.order.Len() > maxServersPerTool {
			oldest := entry.order.Front()
			entry.order.Remove(oldest)
			delete(entry.byServer, oldest.Value.(string))
			delete(entry.elements, oldest.Value.(string))
		}
	}
	return true
}

// Contained is the contain in force for tool on server (or one naming no server); a nil
// server is unknown: a contain of the tool on any server holds. Nil when none.
func (b *SignalBook) Contained(tool string, server *string) *Signal {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.contained(tool, server)
}

func (b *SignalBook) contained(tool string, server *string) *Signal {
	entry := b.tools.get(tool)
	if entry == nil {
		return nil
	}
	var candidates []*Signal
	if server == nil {
		for _, signal := range entry.byServer {
			candidates = append(candidates, signal)
		}
	} else {
		for _, name := range []string{*server, ""} {
			if signal, ok := entry.byServer[name]; ok {
				candidates = append(candidates, signal)
			}
		}
	}
	now := b.now()
	for _, signal := range candidates {
		if expires, ok := ParseDateTime(signal.ExpiresAt); signal.Kind == "kill" && ok && now.Before(expires) {
			return signal
		}
	}
	return nil
}

// CheckTool returns *ToolContained if tool (on server; nil: unknown) is contained, counted in
// ToolCallsRefused; an empty tool checks nothing.
func (b *SignalBook) CheckTool(tool string, server *string) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.checkTool(tool, server)
}

func (b *SignalBook) checkTool(tool string, server *string) error {
	if tool == "" || b.tools.len() == 0 {
		return nil
	}
	signal := b.contained(tool, server)
	if signal == nil {
		return nil
	}
	b.ToolCallsRefused++
	return newToolContained(signal)
}

// CheckScopes returns *AgentKilled if the conversation or the agent (that name, or a kill
// naming every agent of the service) is under a kill not yet expired nor released.
func (b *SignalBook) CheckScopes(scope CheckScope) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.checkScopes(scope)
}

func (b *SignalBook) checkScopes(scope CheckScope) error {
	if b.scopes.len() == 0 {
		return nil
	}
	var keys []string
	if scope.ConversationID != "" {
		keys = append(keys, scopeKey("conversation", scope.ConversationID, ""))
	}
	if scope.Agent != nil && scope.Agent.Service != "" {
		keys = append(keys, scopeKey("agent", scope.Agent.Service, scope.Agent.Name))
		if scope.Agent.Name != "" {
			keys = append(keys, scopeKey("agent", scope.Agent.Service, ""))
		}
	}
	now := b.now()
	for _, key := range keys {
		entry := b.scopes.get(key)
		if entry == nil {
			continue
		}
		if entry.kill == nil {
			continue
		}
		if expires, ok := ParseDateTime(entry.kill.ExpiresAt); ok && !now.Before(expires) {
			entry.kill = nil // its window freed: the scope goes on
			continue
		}
		b.scopes.touch(key)
		return &AgentKilled{Signal: entry.kill}
	}
	return nil
}

// CheckIn is Check for a trace of a conversation or agent: a kill of either stops it too; and
// for a call to scope.Tool: after the trace's kill or pause, a contained tool returns
// *ToolContained (a downgrade's message then waits for the next check).
func (b *SignalBook) CheckIn(traceID string, scope CheckScope) (string, error) {
	if err := b.CheckScopes(scope); err != nil {
		return "", err
	}
	message, _, err := b.checkCall(traceID, scope.Tool, scope.Server)
	return message, err
}

func newTraceSignals() *traceSignals { return &traceSignals{signalIDs: map[string]bool{}} }

// Deliver records signal for its trace; false when its id was already recorded.
func (b *SignalBook) Deliver(signal *Signal) bool {
	traceID := normalizeTraceID(signal.TraceID)
	b.mu.Lock()
	defer b.mu.Unlock()
	if scope := signalScope(signal); scope == "conversation" || scope == "agent" {
		return b.deliverScoped(signal)
	} else if scope == "tool" {
		return b.deliverTool(signal)
	}
	entry := b.killed[traceID]
	if entry == nil {
		entry = b.watched.get(traceID)
	}
	if entry == nil {
		entry = b.others.get(traceID)
		if entry == nil {
			entry = newTraceSignals()
			b.others.put(traceID, entry, b.MaxTraces)
		} else {
			b.others.touch(traceID)
		}
	}
	if !b.firstDelivery(entry.signalIDs, signal) {
		return false
	}
	if signal.Kind == "pause" {
		if entry.kill == nil {
			entry.pause = signal
		}
		return true
	}
	if signal.Kind == "release" || signal.Kind == "kill" {
		entry.pause = nil // the operator's answer to a pause
	}
	switch signal.Kind {
	case "release":
		entry.kill = nil
		if _, killed := b.killed[traceID]; killed {
			delete(b.killed, traceID)
			b.watched.put(traceID, entry, b.MaxTraces)
		}
	case "kill":
		if entry.kill == nil { // the first kill's reason is the one the agent sees
			entry.kill = signal
		}
		if b.watched.remove(traceID) != nil { // its agent checks it: keep it for good
			b.killed[traceID] = entry
		}
	default:
		message := fmt.Sprintf("spanguard: %s. Try a different approach or stop and report what you found.", signal.Reason)
		if signal.SystemMessage != nil {
			message = *signal.SystemMessage
		}
		// With its signal: the downgrade's span event names the decision (stop.go).
		entry.unread = append(entry.unread, unreadMessage{message, signal})
	}
	return true
}

// Check returns *AgentKilled if traceID is killed; else a downgrade's message not yet read, or "".
func (b *SignalBook) Check(traceID string) (string, error) {
	message, _, err := b.check(traceID)
	return message, err
}

// check is Check, with the downgrade whose message it returns (for its span event).
func (b *SignalBook) check(traceID string) (string, *Signal, error) {
	return b.checkCall(traceID, "", nil)
}

// checkCall is check for a call to tool (on server): after the trace's kill or pause, a
// contained tool returns *ToolContained.
func (b *SignalBook) checkCall(traceID, tool string, server *string) (string, *Signal, error) {
	id := normalizeTraceID(traceID)
	b.mu.Lock()
	defer b.mu.Unlock()
	entry := b.killed[id]
	if entry == nil {
		entry = b.watched.get(id)
		if entry != nil {
			b.watched.touch(id)
		} else {
			// From now on this process checks the trace: its signals are its agent's.
			entry = b.others.remove(id)
			if entry == nil {
				entry = newTraceSignals()
			}
			if entry.kill == nil {
				b.watched.put(id, entry, b.MaxTraces)
			}
		}
		if entry.kill != nil {
			b.watched.remove(id)
			b.killed[id] = entry
		}
	}
	if entry.pause != nil && entry.kill == nil {
		b.pauseOver(id, entry)
		if entry.pause != nil {
			return "", nil, newAgentPaused(entry.pause)
		}
	}
	if entry.kill != nil {
		return "", nil, &AgentKilled{Signal: entry.kill}
	}
	if err := b.checkTool(tool, server); err != nil {
		return "", nil, err
	}
	if len(entry.unread) > 0 {
		unread := entry.unread[0]
		entry.unread = entry.unread[1:]
		return unread.message, unread.signal, nil
	}
	return "", nil, nil
}

// Wait is Check, and while the trace is paused, blocks until an operator answers: a release
// returns (the agent goes on, with what Check then returns), a kill returns *AgentKilled;
// unanswered at the pause's pause_until, its fallback applies (kill: *AgentKilled; release:
// returns). Once ctx is done (a deadline, a cancel) it returns *AgentPaused again.
func (b *SignalBook) Wait(ctx context.Context, traceID string) (string, error) {
	for {
		b.mu.Lock()
		changed := b.changed // taken before the check: a delivery after it still wakes us
		b.mu.Unlock()
		message, err := b.Check(traceID)
		paused, isPaused := err.(*AgentPaused)
		if !isPaused {
			return message, err
		}
		if ctx.Err() != nil {
			return "", paused
		}
		left := min(b.untilDeadline(paused.Until), waitRecheck)
		timer := time.NewTimer(max(left, 0))
		select {
		case <-changed:
		case <-timer.C:
		case <-ctx.Done():
		}
		timer.Stop()
	}
}

func (b *SignalBook) now() time.Time {
	if b.Clock != nil {
		return b.Clock()
	}
	return time.Now()
}

// untilDeadline is how long until the RFC 3339 moment; 0 or less once it has come.
func (b *SignalBook) untilDeadline(moment string) time.Duration {
	at, ok := ParseDateTime(moment)
	if !ok {
		return 0
	}
	return at.Sub(b.now())
}

// pauseOver applies the policy's fallback to a pause past its pause_until with no answer
// (lock held).
func (b *SignalBook) pauseOver(traceID string, entry *traceSignals) {
	pause := entry.pause
	until := ""
	if pause.PauseUntil != nil {
		until = *pause.PauseUntil
	}
	if b.untilDeadline(until) > 0 {
		return
	}
	entry.pause = nil
	if pause.PauseFallback != nil && *pause.PauseFallback == "kill" {
		kill := *pause
		kill.Kind = "kill"
		kill.Reason = fmt.Sprintf("%s; paused with no answer by %s: the policy's fallback kills", pause.Reason, until)
		entry.kill = &kill
		b.watched.remove(traceID)
		b.killed[traceID] = entry
	}
}

// IsKilled says whether a kill is recorded for traceID.
func (b *SignalBook) IsKilled(traceID string) bool {
	id := normalizeTraceID(traceID)
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, ok := b.killed[id]; ok {
		return true
	}
	entry := b.watched.get(id)
	if entry == nil {
		entry = b.others.get(id)
	}
	return entry != nil && entry.kill != nil
}

// Forget drops everything about traceID (its agent is done with it).
func (b *SignalBook) Forget(traceID string) {
	id := normalizeTraceID(traceID)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.others.remove(id)
	b.watched.remove(id)
	delete(b.killed, id)
}

// Stats returns what Deliver counted: signals recorded and duplicates dropped.
func (b *SignalBook) Stats() (delivered, duplicates int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.Delivered, b.Duplicates
}
