package etcdsync

// The distributed lock (type Mutex): a key NAME/<lease-hex> under the
// exclusive rule (internal/queue), and NewLocker's sync.Locker on it.

import (
	"context"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Mutex is a distributed lock on a name. Its key, NAME/<lease-hex>, is the
// one etcd's concurrency.Mutex, etcdctl lock and the server's lock API write,
// so they exclude each other. A Mutex is not reentrant, like sync.Mutex: a
// second Lock on a held Mutex waits for Unlock (from any goroutine). Two
// Mutex values on one Session and name exclude each other too. All methods
// are safe for concurrent use.
type Mutex struct {
	hr queue.Holder
}

// NewMutex returns a Mutex on name for session s. It does not touch etcd. An
// invalid name (empty, or with a NUL byte) or a nil session is reported by
// every call that uses them, with an error wrapping ErrInvalidName or
// ErrInvalidArgument.
func NewMutex(s *Session, name string) *Mutex {
	return &Mutex{hr: queue.NewHolder(s.core(), name, "mutex", &queue.Exclusive)}
}

// Lock blocks until the lock is held, ctx ends (the error wraps ctx.Err()) or
// the session ends (ErrSessionExpired; ErrSessionClosed once it was closed). A
// waiter whose own key vanishes returns ErrSessionExpired at once. On error no
// key is left behind.
func (m *Mutex) Lock(ctx context.Context) error {
	_, err := m.hr.Acquire(ctx, "", queue.WaitTurn)
	return err
}

// TryLock takes the lock if nobody holds it, else returns an error wrapping
// ErrLocked, also when this value itself holds it. On a held lock it costs one
// RPC and writes nothing (two, a read, when keys of nested names NAME/x/… are
// the newest under it). When the name has only nested keys under it, it
// falls back to one more RPC to enqueue. ctx bounds the call.
func (m *Mutex) TryLock(ctx context.Context) error {
	_, err := m.hr.Acquire(ctx, "", queue.TryTurn)
	return err
}

// Unlock releases the lock: it deletes the key only at the revision this hold
// created it, so a retried Unlock never deletes a later hold. It blocks for one
// RPC bounded by ctx and by the hold: when the hold ends meanwhile (the
// session reached its local deadline with etcd unreachable, or the key was
// deleted) it returns at once, whatever ctx says. On an RPC error the hold
// stays and Unlock can be retried; with nothing to release (also a hold that
// has already ended) it returns an error wrapping ErrLockReleased at once,
// without an RPC; a retry after a release that did commit returns it too, so
// callers may treat it as success.
func (m *Mutex) Unlock(ctx context.Context) error {
	h, err := m.hr.Held(ErrLockReleased)
	if err != nil {
		return err
	}
	return h.Unhold(ctx)
}

// Run takes the lock (as Lock, bounded by ctx), calls fn with a context that
// is cancelled the moment the hold ends (context.Cause says why: lost
// contact, key deleted, lease revoked, session closed), and releases the lock
// after fn returns, bounded by the session's TTL even if ctx has ended. A
// panic in fn releases the lock and goes on. It returns Lock's error, or fn's
// error joined with the cause when the hold ended before fn returned, and
// with the release's error, if any. When fn's error already wraps the cause
// (fn returned context.Cause(ctx)), it is returned as it is: the cause is
// stated once, and errors.Is finds it.
func (m *Mutex) Run(ctx context.Context, fn func(ctx context.Context) error) error {
	return m.hr.Run(ctx, 1, "", m.Lock, m.Unlock, fn)
}

// TryRun is Run with TryLock: when the lock is held (also by this value) it
// returns an error wrapping ErrLocked at once, without running fn, in one
// RPC that writes nothing. Otherwise it runs fn and releases as Run does.
// Given the context of a Run that holds this lock, it enters that hold, as
// Run does.
func (m *Mutex) TryRun(ctx context.Context, fn func(ctx context.Context) error) error {
	return m.hr.Run(ctx, 1, "", m.TryLock, m.Unlock, fn)
}

// Do runs ops in one transaction only while this hold is current (its key
// still exists at the held create revision), and returns the transaction's
// response. It blocks for one RPC bounded by ctx. When the hold is gone it
// returns an error wrapping ErrNotHeld and the Mutex no longer holds.
func (m *Mutex) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	return m.hr.Do(ctx, ops...)
}

// Key returns the held key, or "" when not held.
func (m *Mutex) Key() string { return m.hr.Key() }

// Rev returns the fencing token of the current hold: the create revision of
// the held key, strictly increasing from one holder of the name to the next.
// Pass it to resources outside etcd so they can reject a stale holder. It is 0
// when not held.
func (m *Mutex) Rev() int64 { return m.hr.Rev() }

// IsOwner returns a comparison that holds while this hold is current, for the
// caller's own transactions; with no hold it is a comparison that is always
// false.
func (m *Mutex) IsOwner() clientv3.Cmp { return m.hr.Guard() }

// Header returns the response header of the revision at which the current
// hold began, or nil when not held.
func (m *Mutex) Header() *pb.ResponseHeader { return m.hr.Header() }

// Check is a health answer for a service that runs only while it holds the
// lock: nil while this value holds it and the hold is current (its session
// alive, its key there), else why not (ErrNotHeld before any hold). The first
// call for a hold starts its loss watch, as Done does. It does not block and
// sends no request.
func (m *Mutex) Check() error { return m.hr.Check() }

// Done returns a channel closed when the current hold ends: Unlock committed,
// the session ended, or the key was deleted by anyone. The first call for a
// hold starts one watch of its key. With no hold it returns a closed channel.
func (m *Mutex) Done() <-chan struct{} { return m.hr.Done() }

// Err returns nil while a hold is current, else why the last hold ended (an
// error wrapping ErrLockReleased, ErrNotHeld, ErrSessionExpired or
// ErrSessionClosed), or ErrNotHeld if there never was one.
func (m *Mutex) Err() error { return m.hr.Err() }

// locker adapts a Mutex to sync.Locker.
type locker struct{ m *Mutex }

// NewLocker returns a sync.Locker backed by a Mutex on name. Lock blocks until
// held or the session ends; Unlock is bounded by the session's TTL. As
// sync.Locker cannot return errors, both panic with the wrapped error.
func NewLocker(s *Session, name string) sync.Locker {
	return locker{m: NewMutex(s, name)}
}

func (l locker) Lock() {
	if err := l.m.Lock(context.Background()); err != nil {
		panic(fmt.Errorf("etcdsync: Locker.Lock: %w", err))
	}
}

func (l locker) Unlock() {
	ctx := context.Background()
	if s := l.m.hr.Session(); s != nil {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, s.TTL())
		defer cancel()
	}
	if err := l.m.Unlock(ctx); err != nil {
		panic(fmt.Errorf("etcdsync: Locker.Unlock: %w", err))
	}
}
