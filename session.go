package etcdsync

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

// cleanupTimeout bounds the library's own cleanup RPCs (deleting a key left
// by a failed or cancelled acquire) that run after the caller's context ended.
const cleanupTimeout = 5 * time.Second

// retryPause is the pause between failed keepalives (bounded by TTL/3).
const retryPause = 500 * time.Millisecond

// Session is a lease kept alive in the background. Every key a primitive
// writes is bound to the lease, so the keys vanish when the session ends.
//
// The session keeps a local deadline: the send time of the last keepalive
// the server acknowledged plus the TTL. The server cannot expire the lease
// before that instant, so when keepalives stop getting through, Done closes
// no later than the server may hand the lock to someone else.
type Session struct {
	client *clientv3.Client
	id     clientv3.LeaseID
	ttl    time.Duration // granted TTL: sets the keepalive pace
	// startRev is a revision no later than the session's start: every key
	// with the lease that this session creates has a later create revision,
	// and a key a restarted process resumes (WithLease) an earlier one.
	startRev int64

	ctx    context.Context
	cancel context.CancelCauseFunc
	loop   chan struct{} // closed when the keepalive loop has returned
	check  chan struct{} // asks the keepalive loop for a beat now

	mu       sync.Mutex
	deadline time.Time                // local deadline, see above
	keys     map[string]chan struct{} // key in use by a primitive -> closed when released (nil until someone waits)
	swept    map[string]bool          // keys whose create had an unknown outcome, see sweep
	watchers sync.WaitGroup           // hold watchers and sweepers started by this session

	closeOnce sync.Once
	closeErr  error
}

// NewSession grants a lease (or adopts one, see WithLease) and starts keeping
// it alive. It blocks for one round trip; it is bounded by the WithContext
// context, or by the TTL when none is given. On error no lease is left
// behind that this call granted and still could revoke.
func NewSession(client *clientv3.Client, opts ...SessionOption) (*Session, error) {
	if client == nil {
		return nil, fmt.Errorf("%w: nil client", ErrInvalidArgument)
	}
	o, err := resolve(client, opts)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancelCause(o.ctx)
	s := &Session{
		client: client,
		ctx:    ctx,
		cancel: cancel,
		loop:   make(chan struct{}),
		check:  make(chan struct{}, 1),
		keys:   make(map[string]chan struct{}),
		swept:  make(map[string]bool),
	}
	if err := s.start(o); err != nil {
		cancel(err)
		return nil, err
	}
	go s.keepAlive()
	return s, nil
}

// start grants or adopts the lease and sets the first deadline.
func (s *Session) start(o sessionOptions) error {
	ctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(s.ctx), o.ttl)
	defer cancel()
	sent := time.Now()
	if o.leaseID != clientv3.NoLease {
		resp, err := s.client.TimeToLive(ctx, o.leaseID)
		if err != nil {
			return fmt.Errorf("etcdsync: adopt lease %x: %w", int64(o.leaseID), err)
		}
		if resp.TTL <= 0 {
			return fmt.Errorf("%w: lease %x not found", ErrSessionExpired, int64(o.leaseID))
		}
		// The server truncates the remaining TTL, so this is never late.
		s.id, s.ttl, s.startRev = o.leaseID, time.Duration(resp.GrantedTTL)*time.Second, resp.Revision
		s.deadline = sent.Add(time.Duration(resp.TTL) * time.Second)
		return nil
	}
	resp, err := s.client.Grant(ctx, int64(o.ttl/time.Second))
	if err != nil {
		return fmt.Errorf("etcdsync: grant lease: %w", err)
	}
	s.id, s.ttl, s.startRev = resp.ID, time.Duration(resp.TTL)*time.Second, resp.Revision
	s.deadline = sent.Add(s.ttl)
	return nil
}

// keepAlive refreshes the lease every TTL/3 until the session ends. It owns
// the end of the session by lost contact or a lease that vanished.
func (s *Session) keepAlive() {
	defer close(s.loop)
	pace := s.ttl / 3
	next := time.Now().Add(pace)
	timer := time.NewTimer(0)
	defer timer.Stop()
	for {
		deadline := s.Deadline()
		wake := next
		if deadline.Before(wake) {
			wake = deadline
		}
		timer.Reset(time.Until(wake))
		select {
		case <-s.ctx.Done():
			return
		case <-timer.C:
		case <-s.check:
			next = time.Now() // a hold lost its key: is the lease gone?
		}
		if !time.Now().Before(deadline) {
			s.cancel(fmt.Errorf("%w (%w): no keepalive acknowledged within the TTL (%v) of the last one sent; the server may expire the lease now", ErrSessionExpired, ErrLostContact, s.ttl))
			return
		}
		if time.Now().Before(next) {
			continue
		}
		err := s.beat(deadline)
		switch {
		case err == nil:
			next = time.Now().Add(pace)
		case errors.Is(err, rpctypes.ErrLeaseNotFound):
			s.cancel(fmt.Errorf("%w: lease %x not found", ErrSessionExpired, int64(s.id)))
			return
		default:
			next = time.Now().Add(min(retryPause, pace))
		}
	}
}

// beat sends one keepalive, bounded by the local deadline, and on success
// moves the deadline to its send time plus the TTL.
func (s *Session) beat(deadline time.Time) error {
	ctx, cancel := context.WithDeadline(clientv3.WithRequireLeader(s.ctx), deadline)
	defer cancel()
	sent := time.Now()
	resp, err := s.client.KeepAliveOnce(ctx, s.id)
	if err != nil {
		return err
	}
	if resp.TTL <= 0 {
		return rpctypes.ErrLeaseNotFound
	}
	s.mu.Lock()
	if d := sent.Add(time.Duration(resp.TTL) * time.Second); d.After(s.deadline) {
		s.deadline = d
	}
	s.mu.Unlock()
	return nil
}

// Client returns the etcd client the session uses.
func (s *Session) Client() *clientv3.Client { return s.client }

// Lease returns the session's lease ID.
func (s *Session) Lease() clientv3.LeaseID { return s.id }

// TTL returns the lease's granted TTL.
func (s *Session) TTL() time.Duration { return s.ttl }

// Deadline returns the session's local deadline: the send time of the last
// acknowledged keepalive plus the TTL. The server cannot expire the lease
// before it.
func (s *Session) Deadline() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.deadline
}

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

// Orphan ends the session without revoking its lease: its keys stay until
// the lease expires on the server (for a hand-over to a process that adopts
// the lease with WithLease). It does not block on etcd; it is idempotent.
func (s *Session) Orphan() {
	s.end(fmt.Errorf("%w: orphaned", ErrSessionClosed))
	<-s.loop
	s.watchers.Wait()
}

// Close ends the session and revokes its lease, which deletes every key the
// session holds. It blocks for the revoke, bounded by the TTL (and by the time
// left before the lease expires anyway). It is idempotent: later calls return
// the first call's result. A lease the server no longer has is not an error.
func (s *Session) Close() error {
	s.closeOnce.Do(func() {
		s.end(ErrSessionClosed)
		<-s.loop
		s.watchers.Wait()
		if errors.Is(context.Cause(s.ctx), ErrSessionExpired) && !time.Now().Before(s.Deadline()) {
			// Lost contact: a revoke cannot beat the server's own expiry
			// by more than a round trip; still try, briefly.
			s.closeErr = s.revoke(time.Second)
			return
		}
		s.closeErr = s.revoke(s.ttl)
	})
	return s.closeErr
}

func (s *Session) revoke(bound time.Duration) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(s.ctx), bound)
	defer cancel()
	_, err := s.client.Revoke(ctx, s.id)
	if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		return fmt.Errorf("etcdsync: revoke lease %x: %w", int64(s.id), err)
	}
	return nil
}

// claimKey reserves key for one primitive of this session: the key name is
// fixed by interop (NAME/<lease>), so two holders on one session would share
// a key. With wait it blocks until the key is free or ctx ends; without, it
// returns ErrLocked at once. A reservation is freed by releaseKey, once.
func (s *Session) claimKey(ctx context.Context, key string, wait bool) error {
	for {
		s.mu.Lock()
		freed, taken := s.keys[key]
		if !taken {
			s.keys[key] = nil // a channel is made only when someone waits
			s.mu.Unlock()
			return nil
		}
		if freed == nil && wait {
			freed = make(chan struct{})
			s.keys[key] = freed
		}
		s.mu.Unlock()
		if !wait {
			return fmt.Errorf("%w: %s is in use by this session", ErrLocked, key)
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return fmt.Errorf("etcdsync: waiting for %s held in this session: %w", key, ctx.Err())
		case <-s.ctx.Done():
			return s.endedErr()
		}
	}
}

// releaseKey frees a reservation made by claimKey.
func (s *Session) releaseKey(key string) {
	s.mu.Lock()
	freed := s.keys[key]
	delete(s.keys, key)
	s.mu.Unlock()
	if freed != nil {
		close(freed)
	}
}

// endedErr is the error for a call on a session that has ended.
func (s *Session) endedErr() error {
	return fmt.Errorf("%w: %w", ErrSessionExpired, context.Cause(s.ctx))
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

// sweep keeps a create of key whose outcome this session could not learn
// from leaving a key behind, however late the server applies it (a request
// that a member cut off from its peers forwarded to the leader can be applied
// when the partition heals). Until the session ends, it deletes every key at
// key with this session's lease, created after the session began, that no
// primitive of the session holds or waits with. It does not block.
func (s *Session) sweep(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.swept[key] && s.goLocked(func() { s.sweepKey(key) }) {
		s.swept[key] = true
	}
}

// sweepKey reads key, then watches its creates, until the session ends.
func (s *Session) sweepKey(key string) {
	for s.ctx.Err() == nil {
		if resp, err := s.client.Get(s.ctx, key); err == nil {
			if len(resp.Kvs) > 0 {
				s.unstray(resp.Kvs[0])
			}
			s.watchCreates(key, resp.Header.Revision+1)
		}
		if sleep(s.ctx, retryPause) != nil {
			return
		}
	}
}

// watchCreates unstrays each key created at key from revision from, until the
// watch fails or the session ends.
func (s *Session) watchCreates(key string, from int64) {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(s.ctx))
	defer cancel()
	for wr := range s.client.Watch(ctx, key, clientv3.WithRev(from), clientv3.WithFilterDelete()) {
		if wr.Err() != nil {
			return
		}
		for _, ev := range wr.Events {
			if ev.IsCreate() {
				s.unstray(ev.Kv)
			}
		}
	}
}

// unstray deletes kv's key at its create revision when it has this session's
// lease, was created after the session began, and, once this session's
// primitives have let go of the key, is still there: nothing of the session
// owns it.
func (s *Session) unstray(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	if clientv3.LeaseID(kv.Lease) != s.id || kv.CreateRevision <= s.startRev {
		return
	}
	if s.claimKey(s.ctx, key, true) != nil {
		return // the session ended
	}
	defer s.releaseKey(key)
	for s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(s.ctx, cleanupTimeout)
		_, err := s.client.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", kv.CreateRevision)).
			Then(clientv3.OpDelete(key)).Commit()
		cancel()
		if err == nil || sleep(s.ctx, retryPause) != nil {
			return
		}
	}
}
