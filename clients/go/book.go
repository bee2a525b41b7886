package killswitch

import (
	"container/list"
	"context"
	"fmt"
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
	return fmt.Sprintf("spanguard killed trace %s: %s", k.Signal.TraceID, k.Signal.Reason)
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
	unread    []string
	pause     *Signal // waiting for an operator (see AgentPaused)
}

// lru is a map that remembers the order entries were last touched.
type lru struct {
	items map[string]*list.Element
	order *list.List // front: least recently touched
}

type lruItem struct {
	traceID string
	entry   *traceSignals
}

func newLRU() *lru { return &lru{items: map[string]*list.Element{}, order: list.New()} }

func (l *lru) get(traceID string) *traceSignals {
	if element, ok := l.items[traceID]; ok {
		return element.Value.(*lruItem).entry
	}
	return nil
}

func (l *lru) touch(traceID string) {
	if element, ok := l.items[traceID]; ok {
		l.order.MoveToBack(element)
	}
}

func (l *lru) put(traceID string, entry *traceSignals, limit int) {
	l.items[traceID] = l.order.PushBack(&lruItem{traceID, entry})
	for l.order.Len() > limit {
		oldest := l.order.Front()
		l.order.Remove(oldest)
		delete(l.items, oldest.Value.(*lruItem).traceID)
	}
}

func (l *lru) remove(traceID string) *traceSignals {
	element, ok := l.items[traceID]
	if !ok {
		return nil
	}
	l.order.Remove(element)
	delete(l.items, traceID)
	return element.Value.(*lruItem).entry
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
	others     *lru
	watched    *lru
	killed     map[string]*traceSignals
	Delivered  int
	Duplicates int
}

// NewSignalBook makes an empty book; maxTraces <= 0 means DefaultMaxTraces.
func NewSignalBook(maxTraces int) *SignalBook {
	if maxTraces <= 0 {
		maxTraces = DefaultMaxTraces
	}
	return &SignalBook{
		MaxTraces: maxTraces, others: newLRU(), watched: newLRU(), killed: map[string]*traceSignals{},
		changed: make(chan struct{}),
	}
}

func newTraceSignals() *traceSignals { return &traceSignals{signalIDs: map[string]bool{}} }

// Deliver records signal for its trace; false when its id was already recorded.
func (b *SignalBook) Deliver(signal *Signal) bool {
	traceID := normalizeTraceID(signal.TraceID)
	b.mu.Lock()
	defer b.mu.Unlock()
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
	if entry.signalIDs[signal.SignalID] {
		b.Duplicates++
		return false
	}
	entry.signalIDs[signal.SignalID] = true
	b.Delivered++
	close(b.changed)
	b.changed = make(chan struct{})
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
		entry.unread = append(entry.unread, message)
	}
	return true
}

// Check returns *AgentKilled if traceID is killed; else a downgrade's message not yet read, or "".
func (b *SignalBook) Check(traceID string) (string, error) {
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
			return "", newAgentPaused(entry.pause)
		}
	}
	if entry.kill != nil {
		return "", &AgentKilled{Signal: entry.kill}
	}
	if len(entry.unread) > 0 {
		message := entry.unread[0]
		entry.unread = entry.unread[1:]
		return message, nil
	}
	return "", nil
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
