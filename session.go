package etcdsync

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

	rep reporter // WithLogger, WithMetrics
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
		ctx:    ctx,
		cancel: cancel,
		loop:   make(chan struct{}),
		check:  make(chan struct{}, 1),
		keys:   make(map[string]keyUse),
		swept:  make(map[string][]int64),
	}
	if o.logger != nil || o.metrics != nil {
		s.rep = reporter{log: o.logger, m: o.metrics, began: make(map[*hold]time.Time)}
	}
	first, err := s.start(o)
	if err != nil {
		stop()
		cancel(err)
		return nil, err
	}
	s.started()
	go s.keepAlive(first)
	return s, nil
}

// start grants or adopts the lease and sets the first deadline. It returns
// when the first keepalive is due: a third of the TTL from now, or at once
// when an adopted lease has less than that left beyond it.
func (s *Session) start(o sessionOptions) (time.Time, error) {
	ctx, cancel := context.WithTimeout(clientv3.WithRequireLeader(s.ctx), o.ttl)
	defer cancel()
	sent := time.Now()
	if o.leaseID != clientv3.NoLease {
		resp, err := s.client.TimeToLive(ctx, o.leaseID, clientv3.WithAttachedKeys())
		if err != nil {
			return sent, s.unreachable(fmt.Sprintf("adopt lease 0x%x", int64(o.leaseID)), err)
		}
		if resp.TTL <= 0 {
			return sent, tag(fmt.Errorf("etcdsync: adopt lease 0x%x: not found (expired, revoked, or never granted)", int64(o.leaseID)), ErrSessionExpired)
		}
		// The server truncates the remaining TTL, so this is never late.
		s.id, s.ttl, s.startRev = o.leaseID, time.Duration(resp.GrantedTTL)*time.Second, resp.Revision
		s.deadline = sent.Add(time.Duration(resp.TTL) * time.Second)
		if len(resp.Keys) > 0 {
			// The header of TimeToLive is the serving member's revision,
			// which may lag behind the keys the lease has; a linearizable
			// read's is at least the revision of every create before it.
			get, err := s.client.Get(ctx, string(resp.Keys[0]), clientv3.WithCountOnly())
			if err != nil {
				return sent, s.unreachable(fmt.Sprintf("adopt lease 0x%x", int64(o.leaseID)), err)
			}
			s.startRev = max(s.startRev, get.Header.Revision)
		}
	} else {
		resp, err := s.client.Grant(ctx, int64(o.ttl/time.Second))
		if err != nil {
			return sent, s.unreachable("grant lease", err)
		}
		s.id, s.ttl, s.startRev = resp.ID, time.Duration(resp.TTL)*time.Second, resp.Revision
		s.deadline = sent.Add(s.ttl)
	}
	pace := s.ttl / 3
	return earliest(sent.Add(pace), s.deadline.Add(-pace)), nil
}

// unreachable describes a failed first call: what failed, the endpoints, and
// why the connection is down when it is (the client's own error says only
// that the context ended).
func (s *Session) unreachable(what string, err error) error {
	if s.ctx.Err() != nil { // the WithContext context ended, or the client closed
		err = context.Cause(s.ctx)
	}
	err = fmt.Errorf("etcdsync: %s (endpoints %s): %w", what, strings.Join(s.client.Endpoints(), ","), err)
	if s.ctx.Err() != nil || !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	// One fail-fast call reports the connection's last error: a
	// diagnostic on this failure path only, which decides nothing. It is
	// the one request sent around the client's interfaces (their calls
	// wait for a connection and say only that the context ended); a client
	// without a connection of its own (in-process) skips it.
	conn := s.client.ActiveConnection()
	if conn == nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(s.ctx), 200*time.Millisecond)
	defer cancel()
	_, perr := pb.NewMaintenanceClient(conn).Status(ctx, &pb.StatusRequest{}, grpc.WaitForReady(false))
	if status.Code(perr) == codes.Unavailable {
		return fmt.Errorf("%w (%s)", err, status.Convert(perr).Message())
	}
	return err
}

// keepAlive refreshes the lease until the session ends: each beat is one
// KeepAliveOnce through the client's Lease (so a wrapper, a namespace, an
// in-process client or a proxy sees it), run in a goroutine of its own and
// bounded by the TTL. Beats are paced from their send times, every TTL/3
// whatever the replies do, so on a slow link several may be in flight: while
// the server acknowledges a beat within the TTL of its sending the session
// lives. Each acknowledgement moves the local deadline to its beat's send
// time plus the TTL the server granted; a beat knows its own send time, so
// replies may come in any order. The first beat goes at first. keepAlive
// owns the beats' goroutines (joined on return) and the end of the session
// by lost contact or a lease that vanished.
func (s *Session) keepAlive(first time.Time) {
	defer close(s.loop)
	defer s.ended()
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
		if !time.Now().Before(deadline) {
			s.cancel(fmt.Errorf("%w (%w): no keepalive acknowledged within the TTL (%v) of its sending; the server may expire the lease now", ErrSessionExpired, ErrLostContact, s.ttl))
			return
		}
		timer.Reset(time.Until(earliest(next, deadline)))
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
				s.keepaliveFailed(r.err)
				next = latest(next, time.Now().Add(min(retryPause, pace)))
			default:
				s.keepaliveAcked(r.sent)
				s.extend(r.sent.Add(time.Duration(r.ttl) * time.Second))
			}
			continue
		case <-timer.C:
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

func latest(a, b time.Time) time.Time {
	if b.After(a) {
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
		return closed
	}
	if s.moved == nil {
		s.moved = make(chan struct{})
	}
	return s.moved
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
// at once (the lease is left to expire). It is idempotent: later calls return the
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

// claimKey reserves key for one primitive of this session: the key name is
// fixed by interop (NAME/<lease>), so two holders on one session would share
// a key. With wait it blocks until the key is free or ctx ends; without, it
// returns ErrLocked at once. A reservation is freed by releaseKey, once.
func (s *Session) claimKey(ctx context.Context, key string, wait bool) error {
	_, err := s.claim(ctx, key, wait, nil, nil)
	return err
}

// shareKey is claimKey for a key whose holds the session's primitives share
// (an RWMutex's read key): when the session holds the key and one read shows
// it still there, it joins that hold (counted, see hold.leave) and returns
// it; else it reserves the key and returns nil. With wait, an acquire or a
// release of the key in flight is waited for; without, it is an error
// wrapping ErrLocked.
func (s *Session) shareKey(ctx context.Context, key string, wait bool) (*hold, error) {
	joinable := func(h *hold) bool { return h.rule.shared && h.live() && !h.closing } // not a Mutex on NAME/read
	for {
		var seen *hold
		if _, err := s.claim(ctx, key, wait, nil, func(h *hold) bool {
			if joinable(h) {
				seen = h
			}
			return seen != nil
		}); err != nil || seen == nil {
			return nil, err
		}
		// Its key may be gone unnoticed (deleted, nobody watching).
		if err := s.checkBounded(ctx, seen); err != nil {
			if seen.live() {
				return nil, err
			}
			continue // it ended: wait until it is freed
		}
		s.mu.Lock()
		joined := s.keys[key].hold == seen && joinable(seen)
		if joined {
			seen.shares++
		}
		s.mu.Unlock()
		if joined {
			return seen, nil
		}
	}
}

// bound returns ctx ended also by the session's end, and its cancel.
func (s *Session) bound(ctx context.Context) (context.Context, func()) {
	ctx, cancel := context.WithCancel(ctx)
	stop := context.AfterFunc(s.ctx, cancel)
	return ctx, func() { stop(); cancel() }
}

// checkBounded is h.check bounded by ctx and by the session's end.
func (s *Session) checkBounded(ctx context.Context, h *hold) error {
	ctx, cancel := s.bound(ctx)
	defer cancel()
	_, err := h.check(ctx)
	switch {
	case err == nil:
	case s.ctx.Err() != nil:
		return s.endedErr()
	default:
		return fmt.Errorf("etcdsync: join the session's hold of %s: %w", h.key, err)
	}
	return nil
}

// claim is claimKey, except that once the key is free it claims nothing and
// returns false when skip (called with s.mu held) says so, and that while
// the key is held it claims nothing and returns false when join (called
// with s.mu held) takes a share of the hold.
func (s *Session) claim(ctx context.Context, key string, wait bool, skip func() bool, join func(*hold) bool) (bool, error) {
	for {
		s.mu.Lock()
		use, taken := s.keys[key]
		if !taken {
			if skip != nil && skip() {
				s.mu.Unlock()
				return false, nil
			}
			s.keys[key] = keyUse{} // a channel is made only when someone waits
			s.mu.Unlock()
			return true, nil
		}
		if join != nil && use.hold != nil && join(use.hold) {
			s.mu.Unlock()
			return false, nil
		}
		if use.freed == nil && wait {
			use.freed = make(chan struct{})
			s.keys[key] = use
		}
		freed := use.freed
		s.mu.Unlock()
		if !wait {
			return false, fmt.Errorf("%w: %s is held, or waited for, by this session", ErrLocked, key)
		}
		select {
		case <-freed:
		case <-ctx.Done():
			return false, fmt.Errorf("etcdsync: waiting for %s held in this session: %w", key, ctx.Err())
		case <-s.ctx.Done():
			return false, s.endedErr()
		}
	}
}

// keyUse is a key reserved by a primitive of the session (claimKey).
type keyUse struct {
	freed chan struct{} // closed when released, or when a hold can be joined (wake); nil until someone waits
	hold  *hold         // its hold, once it holds
}

// wakeLocked lets the callers waiting for key (claim) look again: its hold
// began, or can be joined again. s.mu is held.
func (s *Session) wakeLocked(key string) {
	if use := s.keys[key]; use.freed != nil {
		close(use.freed)
		use.freed = nil
		s.keys[key] = use
	}
}

// releaseKey frees a reservation made by claimKey.
func (s *Session) releaseKey(key string) {
	s.mu.Lock()
	freed := s.keys[key].freed
	delete(s.keys, key)
	s.mu.Unlock()
	if freed != nil {
		close(freed)
	}
}

// endedErr is the error for a call on a session that has ended: why it
// ended, also matching ErrSessionExpired.
func (s *Session) endedErr() error {
	return tag(context.Cause(s.ctx), ErrSessionExpired)
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

// sweep keeps a create of key whose outcome this session could not learn
// from leaving a key behind, however late the server applies it (a request
// that a member cut off from its peers forwarded to the leader can be applied
// when the partition heals). Until the session ends, it deletes every key at
// key with this session's lease, created after the session began, that no
// primitive of the session holds or waits with. It does not block.
func (s *Session) sweep(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.swept[key]; !ok && s.goLocked(func() { s.sweepKey(key) }) {
		s.swept[key] = nil
	}
}

// created records that an acquire of this session created key at rev, so
// that a sweeper of the key leaves that create to the acquire (which holds
// it, or withdraws it).
func (s *Session) created(key string, rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if revs, ok := s.swept[key]; ok {
		s.swept[key] = append(revs, rev)
	}
}

// disown forgets that an acquire of this session created key at rev (its
// withdraw failed): a sweeper of the key removes it.
func (s *Session) disown(key string, rev int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if revs, ok := s.swept[key]; ok {
		s.swept[key] = slices.DeleteFunc(revs, func(r int64) bool { return r == rev })
	}
}

// oursLocked reports whether an acquire of this session created kv (see
// created), and forgets that create and any before it. s.mu is held.
func (s *Session) oursLocked(kv *mvccpb.KeyValue) bool {
	key := string(kv.Key)
	revs := s.swept[key]
	i := slices.Index(revs, kv.CreateRevision)
	if i < 0 {
		return false
	}
	s.swept[key] = slices.Delete(revs, 0, i+1)
	return true
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

// made reports whether kv is a key this session created: it has the
// session's lease and was created after the session began (a restarted
// process's key, WithLease, was created before).
func (s *Session) made(kv *mvccpb.KeyValue) bool {
	return clientv3.LeaseID(kv.Lease) == s.id && kv.CreateRevision > s.startRev
}

// unstray deletes kv's key at its create revision when this session made it
// and, once this session's primitives have let go of the key, it is still
// there: nothing of the session owns it.
func (s *Session) unstray(kv *mvccpb.KeyValue) {
	key := string(kv.Key)
	if !s.made(kv) {
		return
	}
	// Wait until no primitive of the session uses the key: an acquire that
	// created kv has recorded it by then, and the key is left alone.
	if claimed, _ := s.claim(s.ctx, key, true, func() bool { return s.oursLocked(kv) }, nil); !claimed {
		return
	}
	defer s.releaseKey(key)
	for s.ctx.Err() == nil {
		ctx, cancel := context.WithTimeout(s.ctx, cleanupTimeout)
		err := deleteAtRev(ctx, s.client, key, kv.CreateRevision)
		cancel()
		if err == nil || sleep(s.ctx, retryPause) != nil {
			return
		}
	}
}
