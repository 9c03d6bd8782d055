package queue

// The session (type Session): a lease granted (or adopted) for a process,
// its life and its end (Close revokes, Orphan leaves the lease to expire),
// and the holds it ends with it; its keepalive, the loop that refreshes the
// lease, one KeepAliveOnce per beat through the client's Lease, and the
// local deadline each acknowledged beat moves (never later than the
// server's expiry: a beat's deadline counts from its send time); and what it
// reports (type Reports, at the end). The keys its primitives use, and its
// sweepers, are in its registry (registry.go). The package etcdsync's
// Session is this one's public face (its NewSession resolves the options,
// options.go, and calls Start).

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/reach"
)

// Session is a lease kept alive in the background. Every key a primitive
// writes is bound to the lease, so the keys vanish when the session ends.
//
// The session keeps a local deadline: the send time of the last keepalive
// the server acknowledged plus the TTL. The server cannot expire the lease
// before that instant plus the slack (WithSlack: by default the larger of 2s
// and a tenth of the TTL), so when keepalives stop getting through, Done
// closes before the server may hand the lock to someone else, even in a
// process that runs late by up to the slack.
type Session struct {
	client *clientv3.Client
	caps   *caps // what is learned of the client's servers (caps.go)
	id     clientv3.LeaseID
	ttl    time.Duration // granted TTL less the slack and the lock delay: sets the deadline and the keepalive pace
	slack  time.Duration // WithSlack: a part of the lease's TTL past the local deadline, for a late holder
	delay  time.Duration // WithLockDelay: the other part, after the slack
	// startRev is a revision no later than the session's start: every key
	// with the lease that this session creates has a later create revision,
	// and a key a restarted process resumes (WithLease) an earlier one.
	startRev int64

	ctx    context.Context
	cancel context.CancelCauseFunc
	unlink func() bool   // stops watching the parent context
	loop   chan struct{} // closed when the keepalive loop has returned
	check  chan struct{} // asks the keepalive loop for a beat now

	mu       sync.Mutex
	deadline time.Time      // local deadline, see above
	moved    chan struct{}  // closed when deadline next moves or the session ends (DeadlineMoved); nil until asked for
	watchers sync.WaitGroup // hold watchers and sweepers started by this session
	reg      registry       // the keys its primitives use (registry.go)

	closeOnce sync.Once
	closeErr  error

	rep Reports // WithLogger, WithMetrics; nil: none
}

// Start starts a session on client with the options o (resolved: see
// Options.Resolve): it grants or adopts the lease, then keeps it alive in
// the background (see etcdsync.NewSession).
func Start(client *clientv3.Client, o Options) (*Session, error) {
	// The session ends with a cause of its own when its parent context
	// ends: the client closed, or the WithContext context.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(o.Ctx))
	stop := context.AfterFunc(o.Ctx, func() {
		if o.Ctx == client.Ctx() {
			cancel(errClientClosedSession)
		} else {
			cancel(fmt.Errorf("%w: its context ended: %w", ErrSessionClosed, context.Cause(o.Ctx)))
		}
	})
	s := &Session{
		unlink: stop,
		client: client,
		caps:   capsOf(client),
		ctx:    ctx,
		cancel: cancel,
		loop:   make(chan struct{}),
		check:  make(chan struct{}, 1),
	}
	s.reg = registry{s: s, keys: make(map[string]keyUse), swept: make(map[string][]int64)}
	s.rep, s.slack, s.delay = o.Rep, o.Slack, o.Delay
	first, err := s.start(o)
	if err != nil {
		stop()
		cancel(err)
		return nil, err
	}
	if s.rep != nil {
		s.rep.SessionBegan(s)
	}
	go s.keepAlive(first)
	return s, nil
}

// start grants or adopts the lease and sets the first deadline. It returns
// when the first keepalive is due: a third of the TTL from now, or at once
// when an adopted lease has less than that left beyond it. Its calls are
// bounded by the first answer's bound (answerBound) and the TTL.
func (s *Session) start(o Options) (time.Time, error) {
	bound := min(answerBound(s.client), o.TTL)
	ctx, cancel := context.WithTimeoutCause(clientv3.WithRequireLeader(s.ctx), bound, Tag(fmt.Errorf("%w within %v", errNoAnswer, bound), context.DeadlineExceeded))
	defer cancel()
	var sent time.Time // of the call that answered: the deadline counts from it
	if o.LeaseID != clientv3.NoLease {
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseTimeToLiveResponse, error) {
			return s.client.TimeToLive(ctx, o.LeaseID, clientv3.WithAttachedKeys())
		})
		if err != nil {
			return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
		}
		if resp.TTL <= 0 {
			return sent, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: not found (expired, revoked, or never granted)", int64(o.LeaseID)), ErrSessionExpired)
		}
		// The server truncates the remaining TTL, so this is never late.
		granted := time.Duration(resp.GrantedTTL) * time.Second
		if !o.SlackOn {
			s.slack = defaultSlack(granted - o.Delay)
		}
		s.id, s.ttl, s.startRev = o.LeaseID, granted-s.beyond(), resp.Revision
		s.deadline = sent.Add(time.Duration(resp.TTL)*time.Second - s.beyond())
		if s.ttl < time.Second || !s.deadline.After(sent) {
			return sent, Tag(fmt.Errorf("etcdsync: adopt lease 0x%x: %ds left of a %ds TTL, within the slack %v and lock delay %v", int64(o.LeaseID), resp.TTL, resp.GrantedTTL, s.slack, o.Delay), ErrSessionExpired)
		}
		if len(resp.Keys) > 0 {
			// The header of TimeToLive is the serving member's revision,
			// which may lag behind the keys the lease has; a linearizable
			// read's is at least the revision of every create before it.
			get, err := s.client.Get(ctx, string(resp.Keys[0]), clientv3.WithCountOnly())
			if err != nil {
				return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.LeaseID)), err)
			}
			s.startRev = max(s.startRev, get.Header.Revision)
		}
	} else {
		resp, err := whenLed(ctx, &sent, func() (*clientv3.LeaseGrantResponse, error) {
			return s.client.Grant(ctx, int64((o.TTL+s.beyond())/time.Second))
		})
		if err != nil {
			return sent, s.unreachable(ctx, "grant lease", err)
		}
		s.id, s.ttl, s.startRev = resp.ID, time.Duration(resp.TTL)*time.Second-s.beyond(), resp.Revision
		s.deadline = sent.Add(s.ttl)
	}
	pace := s.ttl / 3
	return earliest(sent.Add(pace), s.deadline.Add(-pace)), nil
}

// whenLed calls f, and again after leaderPause while it fails because the
// cluster has no leader (an election under way, a member cut off from its
// peers), until ctx ends; *sent is the time of the last call. A grant whose
// reply was lost before a retry leaves a lease with no keys, which expires.
func whenLed[T any](ctx context.Context, sent *time.Time, f func() (T, error)) (T, error) {
	for {
		*sent = time.Now()
		v, err := f()
		if !errors.Is(err, rpctypes.ErrNoLeader) {
			return v, err
		}
		if sleep(ctx, leaderPause) != nil {
			return v, err
		}
	}
}

// leaderPause is the pause between NewSession's calls while the cluster has
// no leader.
const leaderPause = 100 * time.Millisecond

// unreachable describes a failed first call: what failed, the endpoints,
// and, when no answer came in time, what each endpoint does when dialled
// (refuses, or accepts and stays silent): a diagnostic on this failure path
// only, which dials their addresses and sends nothing to etcd (see
// internal/reach).
func (s *Session) unreachable(ctx context.Context, what string, err error) error {
	switch {
	case s.ctx.Err() != nil: // the WithContext context ended, or the client closed
		err = context.Cause(s.ctx)
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer) && errors.Is(err, rpctypes.ErrNoLeader):
		return fmt.Errorf("etcdsync: %s (endpoints %s): %w, and %w", what, strings.Join(s.client.Endpoints(), ","), err, context.Cause(ctx))
	case ctx.Err() != nil && errors.Is(context.Cause(ctx), errNoAnswer):
		return fmt.Errorf("etcdsync: %s: %w (%s)", what, context.Cause(ctx), reach.Each(s.client.Endpoints(), 200*time.Millisecond))
	}
	return fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(s.client.Endpoints(), ","), err)
}

// answerBound is how long NewSession waits for its first answer: the
// client's DialTimeout, or defaultAnswerBound when it has none.
func answerBound(cli *clientv3.Client) time.Duration {
	if d := dialTimeout(cli); d > 0 {
		return d
	}
	return defaultAnswerBound
}

// defaultAnswerBound is answerBound for a client with no DialTimeout.
const defaultAnswerBound = 3 * time.Second

// dialTimeout returns cli's Config.DialTimeout, or 0 when it has none or it
// cannot be read. etcd's client keeps its configuration in an unexported
// field (cfg, in every line from 3.5 to 3.7) and has no getter for it;
// reflect reads the field and changes nothing. A client line without it
// gets the default (TestNewSessionGivesUpWithinDialTimeout would fail).
func dialTimeout(cli *clientv3.Client) time.Duration {
	cfg := reflect.ValueOf(cli).Elem().FieldByName("cfg")
	if !cfg.IsValid() || cfg.Kind() != reflect.Struct {
		return 0
	}
	d := cfg.FieldByName("DialTimeout")
	if !d.IsValid() || d.Kind() != reflect.Int64 {
		return 0
	}
	return time.Duration(d.Int())
}

// ClosedClient returns an error wrapping ErrInvalidArgument when cli has
// been closed, else nil: a call on a closed client fails at once and sends
// nothing (etcd's client would retry it, printing warnings, until its
// context ends).
func ClosedClient(cli *clientv3.Client) error {
	if cli.Ctx().Err() != nil {
		return errClientClosed
	}
	return nil
}

// beyond is how long the lease outlives the local deadline: the slack, then
// the lock delay.
func (s *Session) beyond() time.Duration { return s.slack + s.delay }

// Client returns the etcd client the session uses.
func (s *Session) Client() *clientv3.Client { return s.client }

// Lease returns the session's lease ID.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// TTL returns how long the session lives past the send time of its last
// acknowledged keepalive: the lease's granted TTL, less the slack and the
// lock delay (WithSlack, WithLockDelay), which the lease has beyond it.
func (s *Session) TTL() time.Duration { return s.ttl }

// Slack returns how long the lease outlives the local deadline for a late
// holder (WithSlack; the lock delay comes on top of it).
func (s *Session) Slack() time.Duration { return s.slack }

// Ctx returns a context cancelled when the session ends; context.Cause tells
// why: an error wrapping ErrSessionClosed (Close, Orphan), ErrSessionExpired
// (lease gone, or lost contact past the local deadline), or the cause of the
// WithContext context.
func (s *Session) Ctx() context.Context { return s.ctx }

// Done returns a channel closed when the session ends (see Ctx).
func (s *Session) Done() <-chan struct{} { return s.ctx.Done() }

// Err returns nil while the session lives, else why it ended (see Ctx).
// A session whose client was closed has ended, with a cause wrapping
// ErrSessionClosed and ErrInvalidArgument.
func (s *Session) Err() error {
	if s.ctx.Err() == nil && s.client.Ctx().Err() != nil {
		s.cancel(errClientClosedSession) // as the session's watch of its parent context will
	}
	if s.ctx.Err() == nil {
		return nil
	}
	return context.Cause(s.ctx)
}

// Check is a health answer for a service that must not act without its
// session: nil while the session lives, else why not (as Err). It also
// answers ErrSessionExpired (with ErrLostContact) once the local deadline
// has passed, even before the keepalive loop has ended the session, so a
// late timer never makes it answer nil. It does not block and sends nothing.
func (s *Session) Check() error {
	if err := s.Err(); err != nil {
		return err
	}
	if d := s.Deadline(); !time.Now().Before(d) {
		return fmt.Errorf("%w (%w): the local deadline %v has passed", ErrSessionExpired, ErrLostContact, d.Format(time.RFC3339Nano))
	}
	return nil
}

// Orphan ends the session without revoking its lease: its keys stay until
// the lease expires on the server (for a hand-over to a process that adopts
// the lease with WithLease). It does not block on etcd; it is idempotent, and
// a Close after it changes nothing in etcd.
func (s *Session) Orphan() {
	s.closeOnce.Do(func() { s.end(fmt.Errorf("%w: orphaned", ErrSessionClosed)) })
	<-s.loop
	s.watchers.Wait()
}

// Close ends the session and revokes its lease, which deletes every key the
// session holds. It blocks for the revoke, bounded by the TTL (by a second
// once the session ended for lost contact); with the client closed it returns
// at once (the lease is left to expire). With WithLockDelay, a session that
// ended for lost contact is not revoked: its lease runs out the delay on the
// server. It is idempotent: later calls return the
// first call's result. After Orphan it changes nothing in etcd. A lease the
// server no longer has is not an error.
func (s *Session) Close() error {
	s.closeOnce.Do(func() {
		s.end(ErrSessionClosed)
		<-s.loop
		s.watchers.Wait()
		switch {
		case s.client.Ctx().Err() != nil:
			s.closeErr = fmt.Errorf("etcdsync: revoke lease 0x%x: client closed; the lease is left to expire", int64(s.id))
		case errors.Is(context.Cause(s.ctx), ErrSessionExpired) && !time.Now().Before(s.Deadline()) && s.delay > 0:
			// Lost contact with a lock delay: the lease runs out the
			// delay on the server (WithLockDelay); a revoke would end it.
		case errors.Is(context.Cause(s.ctx), ErrSessionExpired) && !time.Now().Before(s.Deadline()):
			// Lost contact: a revoke cannot beat the server's own expiry
			// by more than a round trip; still try, briefly.
			s.closeErr = s.revoke(time.Second)
		default:
			s.closeErr = s.revoke(s.ttl)
		}
	})
	<-s.loop
	s.watchers.Wait()
	return s.closeErr
}

func (s *Session) revoke(bound time.Duration) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(s.ctx), bound)
	defer cancel()
	_, err := s.client.Revoke(ctx, s.id)
	if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("etcdsync: revoke lease 0x%x: %w", int64(s.id), err)
	}
	return nil
}

// EndedErr is the error for a call on a session that has ended: why it
// ended, also matching ErrSessionExpired unless it was closed (Close,
// Orphan, its context or its client: ErrSessionClosed).
func (s *Session) EndedErr() error {
	cause := context.Cause(s.ctx)
	if errors.Is(cause, ErrSessionClosed) {
		return cause
	}
	return Tag(cause, ErrSessionExpired)
}

// checkLease asks for a keepalive now, so that a revoked lease ends the
// session within a round trip of a hold noticing its key deleted.
func (s *Session) checkLease() {
	select {
	case s.check <- struct{}{}:
	default:
	}
}

// end cancels the session under mu, so that goWatch never adds a goroutine
// after Close or Orphan started waiting for them.
func (s *Session) end(cause error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.cancel(cause)
}

// finishHolds ends the holds of a session that ended, with its cause, at
// once rather than when each is next looked at (so that a loss is reported
// when it happens).
func (s *Session) finishHolds() {
	var holds []*Hold
	s.reg.mu.Lock()
	for _, use := range s.reg.keys {
		if use.hold != nil {
			holds = append(holds, use.hold)
		}
	}
	s.reg.mu.Unlock()
	for _, h := range holds {
		h.finish(nil)
	}
}

// goWatch runs f in a goroutine that Close and Orphan wait for. It runs
// nothing and returns false when the session has ended.
func (s *Session) goWatch(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return false
	}
	s.watchers.Add(1)
	go func() {
		defer s.watchers.Done()
		f()
	}()
	return true
}

// Bound returns ctx ended also by the session's end, and its cancel.
func (s *Session) Bound(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// made reports whether kv is a key this session created: it has the
// session's lease and was created after the session began (a restarted
// process's key, WithLease, was created before).
func (s *Session) made(kv *mvccpb.KeyValue) bool {
	return clientv3.LeaseID(kv.Lease) == s.id && kv.CreateRevision > s.startRev
}

// reportEnd tells the session's end, if anyone listens.
func (s *Session) reportEnd() {
	if s.rep != nil {
		s.rep.SessionEnded(s, context.Cause(s.ctx))
	}
}

// keepAlive refreshes the lease until the session ends: each beat is one
// KeepAliveOnce through the client's Lease (so a wrapper, a namespace, an
// in-process client or a proxy sees it), run in a goroutine of its own and
// bounded by the TTL. Beats are paced from their send times, every TTL/3
// whatever the replies do, so on a slow link several may be in flight: while
// the server acknowledges a beat within the TTL of its sending the session
// lives. Each acknowledgement moves the local deadline to its beat's send
// time plus the TTL the server granted, less the slack and the lock delay
// (WithSlack, WithLockDelay);
// a beat knows its own send time, so
// replies may come in any order. The first beat goes at first. keepAlive
// owns the beats' goroutines (joined on return) and the end of the session
// by lost contact or a lease that vanished.
func (s *Session) keepAlive(first time.Time) {
	defer close(s.loop)
	defer s.reportEnd()
	defer s.stopMoving()
	defer s.finishHolds()
	defer s.unlink()
	pace := s.ttl / 3
	next := first
	replies := make(chan reply)
	bctx, stopBeats := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	var beats sync.WaitGroup
	defer beats.Wait()
	defer stopBeats()
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		deadline := s.Deadline()
		if late := time.Since(deadline); late >= 0 {
			if s.rep != nil {
				s.rep.ActedLate(s, late)
			}
			s.cancel(fmt.Errorf("%w (%w): no keepalive acknowledged within the TTL (%v) of its sending, seen %v after the deadline; the server may free its keys from %v after it", ErrSessionExpired, ErrLostContact, s.ttl, late.Round(time.Millisecond), s.beyond()))
			return
		}
		due := earliest(next, deadline)
		timer.Reset(time.Until(due))
		select {
		case <-s.ctx.Done():
			return
		case <-s.check:
			next = time.Now() // a hold lost its key: is the lease gone?
			continue
		case r := <-replies:
			switch {
			case errors.Is(r.err, rpctypes.ErrLeaseNotFound):
				s.cancel(fmt.Errorf("%w: lease 0x%x not found (expired or revoked)", ErrSessionExpired, int64(s.id)))
				return
			case r.err != nil: // try again after a pause, unless a beat is due sooner
				if s.rep != nil {
					s.rep.KeepaliveFailed(s, r.err)
				}
				next = earliest(next, time.Now().Add(min(retryPause, pace)))
			default:
				if s.rep != nil {
					s.rep.KeepaliveAcked(s, time.Since(r.sent))
				}
				s.extend(r.sent.Add(time.Duration(r.ttl)*time.Second - s.beyond()))
			}
			continue
		case <-timer.C:
			if s.rep != nil {
				s.rep.ActedLate(s, time.Since(due))
			}
		}
		if time.Now().Before(next) {
			continue
		}
		beats.Add(1)
		go func() {
			defer beats.Done()
			r := s.beat(bctx)
			select {
			case replies <- r:
			case <-bctx.Done():
			}
		}()
		next = time.Now().Add(pace)
	}
}

// beat sends one keepalive and waits for its reply, bounded by ctx and the
// TTL (a later reply could not extend the deadline).
func (s *Session) beat(ctx context.Context) reply {
	ctx, cancel := context.WithTimeout(ctx, s.ttl)
	defer cancel()
	sent := time.Now()
	resp, err := s.client.KeepAliveOnce(ctx, s.id)
	if err != nil {
		return reply{sent: sent, err: fmt.Errorf("etcdsync: keepalive: %w", err)}
	}
	return reply{sent: sent, ttl: resp.TTL}
}

func earliest(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// extend moves the local deadline to d if that is later.
func (s *Session) extend(d time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if d.After(s.deadline) {
		s.deadline = d
		s.stopMovingLocked()
	}
}

// stopMoving closes the channel DeadlineMoved handed out, if any: the
// session has ended.
func (s *Session) stopMoving() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.stopMovingLocked()
}

func (s *Session) stopMovingLocked() {
	if s.moved != nil {
		close(s.moved)
		s.moved = nil
	}
}

// reply is a beat's acknowledgement (its send time and the TTL the server
// granted), or why it failed.
type reply struct {
	sent time.Time
	ttl  int64
	err  error
}

// Deadline returns the session's local deadline: the send time of the last
// acknowledged keepalive plus the TTL. The server cannot expire the lease
// before it.
func (s *Session) Deadline() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

// DeadlineMoved returns a channel that is closed when the local deadline
// (see Deadline) next moves, after an acknowledged keepalive, or when the
// session ends; after the end the channel is closed already. It does not
// block. Take the channel before reading Deadline, so that no move is
// missed: a program that hands the deadline on (to a child process, a
// device, a worker with a hard stop) loops
//
//	for s.Err() == nil {
//		moved := s.DeadlineMoved()
//		handOn(s.Deadline())
//		<-moved
//	}
func (s *Session) DeadlineMoved() <-chan struct{} {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return Closed
	}
	if s.moved == nil {
		s.moved = make(chan struct{})
	}
	return s.moved
}

// retryPause is the pause between failed keepalives (bounded by TTL/3).
const retryPause = 500 * time.Millisecond

// Reports receives a session's state changes, as they happen. Its methods
// must not block.
type Reports interface {
	SessionBegan(s *Session)
	// SessionEnded is told once the session's holds have ended.
	SessionEnded(s *Session, cause error)
	KeepaliveFailed(s *Session, err error)
	KeepaliveAcked(s *Session, rtt time.Duration)
	// ActedLate is told, each time the keepalive loop's timer fires (a beat
	// or the deadline due), how long after it was due the loop ran: a
	// process short of CPU runs late.
	ActedLate(s *Session, late time.Duration)
	AcquireFailed(sl *Slot, err error)
	// HoldBegan is told when an acquire hands out h, after wait; a hold
	// joined (counted) again is told again.
	HoldBegan(h *Hold, wait time.Duration)
	// HoldEnded is told when h ended with cause (released or lost), before
	// its Done closes.
	HoldEnded(h *Hold, cause error)
}
