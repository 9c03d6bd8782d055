package etcdsync

// The session: a lease granted (or adopted) for a process, its life and
// its end (Close revokes, Orphan leaves the lease to expire), and the holds
// it ends with it. Its keepalive is in keepalive.go, its key claims in
// claims.go, its sweepers in sweep.go.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/reach"
)

// Session is a lease kept alive in the background. Every key a primitive
// writes is bound to the lease, so the keys vanish when the session ends.
//
// The session keeps a local deadline: the send time of the last keepalive
// the server acknowledged plus the TTL. The server cannot expire the lease
// before that instant, so when keepalives stop getting through, Done closes
// no later than the server may hand the lock to someone else.
type Session struct {
	client *clientv3.Client
	caps   *caps // what is learned of the client's servers (caps.go)
	id     clientv3.LeaseID
	ttl    time.Duration // granted TTL less the lock delay: sets the deadline and the keepalive pace
	delay  time.Duration // WithLockDelay: the part of the lease's TTL past the local deadline
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
	deadline time.Time          // local deadline, see above
	moved    chan struct{}      // closed when deadline next moves or the session ends (DeadlineMoved); nil until asked for
	keys     map[string]keyUse  // key in use by a primitive of this session
	swept    map[string][]int64 // keys swept (see sweep) -> revisions of creates by this session's acquires not yet seen by the sweeper
	watchers sync.WaitGroup     // hold watchers and sweepers started by this session

	closeOnce sync.Once
	closeErr  error

	rep reports // WithLogger, WithMetrics; nil: none
}

// NewSession grants a lease (or adopts one, see WithLease) and starts keeping
// it alive. It blocks for one round trip; it is bounded by the WithContext
// context. Without one it is bounded by the TTL, and it gives up sooner, in
// about 3 s, when none of the client's endpoints accepts a connection (as a
// dial timeout would; the error names each endpoint and why). On error no lease is left
// behind that this call granted and still could revoke.
func NewSession(client *clientv3.Client, opts ...SessionOption) (*Session, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil client", ErrInvalidArgument)
	}
	o, err := resolve(client, opts)
	if err != nil {
		return nil, err
	}
	// The session ends with a cause of its own when its parent context
	// ends: the client closed, or the WithContext context.
	ctx, cancel := context.WithCancelCause(context.WithoutCancel(o.ctx))
	stop := context.AfterFunc(o.ctx, func() {
		if o.ctx == client.Ctx() {
			cancel(fmt.Errorf("%w: client closed", ErrSessionClosed))
		} else {
			cancel(fmt.Errorf("%w: its context ended: %w", ErrSessionClosed, context.Cause(o.ctx)))
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
		keys:   make(map[string]keyUse),
		swept:  make(map[string][]int64),
	}
	s.rep, s.delay = o.rep, o.delay
	first, err := s.start(o)
	if err != nil {
		stop()
		cancel(err)
		return nil, err
	}
	if s.rep != nil {
		s.rep.sessionBegan(s)
	}
	go s.keepAlive(first)
	return s, nil
}

// start grants or adopts the lease and sets the first deadline. It returns
// when the first keepalive is due: a third of the TTL from now, or at once
// when an adopted lease has less than that left beyond it.
func (s *Session) start(o sessionOptions) (time.Time, error) {
	ctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(s.ctx), o.ttl)
	defer cancel()
	if o.ctx == s.client.Ctx() { // no WithContext: do not wait the TTL for nothing
		var giveUp context.CancelCauseFunc
		ctx, giveUp = context.WithCancelCause(ctx)
		defer giveUp(nil)
		defer s.giveUpUnreachable(ctx, giveUp)()
	}
	sent := time.Now()
	if o.leaseID != clientv3.NoLease {
		resp, err := s.client.TimeToLive(ctx, o.leaseID, clientv3.WithAttachedKeys())
		if err != nil {
			return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.leaseID)), err)
		}
		if resp.TTL <= 0 {
			return sent, tag(fmt.Errorf("etcdsync: adopt lease 0x%x: not found (expired, revoked, or never granted)", int64(o.leaseID)), ErrSessionExpired)
		}
		// The server truncates the remaining TTL, so this is never late.
		s.id, s.ttl, s.startRev = o.leaseID, time.Duration(resp.GrantedTTL)*time.Second-o.delay, resp.Revision
		s.deadline = sent.Add(time.Duration(resp.TTL)*time.Second - o.delay)
		if s.ttl < time.Second || !s.deadline.After(sent) {
			return sent, tag(fmt.Errorf("etcdsync: adopt lease 0x%x: %ds left of a %ds TTL, within the lock delay %v", int64(o.leaseID), resp.TTL, resp.GrantedTTL, o.delay), ErrSessionExpired)
		}
		if len(resp.Keys) > 0 {
			// The header of TimeToLive is the serving member's revision,
			// which may lag behind the keys the lease has; a linearizable
			// read's is at least the revision of every create before it.
			get, err := s.client.Get(ctx, string(resp.Keys[0]), clientv3.WithCountOnly())
			if err != nil {
				return sent, s.unreachable(ctx, fmt.Sprintf("adopt lease 0x%x", int64(o.leaseID)), err)
			}
			s.startRev = max(s.startRev, get.Header.Revision)
		}
	} else {
		resp, err := s.client.Grant(ctx, int64((o.ttl+o.delay)/time.Second))
		if err != nil {
			return sent, s.unreachable(ctx, "grant lease", err)
		}
		s.id, s.ttl, s.startRev = resp.ID, time.Duration(resp.TTL)*time.Second-o.delay, resp.Revision
		s.deadline = sent.Add(s.ttl)
	}
	pace := s.ttl / 3
	return earliest(sent.Add(pace), s.deadline.Add(-pace)), nil
}

// unreachable describes a failed first call: what failed, the endpoints,
// and, when it timed out, why the endpoints could not be reached (the
// client's error says only that the context ended): a diagnostic on this
// failure path only, which dials their addresses and sends nothing to etcd
// (see internal/reach).
func (s *Session) unreachable(ctx context.Context, what string, err error) error {
	if s.ctx.Err() != nil { // the WithContext context ended, or the client closed
		err = context.Cause(s.ctx)
	} else if ue := (unreachableError{}); errors.As(context.Cause(ctx), &ue) {
		return fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(s.client.Endpoints(), ","), ue)
	}
	err = fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(s.client.Endpoints(), ","), err)
	if s.ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if why := reach.Why(s.client.Endpoints(), nil, 200*time.Millisecond); why != "" {
		return fmt.Errorf("%w (%s)", err, why)
	}
	return err
}

// giveUpUnreachable ends ctx, the bound of NewSession's first request, once
// none of the client's endpoints has accepted a connection in checks over
// unreachableFor, rather than letting it wait for the whole TTL: the cause
// names each endpoint and why it could not be dialled. A client with no
// endpoints (an in-process one), or with one only its own resolver knows
// (dns:///…), is never given up on; a client with a dialer of its own that
// reaches what a plain dial cannot is the case this cannot tell. It checks only while
// the first request is pending, every reachCheck from reachCheck on, and the
// returned function stops it and waits for it.
func (s *Session) giveUpUnreachable(ctx context.Context, giveUp context.CancelCauseFunc) (stop func()) {
	cctx, done := context.WithCancel(ctx) // a check in progress ends with stop
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(reachCheck)
		defer tick.Stop()
		var since time.Time // of the first check in a row that reached nothing
		for {
			select {
			case <-cctx.Done():
				return
			case <-tick.C:
			}
			why, none := reach.None(cctx, s.client.Endpoints(), reachCheck)
			if cctx.Err() != nil {
				return
			}
			switch {
			case !none:
				since = time.Time{}
			case since.IsZero():
				since = time.Now()
			case time.Since(since) >= unreachableFor:
				giveUp(unreachableError{why: why, after: time.Since(since) + reachCheck})
				return
			}
		}
	})
	return func() { done(); wg.Wait() }
}

// reachCheck is the pace and bound of the checks of giveUpUnreachable;
// unreachableFor is how long they find nothing before NewSession gives up.
const (
	reachCheck     = 500 * time.Millisecond
	unreachableFor = 2 * time.Second
)

// unreachableError is why NewSession gave up: none of the endpoints could
// be dialled for a while.
type unreachableError struct {
	why   string
	after time.Duration
}

func (e unreachableError) Error() string {
	return fmt.Sprintf("no endpoint accepted a connection for %v (%s)", e.after.Round(100*time.Millisecond), e.why)
}

// Client returns the etcd client the session uses.
func (s *Session) Client() *clientv3.Client { return s.client }

// Lease returns the session's lease ID.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// TTL returns how long the session lives past the send time of its last
// acknowledged keepalive: the lease's granted TTL, less the lock delay
// (WithLockDelay), which the lease has beyond it.
func (s *Session) TTL() time.Duration { return s.ttl }

// Ctx returns a context cancelled when the session ends; context.Cause tells
// why: an error wrapping ErrSessionClosed (Close, Orphan), ErrSessionExpired
// (lease gone, or lost contact past the local deadline), or the cause of the
// WithContext context.
func (s *Session) Ctx() context.Context { return s.ctx }

// Done returns a channel closed when the session ends (see Ctx).
func (s *Session) Done() <-chan struct{} { return s.ctx.Done() }

// Err returns nil while the session lives, else why it ended (see Ctx).
func (s *Session) Err() error {
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

// endedErr is the error for a call on a session that has ended: why it
// ended, also matching ErrSessionExpired unless it was closed (Close,
// Orphan, its context or its client: ErrSessionClosed).
func (s *Session) endedErr() error {
	cause := context.Cause(s.ctx)
	if errors.Is(cause, ErrSessionClosed) {
		return cause
	}
	return tag(cause, ErrSessionExpired)
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
	var holds []*hold
	s.mu.Lock()
	for _, use := range s.keys {
		if use.hold != nil {
			holds = append(holds, use.hold)
		}
	}
	s.mu.Unlock()
	for _, h := range holds {
		h.finish(nil)
	}
}

// goWatch runs f in a goroutine that Close and Orphan wait for. It runs
// nothing and returns false when the session has ended.
func (s *Session) goWatch(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.goLocked(f)
}

// goLocked is goWatch with s.mu held.
func (s *Session) goLocked(f func()) bool {
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
