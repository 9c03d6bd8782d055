package etcdsync

// The weighted semaphore (type Semaphore): a hold is one key NAME/<lease-hex>
// whose value is "<permits>/<capacity>", under queue.Permits.

import (
	"context"
	"fmt"
	"strconv"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// Semaphore is a distributed weighted semaphore on a name: at most capacity
// permits held at once, granted in FIFO order (a large request blocks later
// small ones, as in golang.org/x/sync/semaphore). A hold is one key
// NAME/<lease-hex> bound to the session's lease, whose value is
// "<permits>/<capacity>": a crashed holder's permits come back when its
// lease ends. Every participant on a name must use one capacity. Two
// Semaphore values on one Session and name exclude each other, as Mutexes
// do (they would share the key). All methods are safe for concurrent use.
type Semaphore struct {
	hr       queue.Holder
	capacity int64
}

// NewSemaphore returns a Semaphore on name with capacity permits for session
// s. It does not touch etcd. An invalid name, a nil session or a capacity
// below 1 is reported by every call, with an error wrapping ErrInvalidName or
// ErrInvalidArgument.
func NewSemaphore(s *Session, name string, capacity int64) *Semaphore {
	sm := &Semaphore{hr: queue.NewHolder(s.core(), name, "semaphore", &queue.Exclusive), capacity: capacity}
	if capacity < 1 {
		sm.hr.Refuse(fmt.Errorf("%w: semaphore %s: capacity %d, want at least 1", ErrInvalidArgument, name, capacity))
	}
	return sm
}

// Acquire blocks until n permits are held, ctx ends (the error wraps
// ctx.Err()) or the session ends (ErrSessionExpired; ErrSessionClosed once it
// was closed): it holds once the permits of every key created before its own,
// holding or waiting, leave room for n. A waiter whose own key vanishes
// returns ErrSessionExpired at once. n outside 1..capacity, or a participant
// ahead with another capacity, is an error wrapping ErrInvalidArgument. On
// error no key of this call is left behind. A value holds at most one hold:
// Acquire on a holding value waits for Release.
func (sm *Semaphore) Acquire(ctx context.Context, n int64) error {
	return sm.acquire(ctx, n, queue.WaitTurn)
}

// TryAcquire takes n permits if they are free and nobody waits ahead, else
// returns an error wrapping ErrLocked. When nothing is held it costs one RPC;
// when permits are taken but enough are free, two; when not enough are free
// it costs one RPC and writes nothing.
func (sm *Semaphore) TryAcquire(ctx context.Context, n int64) error {
	return sm.acquire(ctx, n, queue.TryTurn)
}

func (sm *Semaphore) acquire(ctx context.Context, n int64, md queue.Mode) error {
	if sm.hr.Bad() != nil {
		return sm.hr.Bad()
	}
	if n < 1 || n > sm.capacity {
		return fmt.Errorf("%w: acquire %d permits of semaphore %s, capacity %d", ErrInvalidArgument, n, sm.hr.Name(), sm.capacity)
	}
	_, err := sm.hr.AcquireUnder(ctx, queue.Permits(sm.capacity, n), fmt.Sprintf("%d/%d", n, sm.capacity), md)
	return err
}

// Run acquires n permits, calls fn while they are held and releases them,
// as Mutex.Run does.
func (sm *Semaphore) Run(ctx context.Context, n int64, fn func(ctx context.Context) error) error {
	return sm.hr.Run(ctx, n, strconv.FormatInt(sm.capacity, 10), func(ctx context.Context) error { return sm.Acquire(ctx, n) }, sm.Release, fn)
}

// TryRun is Run with TryAcquire: when n permits are not free at once it
// returns an error wrapping ErrLocked without running fn.
func (sm *Semaphore) TryRun(ctx context.Context, n int64, fn func(ctx context.Context) error) error {
	return sm.hr.Run(ctx, n, strconv.FormatInt(sm.capacity, 10), func(ctx context.Context) error { return sm.TryAcquire(ctx, n) }, sm.Release, fn)
}

// Release releases this value's hold (all its permits): it deletes the key
// at the revision it was created, in one RPC bounded by ctx and by the hold,
// as Mutex.Unlock does.
func (sm *Semaphore) Release(ctx context.Context) error { return sm.hr.Release(ctx) }

// Do runs ops in one transaction only while this hold is there, as Mutex.Do.
func (sm *Semaphore) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	return sm.hr.Do(ctx, ops...)
}

// Key returns the held key, or "" when not held.
func (sm *Semaphore) Key() string { return sm.hr.Key() }

// Rev returns the hold's fencing token (its key's create revision), or 0;
// successive holds on a name have increasing Revs.
func (sm *Semaphore) Rev() int64 { return sm.hr.Rev() }

// IsOwner returns a comparison that holds while this hold is there; with no
// hold it is always false.
func (sm *Semaphore) IsOwner() clientv3.Cmp { return sm.hr.Guard() }

// Header returns the header of the revision at which the hold began, or nil.
func (sm *Semaphore) Header() *pb.ResponseHeader { return sm.hr.Header() }

// Check is nil while this value holds permits and the hold is current, else
// why not, as Mutex.Check.
func (sm *Semaphore) Check() error { return sm.hr.Check() }

// Done returns a channel closed when the hold ends (see Mutex.Done); with no
// hold, a closed channel.
func (sm *Semaphore) Done() <-chan struct{} { return sm.hr.Done() }

// Err returns nil while held, else why the last hold ended (as Mutex.Err).
func (sm *Semaphore) Err() error { return sm.hr.Err() }
