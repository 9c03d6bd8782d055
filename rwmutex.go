package etcdsync

// The read/write lock (type RWMutex): a reader's key NAME/read/<lease-hex>
// and a writer's NAME/write/<lease-hex>, under queue.ReadRule and
// queue.WriteRule.

import (
	"context"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// RWMutex is a distributed read/write lock on a name: many readers or one
// writer. A reader's key is NAME/read/<lease-hex>, a writer's
// NAME/write/<lease-hex>, the directories etcd's experimental recipes
// RWMutex uses, so the two exclude each other. All keys form one queue in
// create-revision order: a reader waits for the writers created before it, a
// writer for every key created before it, so a waiting writer holds back the
// readers that come after it. Read holds of one Session on a name share one
// key (counted: the last RUnlock deletes it), whichever RWMutex values take
// them; write holds exclude each other as Mutexes do. Lock on a value that
// holds a read (or RLock on one that holds the write) waits for that hold
// to end, as sync.RWMutex does. All methods are safe for concurrent use.
//
// The recipe's layout has one exception to "a lock on NAME/x never blocks
// NAME": a Mutex or Election on NAME/read or NAME/write writes keys that
// look like this RWMutex's readers or writers, and counts as one.
type RWMutex struct {
	w, r queue.Holder

	mu   sync.Mutex
	last *queue.Holder // the holder of the last hold taken
}

// NewRWMutex returns an RWMutex on name for session s. It does not touch
// etcd. An invalid name or a nil session is reported by every call that uses
// them.
func NewRWMutex(s *Session, name string) *RWMutex {
	return &RWMutex{w: queue.NewHolder(s.core(), name, "rwmutex", &queue.WriteRule), r: queue.NewHolder(s.core(), name, "rwmutex", &queue.ReadRule)}
}

// RLock blocks until a read hold is taken, ctx ends (the error wraps
// ctx.Err()) or the session ends (ErrSessionExpired; ErrSessionClosed once it
// was closed). When the session already holds a read on the name, it shares
// that hold after one read that shows its key still there. A waiter whose own
// key vanishes returns ErrSessionExpired at once. On error no key of this call
// is left behind.
func (rw *RWMutex) RLock(ctx context.Context) error { return rw.acquire(&rw.r, ctx, queue.WaitTurn) }

// TryRLock takes a read hold if no writer holds or waits, else returns an
// error wrapping ErrLocked. When a writer holds or waits it costs one RPC
// and writes nothing. It also returns ErrLocked, sending nothing, while
// another read acquire or the last read release of this session on the name
// is in flight, and after such a release failed, until its hold ends or a
// retry releases it. ctx bounds the call.
func (rw *RWMutex) TryRLock(ctx context.Context) error { return rw.acquire(&rw.r, ctx, queue.TryTurn) }

// RUnlock ends one read hold of this value. The session's last read hold on
// the name deletes the read key (at the revision it was created), in one RPC
// bounded by ctx and by the hold; earlier ones touch nothing. On an RPC
// error the hold stays and RUnlock can be retried (until the hold ends, which
// it does if the delete did commit, other RLocks of the session wait); with
// no read hold it returns an error wrapping ErrLockReleased.
func (rw *RWMutex) RUnlock(ctx context.Context) error { return rw.r.Release(ctx) }

// Lock blocks until the write hold is taken: every reader and writer
// created before it has gone. ctx and the session bound it as RLock's.
func (rw *RWMutex) Lock(ctx context.Context) error { return rw.acquire(&rw.w, ctx, queue.WaitTurn) }

// TryLock takes the write hold if nobody holds or waits, else returns an
// error wrapping ErrLocked, in one RPC that writes nothing when held.
func (rw *RWMutex) TryLock(ctx context.Context) error { return rw.acquire(&rw.w, ctx, queue.TryTurn) }

// Unlock releases the write hold as Mutex.Unlock does.
func (rw *RWMutex) Unlock(ctx context.Context) error { return rw.w.Release(ctx) }

// Run takes the write lock, calls fn while it is held and unlocks, as
// Mutex.Run does.
func (rw *RWMutex) Run(ctx context.Context, fn func(ctx context.Context) error) error {
	return rw.w.Run(ctx, 1, "", rw.Lock, rw.Unlock, fn)
}

// RRun takes a read hold, calls fn while it is held and ends the hold, as
// Mutex.Run does; fn's context ends when the shared read key goes. A fn that
// ends its read hold itself passes its context to RUnlock, so that RRun
// knows and does not end another share.
func (rw *RWMutex) RRun(ctx context.Context, fn func(ctx context.Context) error) error {
	return rw.r.Run(ctx, 1, "", rw.RLock, rw.RUnlock, fn)
}

// TryRun is Run with TryLock: when the write hold cannot be taken at once it
// returns an error wrapping ErrLocked without running fn.
func (rw *RWMutex) TryRun(ctx context.Context, fn func(ctx context.Context) error) error {
	return rw.w.Run(ctx, 1, "", rw.TryLock, rw.Unlock, fn)
}

// TryRRun is RRun with TryRLock: when a read hold cannot be taken at once
// (a writer holds or waits) it returns an error wrapping ErrLocked without
// running fn.
func (rw *RWMutex) TryRRun(ctx context.Context, fn func(ctx context.Context) error) error {
	return rw.r.Run(ctx, 1, "", rw.TryRLock, rw.RUnlock, fn)
}

func (rw *RWMutex) acquire(hr *queue.Holder, ctx context.Context, md queue.Mode) error {
	if _, err := hr.Acquire(ctx, "", md); err != nil {
		return err
	}
	rw.mu.Lock()
	rw.last = hr
	rw.mu.Unlock()
	return nil
}

// cur is the holder of the current hold (the write hold first), else of
// the last hold taken.
func (rw *RWMutex) cur() *queue.Holder {
	switch {
	case rw.w.Current() != nil:
		return &rw.w
	case rw.r.Current() != nil:
		return &rw.r
	}
	rw.mu.Lock()
	defer rw.mu.Unlock()
	if rw.last != nil {
		return rw.last
	}
	return &rw.w
}

// Do runs ops in one transaction only while the current hold (write, else
// read) is there, as Mutex.Do does.
func (rw *RWMutex) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	return rw.cur().Do(ctx, ops...)
}

// Key returns the key of the current hold (write, else read), or "".
func (rw *RWMutex) Key() string { return rw.cur().Key() }

// Rev returns the current hold's fencing token (its key's create revision),
// or 0. Successive write holds on a name have increasing Revs.
func (rw *RWMutex) Rev() int64 { return rw.cur().Rev() }

// IsOwner returns a comparison that holds while the current hold is there;
// with no hold it is always false.
func (rw *RWMutex) IsOwner() clientv3.Cmp { return rw.cur().Guard() }

// Header returns the header of the revision at which the current hold
// began, or nil.
func (rw *RWMutex) Header() *pb.ResponseHeader { return rw.cur().Header() }

// Check is nil while this value holds (the write hold, else a read hold)
// and the hold is current, else why not, as Mutex.Check.
func (rw *RWMutex) Check() error { return rw.cur().Check() }

// Done returns a channel closed when the current hold ends (see Mutex.Done);
// with no hold, a closed channel.
func (rw *RWMutex) Done() <-chan struct{} { return rw.cur().Done() }

// Err returns nil while a hold is current, else why the last one ended (as
// Mutex.Err).
func (rw *RWMutex) Err() error { return rw.cur().Err() }
