package killswitch

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// The shared kill-signal vectors (schemas/testdata/kill-signal-vectors.json): every killswitch
// must reach each verdict, so a record no two languages would read alike is decided alike.
type vectorFile struct {
	Now     string            `json:"now"`
	Keys    map[string]string `json:"keys"`
	KeyIDs  map[string]string `json:"key_ids"`
	Vectors []struct {
		Name        string             `json:"name"`
		Keys        []string           `json:"keys"`
		Value       *string            `json:"value"`
		ValueBase64 *string            `json:"value_base64"`
		Verdict     string             `json:"verdict"`
		Signal      map[string]*string `json:"signal"`
	} `json:"vectors"`
	Sequences []struct {
		Name    string            `json:"name"`
		Signals map[string]string `json:"signals"`
		Steps   []struct {
			Deliver string `json:"deliver"`
			New     bool   `json:"new"`
			Check   string `json:"check"`
			Expect  string `json:"expect"`
		} `json:"steps"`
	} `json:"sequences"`
}

func loadVectors(t *testing.T) vectorFile {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("..", "..", "schemas", "testdata", "kill-signal-vectors.json"))
	if err != nil {
		t.Fatal(err)
	}
	var file vectorFile
	if err := json.Unmarshal(data, &file); err != nil {
		t.Fatal(err)
	}
	return file
}

func (f vectorFile) ring(t *testing.T, names []string) map[string][]byte {
	keys := make([][]byte, 0, len(names))
	for _, name := range names {
		keys = append(keys, []byte(f.Keys[name]))
	}
	ring, err := Keyring(keys...)
	if err != nil {
		t.Fatal(err)
	}
	return ring
}

func TestKeyIDs(t *testing.T) {
	file := loadVectors(t)
	for name, key := range file.Keys {
		if got := KeyID([]byte(key)); got != file.KeyIDs[name] {
			t.Errorf("%s: key id %s, want %s", name, got, file.KeyIDs[name])
		}
	}
}

func TestVectors(t *testing.T) {
	file := loadVectors(t)
	now, ok := ParseDateTime(file.Now)
	if !ok {
		t.Fatal("bad now")
	}
	for _, vector := range file.Vectors {
		t.Run(vector.Name, func(t *testing.T) {
			var value []byte
			if vector.ValueBase64 != nil {
				decoded, err := base64.StdEncoding.DecodeString(*vector.ValueBase64)
				if err != nil {
					t.Fatal(err)
				}
				value = decoded
			} else {
				// encoding/json turns a lone surrogate escape into U+FFFD: the vectors hold none
				// in `value` itself (their records spell surrogates as escapes inside the text).
				value = []byte(*vector.Value)
			}
			var keys map[string][]byte
			if vector.Keys != nil {
				keys = file.ring(t, vector.Keys)
			}
			signal, err := ReadSignal(value, keys, now)
			verdict := "obey"
			if err != nil {
				var badSignal *BadSignal
				if !errors.As(err, &badSignal) {
					t.Fatalf("not a BadSignal: %v", err)
				}
				verdict = badSignal.Kind
			}
			if verdict != vector.Verdict {
				t.Fatalf("verdict %s (%v), want %s", verdict, err, vector.Verdict)
			}
			if signal == nil {
				return
			}
			got := map[string]*string{
				"kind": &signal.Kind, "trace_id": &signal.TraceID, "signal_id": &signal.SignalID,
				"rule": &signal.Rule, "reason": &signal.Reason, "system_message": signal.SystemMessage,
				"expires_at": &signal.ExpiresAt,
			}
			for name, want := range vector.Signal {
				if (want == nil) != (got[name] == nil) || want != nil && *want != *got[name] {
					t.Errorf("%s: got %v, want %v", name, deref(got[name]), deref(want))
				}
			}
		})
	}
}

func deref(s *string) any {
	if s == nil {
		return nil
	}
	return *s
}

func TestSequences(t *testing.T) {
	file := loadVectors(t)
	now, _ := ParseDateTime(file.Now)
	keys := file.ring(t, []string{"current"})
	for _, sequence := range file.Sequences {
		t.Run(sequence.Name, func(t *testing.T) {
			book := NewSignalBook(0)
			for i, step := range sequence.Steps {
				if step.Deliver != "" {
					signal, err := ReadSignal([]byte(sequence.Signals[step.Deliver]), keys, now)
					if err != nil {
						t.Fatalf("step %d: %v", i, err)
					}
					if got := book.Deliver(signal); got != step.New {
						t.Fatalf("step %d: deliver %s returned %v", i, step.Deliver, got)
					}
					continue
				}
				message, err := book.Check(step.Check)
				var killed *AgentKilled
				switch {
				case step.Expect == "killed":
					if !errors.As(err, &killed) {
						t.Fatalf("step %d: not killed (%q, %v)", i, message, err)
					}
				case err != nil:
					t.Fatalf("step %d: %v", i, err)
				case step.Expect == "pass" && message != "":
					t.Fatalf("step %d: message %q", i, message)
				case step.Expect != "pass" && message != step.Expect:
					t.Fatalf("step %d: message %q, want %q", i, message, step.Expect)
				}
			}
		})
	}
}

func TestExpiryIsExactToTheMicrosecond(t *testing.T) {
	expires, _ := ParseDateTime("2026-06-01T12:00:00.000001Z")
	if !time.Date(2026, 6, 1, 12, 0, 0, 0, time.UTC).Before(expires) {
		t.Fatal("a microsecond before expiry must still be valid")
	}
}
