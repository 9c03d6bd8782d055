package etcdsync

// The session's reports without a server (the keepalive loop's pacing is
// tested in internal/queue, pacing_test.go): a Lease that answers as the
// test says, under testing/synctest's clock.

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// firstFailsLease is a Lease whose first KeepAliveOnce fails and whose later
// ones answer at once with the TTL Grant granted. Other calls succeed at
// once.
type firstFailsLease struct {
	clientv3.Lease // not called

	mu      sync.Mutex
	granted int64
	beats   int
}

func (l *firstFailsLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.granted = ttl
	return &clientv3.LeaseGrantResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: 0x1a, TTL: ttl}, nil
}

func (l *firstFailsLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	return &clientv3.LeaseRevokeResponse{Header: &pb.ResponseHeader{Revision: 1}}, nil
}

func (l *firstFailsLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.beats++; l.beats == 1 {
		return nil, errors.New("unavailable")
	}
	return &clientv3.LeaseKeepAliveResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: id, TTL: l.granted}, nil
}

func (l *firstFailsLease) Close() error { return nil }

// slowHandler is a slog handler that sleeps for pause (the bubble's clock)
// on each record with message slowOn, holding up the keepalive loop that
// logs it, and keeps the records of the session's lateness.
type slowHandler struct {
	slowOn string
	pause  time.Duration
	mu     sync.Mutex
	late   []time.Duration
}

func (h *slowHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *slowHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *slowHandler) WithGroup(string) slog.Handler            { return h }
func (h *slowHandler) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.slowOn {
		time.Sleep(h.pause)
	}
	if r.Message == "etcdsync: session ran late" && r.Level == slog.LevelWarn {
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == "late" {
				h.mu.Lock()
				h.late = append(h.late, a.Value.Duration())
				h.mu.Unlock()
			}
			return true
		})
	}
	return nil
}

// A keepalive loop held up past a beat's due time says how late it ran: a
// warning once that is past half the slack (the first beat fails at TTL/3,
// and the loop is held up 1.8 s logging it, so the next beat, due at 2TTL/3,
// goes 0.8 s late; the slack of 1 s warns past 0.5 s). The session lives.
func TestPacingLateLoopWarnsPastHalfTheSlack(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		cli := clientv3.NewCtxClient(context.Background())
		cli.Lease = &firstFailsLease{}
		h := &slowHandler{slowOn: "etcdsync: keepalive stream failed, retrying", pause: 1800 * time.Millisecond}
		s, err := NewSession(cli, WithTTL(3*time.Second), WithSlack(time.Second), WithLogger(slog.New(h)))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { s.Close(); cli.Close() })
		time.Sleep(3 * time.Second)
		if err := s.Err(); err != nil {
			t.Fatalf("the session ended: %v", err)
		}
		h.mu.Lock()
		defer h.mu.Unlock()
		if len(h.late) != 1 || h.late[0] != 800*time.Millisecond {
			t.Fatalf("lateness warned: %v, want one of 800ms", h.late)
		}
	})
}
