package queue

// Keepalive pacing without a server: the session's loop runs on a Lease that
// answers as a test says, under testing/synctest's clock, so every instant
// is exact. The beats go every TTL/3; the local deadline is the send time of
// the last acknowledged beat plus the TTL; slow replies keep the session;
// no acknowledgement ends it at the deadline; a failed beat is tried again
// after retryPause.

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// paceLease is a Lease whose KeepAliveOnce answers after delay (or never,
// with delay < 0) with the TTL Grant granted, fails while fail says so, and
// records when each beat was sent. Other calls succeed at once.
type paceLease struct {
	clientv3.Lease // not called
	delay          time.Duration
	delayOf        func(n int) time.Duration // the n-th beat's delay (from 1), if set
	fail           func(n int) error         // the n-th beat's error (from 1), or nil

	mu      sync.Mutex
	granted int64
	sends   []time.Time
}

func (l *paceLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	l.mu.Lock()
	l.granted = ttl
	l.mu.Unlock()
	return &clientv3.LeaseGrantResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: 0x1a, TTL: ttl}, nil
}

func (l *paceLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	return &clientv3.LeaseRevokeResponse{Header: &pb.ResponseHeader{Revision: 1}}, nil
}

func (l *paceLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	l.mu.Lock()
	l.sends = append(l.sends, time.Now())
	n, ttl := len(l.sends), l.granted
	l.mu.Unlock()
	if l.fail != nil {
		if err := l.fail(n); err != nil {
			return nil, err
		}
	}
	delay := l.delay
	if l.delayOf != nil {
		delay = l.delayOf(n)
	}
	if delay < 0 {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	select {
	case <-time.After(delay):
		return &clientv3.LeaseKeepAliveResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: id, TTL: ttl}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (l *paceLease) Close() error { return nil }

func (l *paceLease) sent() []time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]time.Time{}, l.sends...)
}

// option sets Options as an option of etcdsync.NewSession does.
type option func(*Options)

func withSlack(d time.Duration) option     { return func(o *Options) { o.Slack, o.SlackOn = d, true } }
func withLockDelay(d time.Duration) option { return func(o *Options) { o.Delay = d } }

// startTTL starts a session on cli as etcdsync.NewSession does given
// WithTTL(ttl) and opts.
func startTTL(cli *clientv3.Client, ttl time.Duration, opts ...option) (*Session, error) {
	o := Options{TTL: ttl, TTLSet: true}
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.Resolve(cli); err != nil {
		return nil, err
	}
	return Start(cli, o)
}

// paceSession starts a session of ttl on l, inside the synctest bubble.
func paceSession(t *testing.T, l *paceLease, ttl time.Duration, opts ...option) *Session {
	t.Helper()
	cli := clientv3.NewCtxClient(context.Background())
	cli.Lease = l
	s, err := startTTL(cli, ttl, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close(); cli.Close() })
	return s
}

// gaps returns the intervals between successive times.
func gaps(ts []time.Time) []time.Duration {
	var out []time.Duration
	for i := 1; i < len(ts); i++ {
		out = append(out, ts[i].Sub(ts[i-1]))
	}
	return out
}

func TestPacingBeatsEveryThirdOfTTL(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &paceLease{delay: 10 * time.Millisecond}
		start := time.Now()
		s := paceSession(t, l, 3*time.Second)
		time.Sleep(10*time.Second + 500*time.Millisecond)
		sends := l.sent()
		if len(sends) != 10 {
			t.Fatalf("beats in 10.5 s at a TTL of 3 s: %d, want 10", len(sends))
		}
		if sends[0].Sub(start) != time.Second {
			t.Errorf("first beat after %v, want TTL/3", sends[0].Sub(start))
		}
		for i, g := range gaps(sends) {
			if g != time.Second {
				t.Errorf("gap %d: %v, want TTL/3", i, g)
			}
		}
		if want := sends[len(sends)-1].Add(3 * time.Second); !s.Deadline().Equal(want) {
			t.Errorf("deadline %v after start, want the last beat's send time plus the TTL (%v)", s.Deadline().Sub(start), want.Sub(start))
		}
	})
}

func TestPacingSlowRepliesKeepTheSession(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		// Each reply takes TTL/2: beats overlap, and each moves the
		// deadline to its own send time plus the TTL.
		l := &paceLease{delay: 1500 * time.Millisecond}
		start := time.Now()
		s := paceSession(t, l, 3*time.Second)
		time.Sleep(12*time.Second + 250*time.Millisecond)
		if err := s.Err(); err != nil {
			t.Fatalf("a session whose beats are acknowledged within the TTL ended: %v", err)
		}
		var acked time.Time // the last beat whose reply has come
		for _, sent := range l.sent() {
			if !sent.Add(l.delay).After(time.Now()) {
				acked = sent
			}
		}
		if want := acked.Add(3 * time.Second); !s.Deadline().Equal(want) {
			t.Errorf("deadline %v after start, want the last acknowledged beat's send time plus the TTL (%v)", s.Deadline().Sub(start), want.Sub(start))
		}
	})
}

// The lease is granted for the TTL plus the slack (by default the larger of
// 2 s and TTL/10, in whole seconds) plus the lock delay, while the local
// deadline and the pace keep to the TTL: the server frees the keys at least
// the slack after the holder is told.
func TestPacingSlackIsGrantedBeyondTheDeadline(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ttl     time.Duration
		opts    []option
		granted int64
	}{
		{"default", 3 * time.Second, nil, 5},
		{"a tenth of a long TTL", 60 * time.Second, nil, 66},
		{"a tenth rounded up", 25 * time.Second, nil, 28},
		{"off", 3 * time.Second, []option{withSlack(0)}, 3},
		{"rounded up", 3 * time.Second, []option{withSlack(1500 * time.Millisecond)}, 5},
		{"with a lock delay", 3 * time.Second, []option{withLockDelay(2 * time.Second)}, 7},
	} {
		t.Run(tc.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				l := &paceLease{delay: 10 * time.Millisecond}
				s := paceSession(t, l, tc.ttl, tc.opts...)
				if l.granted != tc.granted {
					t.Errorf("lease granted for %ds, want %ds", l.granted, tc.granted)
				}
				if s.TTL() != tc.ttl {
					t.Errorf("TTL %v, want %v", s.TTL(), tc.ttl)
				}
				time.Sleep(tc.ttl/3 + 50*time.Millisecond)
				sends := l.sent()
				if len(sends) != 1 || !s.Deadline().Equal(sends[0].Add(tc.ttl)) {
					t.Errorf("beats %v, deadline %v: want one beat at TTL/3 and the deadline its send time plus the TTL", sends, s.Deadline())
				}
			})
		})
	}
}

func TestPacingNoAcknowledgementEndsAtTheDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &paceLease{delay: -1}
		start := time.Now()
		s := paceSession(t, l, 3*time.Second)
		<-s.Done()
		if got := time.Since(start); got != 3*time.Second {
			t.Errorf("ended after %v, want the TTL from the grant's send time", got)
		}
		if err := s.Err(); !errors.Is(err, ErrLostContact) || !errors.Is(err, ErrSessionExpired) {
			t.Errorf("cause %v, want ErrLostContact and ErrSessionExpired", err)
		}
		sends := l.sent()
		if len(sends) < 2 || sends[0].Sub(start) != time.Second || sends[1].Sub(start) != 2*time.Second {
			t.Errorf("beats sent at %v, want at TTL/3 and 2TTL/3 (unanswered beats do not change the pace)", sends)
		}
	})
}

func TestPacingFailedBeatTriedAgainAfterRetryPause(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &paceLease{delay: 0, fail: func(n int) error {
			if n == 1 || n == 2 {
				return errors.New("unavailable")
			}
			return nil
		}}
		paceSession(t, l, 3*time.Second)
		time.Sleep(2500 * time.Millisecond)
		sends := l.sent()
		if len(sends) < 3 {
			t.Fatalf("beats: %d, want at least 3", len(sends))
		}
		for i, g := range gaps(sends[:3]) {
			if g != retryPause {
				t.Errorf("gap %d after a failed beat: %v, want retryPause (%v)", i, g, retryPause)
			}
		}
	})
}

func TestPacingLeaseNotFoundEndsAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := &paceLease{fail: func(int) error { return rpctypes.ErrLeaseNotFound }}
		start := time.Now()
		s := paceSession(t, l, 3*time.Second)
		<-s.Done()
		if got := time.Since(start); got != time.Second {
			t.Errorf("ended after %v, want at the first beat (TTL/3)", got)
		}
		if err := s.Err(); !errors.Is(err, ErrSessionExpired) || errors.Is(err, ErrLostContact) {
			t.Errorf("cause %v, want ErrSessionExpired without ErrLostContact", err)
		}
	})
}

// boundLease is a paceLease that also counts the beats in flight and keeps
// the send time of each acknowledged one.
type boundLease struct {
	paceLease
	inFlight, maxInFlight int
	acked                 []time.Time
}

func (l *boundLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	sent := time.Now()
	l.mu.Lock()
	l.inFlight++
	l.maxInFlight = max(l.maxInFlight, l.inFlight)
	l.mu.Unlock()
	resp, err := l.paceLease.KeepAliveOnce(ctx, id)
	l.mu.Lock()
	l.inFlight--
	if err == nil {
		l.acked = append(l.acked, sent)
	}
	l.mu.Unlock()
	return resp, err
}

// Whatever the replies do (random delays up to the TTL and past it, the
// link slowing down and speeding up), the session ends no later than the
// earliest moment the server may expire the lease (the latest acknowledged
// beat's send time plus the TTL granted), the local deadline is never
// later than that, and the beats in flight stay bounded (each is bounded by
// the TTL, and they go every TTL/3).
func TestPacingRandomRepliesNeverOutliveTheLease(t *testing.T) {
	for seed := range uint64(20) {
		t.Run(strconv.FormatUint(seed, 10), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				const ttl = 3 * time.Second
				rng := rand.New(rand.NewPCG(seed, 1))
				var mu sync.Mutex
				l := &boundLease{}
				l.delayOf = func(n int) time.Duration {
					mu.Lock()
					defer mu.Unlock()
					switch p := rng.IntN(100); {
					case p < 2:
						return -1 // never answered
					case p < 40:
						return time.Duration(rng.Int64N(int64(ttl / 10)))
					default:
						return time.Duration(rng.Int64N(int64(ttl * 95 / 100)))
					}
				}
				cli := clientv3.NewCtxClient(context.Background())
				cli.Lease = l
				s, err := startTTL(cli, ttl, withSlack(0))
				if err != nil {
					t.Fatal(err)
				}
				defer func() { s.Close(); cli.Close() }()
				acked := func() int {
					l.mu.Lock()
					defer l.mu.Unlock()
					return len(l.acked)
				}
				bound := func() time.Time {
					l.mu.Lock()
					defer l.mu.Unlock()
					var latest time.Time
					for _, a := range l.acked {
						if a.After(latest) {
							latest = a
						}
					}
					return latest.Add(time.Duration(l.granted) * time.Second)
				}
				for range 600 { // 60 s, checked every 100 ms
					if d := s.Deadline(); acked() > 0 && d.After(bound()) {
						t.Fatalf("deadline %v past the earliest expiry the server may make %v", d, bound())
					}
					select {
					case <-s.Done():
					case <-time.After(100 * time.Millisecond):
						continue
					}
					break
				}
				if s.Err() != nil && acked() > 0 && time.Now().After(bound()) {
					t.Errorf("session ended at %v, past the earliest expiry the server may make (%v)", time.Now(), bound())
				}
				l.mu.Lock()
				defer l.mu.Unlock()
				t.Logf("beats %d, acknowledged %d, at most %d in flight, ended: %v", len(l.sends), len(l.acked), l.maxInFlight, s.Err() != nil)
				if l.maxInFlight > 4 {
					t.Errorf("beats in flight at once: %d, want at most TTL/(TTL/3)+1", l.maxInFlight)
				}
			})
		})
	}
}

// loadedLeases is a server whose keepalive replies take c for each beat any
// session sent in the second before (a leader whose latency grows with the
// rate of keepalives it serves: each KeepAliveOnce is a gRPC stream of its
// own). lease returns a Lease of it for one session.
type loadedLeases struct {
	c     time.Duration
	mu    sync.Mutex
	sends []time.Time
}

type loadedLease struct {
	clientv3.Lease // not called
	srv            *loadedLeases
}

func (l loadedLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	return &clientv3.LeaseGrantResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: 0x1a, TTL: ttl}, nil
}

func (l loadedLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	return &clientv3.LeaseRevokeResponse{Header: &pb.ResponseHeader{Revision: 1}}, nil
}

func (l loadedLease) Close() error { return nil }

func (l loadedLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	now := time.Now()
	l.srv.mu.Lock()
	l.srv.sends = append(l.srv.sends, now)
	n := 0
	for _, s := range l.srv.sends {
		if now.Sub(s) < time.Second {
			n++
		}
	}
	l.srv.mu.Unlock()
	select {
	case <-time.After(time.Duration(n) * l.srv.c):
		return &clientv3.LeaseKeepAliveResponse{ResponseHeader: &pb.ResponseHeader{Revision: 1}, ID: id, TTL: 3}, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Ten sessions of a 3 s TTL on a server whose replies slow down with the
// rate of keepalives (150 ms per beat in the last second). At a pace of
// TTL/3 the load settles: ten beats a second, replies in 1.5 s, within the
// 2 s a beat has (TTL less the pace), and every session lives. A pace that
// shortens on slow replies (tried and withdrawn, 2026-11-27) answered them
// with more beats (pace 0.75 s, so 13 a second, replies in 2 s, pace 0.5 s,
// 20 a second, replies in 3 s), and every session was lost.
func TestPacingLoadedServerKeepsTheSessions(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		srv := &loadedLeases{c: 150 * time.Millisecond}
		var sessions []*Session
		for i := range 10 {
			cli := clientv3.NewCtxClient(context.Background())
			cli.Lease = loadedLease{srv: srv}
			s, err := startTTL(cli, 3*time.Second, withSlack(0))
			if err != nil {
				t.Fatal(err)
			}
			defer func() { s.Close(); cli.Close() }()
			sessions = append(sessions, s)
			time.Sleep(100 * time.Millisecond * time.Duration(min(i, 1))) // spread over a second
		}
		time.Sleep(60 * time.Second)
		lost := 0
		for _, s := range sessions {
			if s.Err() != nil {
				lost++
			}
		}
		srv.mu.Lock()
		defer srv.mu.Unlock()
		if lost > 0 {
			t.Errorf("%d of 10 sessions lost on a server that keeps them all at a pace of TTL/3 (beats sent: %d in 60 s, %d at that pace)", lost, len(srv.sends), 10*60)
		}
	})
}
