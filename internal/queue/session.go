package queue

// The session (type Session): a lease granted (or adopted) for a process
// (start.go), its life and its end (Close revokes, Orphan leaves the lease
// to expire), the holds it ends with it, the goroutines it owns and joins
// (watchers, waits' streams and their reapers; counted in inflight.go, as
// the Runs under its holds Close waits for), and what it reports (type
// Reports, at the end). Its keepalive and local deadline are in
// keepalive.go (type keepalive); the keys its primitives use, and its
// sweepers, in its registry (registry.go). The package etcdsync's Session is this one's
// public face (its NewSession resolves the options, options.go, and calls
// Start).

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
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
	unlink func() bool // stops watching the parent context
	ka     *keepalive  // the keepalive loop and the local deadline (keepalive.go)

	mu       sync.Mutex     // end and enter: no watcher counted once Close or Orphan waits
	watchers sync.WaitGroup // hold watchers, sweepers and waits' streams of this session (enter)
	// reapers close the streams waits may have left open (goReap), under
	// reap, which the client's end and Orphan cancel.
	reapers  inFlight
	reap     context.Context
	stopReap context.CancelFunc
	// runs counts the Runs whose fn may be running under a hold of this
	// session (BeginRun): Close revokes only once they returned.
	runs inFlight
	reg  registry // the keys its primitives use (registry.go)

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
	}
	s.reap, s.stopReap = context.WithCancel(client.Ctx())
	s.reg = registry{s: s, keys: make(map[string]keyUse), swept: make(map[string][]int64)}
	s.rep, s.delay = o.Rep, o.Delay
	l, err := start(ctx, client, o)
	if err != nil {
		stop()
		cancel(err)
		s.stopReap()
		return nil, err
	}
	s.id, s.ttl, s.slack, s.startRev = l.id, l.ttl, l.slack, l.startRev
	s.ka = newKeepalive(l.deadline)
	if s.rep != nil {
		s.rep.SessionBegan(s)
	}
	go s.ka.run(s, l.first)
	return s, nil
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

// Deadline returns the session's local deadline: the send time of the last
// acknowledged keepalive plus the TTL. The server cannot expire the lease
// before it.
func (s *Session) Deadline() time.Time { return s.ka.at() }

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
	if s.ctx.Err() != nil {
		return Closed
	}
	return s.ka.nextMove()
}

// Orphan ends the session without revoking its lease: its keys stay until
// the lease expires on the server (for a hand-over to a process that adopts
// the lease with WithLease). It does not block on etcd: it waits for the
// session's goroutines, and stops the closing of its waits' streams (a
// stream a wait left open then stays until the client closes). It is
// idempotent, and a Close after it changes nothing in etcd.
func (s *Session) Orphan() {
	s.closeOnce.Do(func() { s.end(fmt.Errorf("%w: orphaned", ErrSessionClosed)) })
	s.join()
	s.stopReap()
	s.reapers.wait(context.Background()) // prompt: reap is cancelled
}

// Close ends the session and revokes its lease, which deletes every key the
// session holds; after lost contact, once the Runs under its holds returned
// (waitRuns). It blocks for the revoke, bounded by the TTL, also after
// lost contact: a cluster whose leader moves re-arms every lease, so the
// server's own expiry may come much later than the session's deadline, and
// the client retries the revoke through leader changes. With the client
// closed it returns at once (the lease is left to expire). With
// WithLockDelay, a session that ended for lost contact is not revoked: its
// lease runs out the delay on the server. After a revoke that was answered
// it also waits, within the same bound, for the closing of the gRPC
// streams its waits may have left open (goReap); otherwise those close
// when the link is back, or with the client.
// It is idempotent: later calls return the first call's result. After
// Orphan it changes nothing in etcd. A lease the server no longer has is
// not an error.
func (s *Session) Close() error {
	s.closeOnce.Do(func() {
		// Closed past the local deadline before the keepalive loop ended
		// the session (a loop running late; Check answers ErrLostContact
		// from the deadline on): contact was lost all the same.
		late := s.ctx.Err() == nil && !time.Now().Before(s.Deadline())
		s.end(ErrSessionClosed)
		<-s.ka.loop
		s.watchers.Wait()
		lost := late || errors.Is(context.Cause(s.ctx), ErrLostContact)
		switch {
		case s.client.Ctx().Err() != nil:
			s.closeErr = fmt.Errorf("etcdsync: revoke lease 0x%x: client closed; the lease is left to expire", int64(s.id))
		case (late || errors.Is(context.Cause(s.ctx), ErrSessionExpired)) && !time.Now().Before(s.Deadline()) && s.delay > 0:
			// Lost contact with a lock delay: the lease runs out the
			// delay on the server (WithLockDelay); a revoke would end it.
		default:
			if lost {
				s.waitRuns()
			}
			began := time.Now()
			if s.closeErr = s.revoke(s.ttl); s.closeErr == nil { // etcd answers: the reapers' streams close now
				ctx, cancel := context.WithTimeout(context.Background(), s.ttl-time.Since(began))
				s.reapers.wait(ctx)
				cancel()
			}
		}
	})
	s.join()
	return s.closeErr
}

// BeginRun is the begin of a Run (RunIn) under holds of s whose context
// is hctx: it counts the Run in s.runs, which Close waits for before it
// revokes, until the returned uncount is called (after the release); it
// refuses the Run (ended: why) when the session or hctx ended already, as
// a Close may then have revoked without counting it.
func (s *Session) BeginRun(hctx context.Context) (uncount func(), ended error) {
	s.runs.add()
	switch {
	case s.ctx.Err() != nil:
		return s.runs.done, s.EndedErr()
	case hctx.Err() != nil:
		return s.runs.done, context.Cause(hctx)
	}
	return s.runs.done, nil
}

// waitRuns waits, before Close revokes the lease of a session that ended
// for lost contact (a release of every key), for the Runs under its holds
// to return: their fns were told at the local deadline, and have until the
// server's expiry, the slack later, to stop, which a revoke must not cut
// short (a program that replaces an ended session closes it at once, also
// from another goroutine than a Shards' on it). It waits at most until
// the lease's earliest expiry on the server (the local deadline plus the
// slack), which frees the keys whatever the fns do. A live session's Close
// ends the holds at once: their Runs are told as the keys go.
func (s *Session) waitRuns() {
	ctx, cancel := context.WithDeadline(context.Background(), s.Deadline().Add(s.slack))
	defer cancel()
	s.runs.wait(ctx)
}

// join waits for the session's goroutines that end with it: its keepalive
// loop, its watchers and waits (enter). Its reapers (goReap) end with their
// streams, Orphan or the client.
func (s *Session) join() {
	<-s.ka.loop
	s.watchers.Wait()
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
	case s.ka.check <- struct{}{}:
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
	if !s.enter() {
		return false
	}
	go func() {
		defer s.watchers.Done()
		f()
	}()
	return true
}

// enter counts one more user of the session that Close and Orphan wait for
// (a watcher, a wait's stream), who calls s.watchers.Done when it is over.
// It counts none and returns false when the session has ended: under mu,
// so that none is added once Close or Orphan waits.
func (s *Session) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ctx.Err() != nil {
		return false
	}
	s.watchers.Add(1)
	return true
}

// graced returns the context of a cleanup after a call whose context may
// have ended: CreateGrace long, not ended with the session.
func (s *Session) graced() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(s.ctx), CreateGrace)
}

// goReap runs f, the closing of a gRPC stream a watch may have left open
// (reapStream: a wait's, a sweep's), in a goroutine counted in s.reapers,
// under s.reap: it runs until the stream is closed, Orphan, or the client
// closes, so that a stream left on a link silent for longer than the
// session is closed once the link is back. Close waits for the reapers
// after a revoke that was answered. The caller is a user the session
// counts (enter): Close and Orphan see this call's reaper counted.
func (s *Session) goReap(f func(ctx context.Context)) {
	s.reapers.add()
	go func() {
		defer s.reapers.done()
		f(s.reap)
	}()
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
