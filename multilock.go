package etcdsync

// MultiLock: several names locked as one hold. Its keys are the keys of a
// Mutex, or of an RWMutex's read or write side, under each name, written
// by one transaction at one create revision (acquire), so that every
// contender of any of the names waits only for keys older than its own:
// two MultiLocks that name the same locks in any order, or a MultiLock and
// Mutexes or RWMutexes, never wait for each other in a circle.

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync/internal/queue"
)

// MultiLock is a distributed lock on several names at once: Lock holds
// them all or none. Each name's key is the one a Mutex on that name writes
// (or, with NewMultiLockOf, an RWMutex's read or write side), so Mutexes,
// etcd's concurrency.Mutex and etcdctl lock on any of the names exclude it,
// and each name has its own fencing token (Rev). The keys are
// written in one transaction, at one revision, and a contender waits only
// for keys older than its own: no two MultiLocks deadlock, whatever order
// their names are given in. While it waits for a later name it keeps its
// place on the names it already holds, as ordered locking does. A hold that
// ends on any name (key deleted, session expired) ends the MultiLock's hold:
// Done closes, and the keys of the other names are released. Within one
// Session, a MultiLock and a Mutex on a shared name exclude each other as
// two Mutexes do; a goroutine that holds a Mutex and then locks a MultiLock
// naming it waits for itself, as with two Mutexes. All methods are safe for
// concurrent use.
type MultiLock struct {
	names []string       // sorted, distinct
	hrs   []queue.Holder // one per name, in names' order
	bad   error

	mu   sync.Mutex
	cur  *multiHold // the current hold, or nil
	last error      // why the previous hold ended
}

// multiHold is one hold of a MultiLock: a hold per name, and the context
// that ends when the first of them ends.
type multiHold struct {
	hs  []*queue.Hold
	ctx context.Context
	end context.CancelCauseFunc // ends ctx
	// relays end ctx when a hold ends otherwise than by a release (a
	// loss), and release the others; Unlock joins them, returns what their
	// releases failed at (released), and ends ctx once it has released
	// every name.
	relays   sync.WaitGroup
	mu       sync.Mutex
	released error
}

// NewMultiLock returns a MultiLock on names for session s: a Mutex's key on
// each. It does not touch etcd. A name given twice counts once. No name, an
// invalid name or a nil session is reported by every call, with an error
// wrapping ErrInvalidName or ErrInvalidArgument.
func NewMultiLock(s *Session, names ...string) *MultiLock {
	parts := make([]Part, len(names))
	for i, name := range names {
		parts[i] = Part{Name: name}
	}
	return NewMultiLockOf(s, parts...)
}

// Side is what a MultiLock takes of a name.
type Side int

const (
	MutexSide Side = iota // the name's Mutex key, NAME/<lease-hex>
	ReadSide              // an RWMutex's read key, NAME/read/<lease-hex>: shared with other readers
	WriteSide             // an RWMutex's write key, NAME/write/<lease-hex>
)

// Part is one name of a MultiLock and what it takes of it.
type Part struct {
	Name string
	Side Side
}

// NewMultiLockOf returns a MultiLock on parts for session s: Mutex names
// and sides of RWMutexes, each excluding (or, a read side, sharing with)
// the primitive of that kind on the name. It does not touch etcd. One
// transaction writes every key, so etcd's --max-txn-ops (128 by default)
// bounds a MultiLock to half as many names (64); more is an error wrapping
// ErrInvalidArgument from Lock and TryLock. A part
// given twice counts once; two sides of one name, no part, an invalid name
// or side, or a nil session is reported by every call, with an error
// wrapping ErrInvalidName or ErrInvalidArgument. A read side does not join
// the read holds of other values of the session on its name, as an
// RWMutex's RLock does: it waits for them to end, in this process.
// Semaphore permits cannot be part of a MultiLock: a permit holder's key
// holds its count, which one transaction writing every key does not give.
func NewMultiLockOf(s *Session, parts ...Part) *MultiLock {
	parts = slices.Clone(parts)
	slices.SortFunc(parts, func(a, b Part) int { return cmp.Or(strings.Compare(a.Name, b.Name), cmp.Compare(a.Side, b.Side)) })
	parts = slices.Compact(parts)
	ml := &MultiLock{hrs: make([]queue.Holder, len(parts))}
	for i, p := range parts {
		ml.names = append(ml.names, p.Name)
		rule := &queue.Exclusive
		switch p.Side {
		case ReadSide:
			rule = &multiReadRule
		case WriteSide:
			rule = &queue.WriteRule
		}
		ml.hrs[i] = queue.NewHolder(s.core(), p.Name, "multilock", rule)
		switch {
		case ml.bad != nil:
		case ml.hrs[i].Bad() != nil:
			ml.bad = ml.hrs[i].Bad()
		case i > 0 && parts[i-1].Name == p.Name:
			ml.bad = fmt.Errorf("%w: a MultiLock takes one side of %s, not two", ErrInvalidArgument, p.Name)
		case p.Side != MutexSide && p.Side != ReadSide && p.Side != WriteSide:
			ml.bad = fmt.Errorf("%w: side %d of %s", ErrInvalidArgument, p.Side, p.Name)
		}
	}
	if len(parts) == 0 {
		ml.bad = fmt.Errorf("%w: a MultiLock needs at least one name", ErrInvalidArgument)
	}
	return ml
}

// multiReadRule is an RWMutex's read rule for a MultiLock: its hold is not
// shared with the session's other read holds of the name (see
// NewMultiLockOf).
var multiReadRule = queue.ReadRule.Unshared()

// Lock blocks until every name is held, ctx ends (the error wraps ctx.Err())
// or the session ends (ErrSessionExpired; ErrSessionClosed once it was
// closed). It costs one RPC when no name is taken, whatever the number of
// names. A waiter whose own key on any name vanishes returns
// ErrSessionExpired at once. On error no key is left behind, on any name. A
// MultiLock is not reentrant: Lock on a held one waits for Unlock.
func (ml *MultiLock) Lock(ctx context.Context) error { return ml.lock(ctx, queue.WaitTurn) }

// TryLock takes every name if none is held, else returns an error wrapping
// ErrLocked, also when this value holds them. It costs one RPC and writes
// nothing when a name is held; ctx bounds the call.
func (ml *MultiLock) TryLock(ctx context.Context) error { return ml.lock(ctx, queue.TryTurn) }

func (ml *MultiLock) lock(ctx context.Context, md queue.Mode) error {
	if ml.bad != nil {
		return ml.bad
	}
	hs, err := queue.AcquireAll(ctx, ml.hrs, "", md)
	if err != nil {
		return err
	}
	mh := &multiHold{hs: hs}
	mh.ctx, mh.end = context.WithCancelCause(context.WithoutCancel(ctx))
	for i, h := range hs {
		ml.hrs[i].AddShare(h)
		mh.relays.Add(1)
		context.AfterFunc(h.Context(), func() {
			defer mh.relays.Done()
			if cause := h.Err(); !errors.Is(cause, ErrLockReleased) { // lost: the others go too
				mh.end(cause)
				ctx, cancel := context.WithTimeout(context.WithoutCancel(h.Session().Ctx()), h.Session().TTL())
				defer cancel()
				if err := mh.release(ctx); err != nil {
					mh.mu.Lock()
					mh.released = errors.Join(mh.released, err)
					mh.mu.Unlock()
				}
			}
		})
	}
	ml.mu.Lock()
	ml.cur = mh
	ml.mu.Unlock()
	return nil
}

// release releases every live hold of the set in one RPC (one
// transaction, one revision), bounded by ctx, and returns the errors of
// those it did not release, joined.
func (mh *multiHold) release(ctx context.Context) error {
	var live []*queue.Hold
	for _, h := range mh.hs {
		if h.Live() {
			live = append(live, h)
		}
	}
	if len(live) == 0 {
		return nil
	}
	return errors.Join(queue.Unhold(ctx, live)...)
}

// current returns the current hold, or nil.
func (ml *MultiLock) current() *multiHold {
	ml.mu.Lock()
	defer ml.mu.Unlock()
	return ml.cur
}

// Unlock releases every name in one RPC bounded by ctx: one transaction
// deletes each key only at the revision this hold created it (fenced, as
// Mutex.Unlock), all at one revision. When it fails the value still holds
// and Unlock can be retried. With nothing to release it returns an
// error wrapping ErrLockReleased without an RPC; when the hold had ended on
// some name (see Done), it releases the others and returns the cause.
func (ml *MultiLock) Unlock(ctx context.Context) error {
	if ml.bad != nil {
		return ml.bad
	}
	mh := ml.current()
	if mh == nil {
		return queue.NotHeldBy(ml.hrs[0].Session(), ErrLockReleased, strings.Join(ml.names, ", "))
	}
	return ml.unlock(ctx, mh)
}

// unlock is Unlock of the hold mh, which may no longer be the value's
// current one (a Run's fn unlocked it, and another Run took the names
// since): that is left alone.
func (ml *MultiLock) unlock(ctx context.Context, mh *multiHold) error {
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("etcdsync: release %s: %w", strings.Join(ml.names, ", "), err)
	}
	err := mh.release(ctx)
	if slices.ContainsFunc(mh.hs, (*queue.Hold).Live) { // a release failed: the value still holds, retry it
		return err
	}
	mh.relays.Wait() // every hold has ended: a loss among them has ended ctx
	mh.end(fmt.Errorf("%w: %s released by this value", ErrLockReleased, strings.Join(ml.names, ", ")))
	lost := context.Cause(mh.ctx)
	ml.mu.Lock()
	if ml.cur == mh {
		ml.cur, ml.last = nil, context.Cause(mh.ctx)
	}
	ml.mu.Unlock()
	if lost != nil && !errors.Is(lost, ErrLockReleased) {
		return fmt.Errorf("%w: the hold had ended: %w", ErrLockReleased, errors.Join(lost, mh.released))
	}
	return err
}

// Run takes the locks (as Lock, bounded by ctx), calls fn with a context
// that is cancelled the moment the hold ends on any name (context.Cause
// says why), and releases them after fn returns, bounded by the session's
// TTL even if ctx has ended. A panic in fn releases the locks and goes on.
// It returns Lock's error, or fn's error joined with the cause when the
// hold ended before fn returned (fn's error alone when it wraps the cause
// already, as Mutex.Run), and with the release's error, if any.
// Given the context of a Run that holds every name (of this session), it
// runs fn within that hold; one that holds some of them is an error
// wrapping ErrInvalidArgument, not a deadlock.
func (ml *MultiLock) Run(ctx context.Context, fn func(ctx context.Context) error) error {
	return ml.run(ctx, ml.Lock, fn)
}

// TryRun is Run with TryLock: when a name is held (also by this value) it
// returns an error wrapping ErrLocked at once, without running fn, in one
// RPC that writes nothing.
func (ml *MultiLock) TryRun(ctx context.Context, fn func(ctx context.Context) error) error {
	return ml.run(ctx, ml.TryLock, fn)
}

func (ml *MultiLock) run(ctx context.Context, lock func(context.Context) error, fn func(context.Context) error) error {
	if ml.bad != nil {
		return ml.bad
	}
	entered := 0
	for i := range ml.hrs {
		in, err := ml.hrs[i].Reenters(ctx, 1, "")
		if err != nil {
			return err
		}
		if in {
			entered++
		}
	}
	switch entered {
	case len(ml.hrs):
		return fn(ctx)
	case 0:
	default:
		return fmt.Errorf("%w: a Run of %s inside a Run that holds only some of them", ErrInvalidArgument, strings.Join(ml.names, ", "))
	}
	if err := lock(ctx); err != nil {
		return err
	}
	mh := ml.current()
	if mh == nil { // ended as it began
		return ml.Err()
	}
	ml.Done() // watch the keys: a delete behind our back ends fn's context
	after := func(err error) error {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), mh.hs[0].Session().TTL())
		defer cancel()
		released := ml.unlock(rctx, mh) // not Unlock: fn may have unlocked mh, and another Run taken the names
		if cause := context.Cause(mh.ctx); cause != nil && !errors.Is(cause, ErrLockReleased) {
			released = cause // the hold ended before fn returned: Unlock found it gone
		}
		return queue.Stated(err, released)
	}
	begin := func(context.CancelCauseFunc) (func(), error) { return mh.hs[0].Session().BeginRun(mh.ctx) }
	return queue.RunIn(queue.WithHolds(ctx, mh.hs), mh.ctx, begin, after, fn)
}

// Rev returns the fencing token of name: the create revision of its key in
// the current hold, or 0 when the value does not hold it (or name is not
// one of its names).
func (ml *MultiLock) Rev(name string) int64 {
	if i, ok := slices.BinarySearch(ml.names, name); ok {
		return ml.hrs[i].Rev()
	}
	return 0
}

// Key returns the key of name in the current hold, or "" (as Rev).
func (ml *MultiLock) Key(name string) string {
	if i, ok := slices.BinarySearch(ml.names, name); ok {
		return ml.hrs[i].Key()
	}
	return ""
}

// Header returns the header of the revision at which the value came to
// hold every name, or nil when it does not hold.
func (ml *MultiLock) Header() *pb.ResponseHeader {
	var latest *pb.ResponseHeader
	for i := range ml.hrs {
		h := ml.hrs[i].Header()
		if h == nil {
			return nil
		}
		if latest == nil || h.Revision > latest.Revision {
			latest = h
		}
	}
	return latest
}

// Do runs ops in one transaction (one RPC, bounded by ctx) only while the
// value holds every name: each key at the revision this hold created it.
// When a key is gone, nothing is written, the hold ends (as Done says) and
// the error wraps ErrNotHeld.
func (ml *MultiLock) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if ml.bad != nil {
		return nil, ml.bad
	}
	mh := ml.current()
	if mh == nil || context.Cause(mh.ctx) != nil {
		return nil, queue.NotHeldBy(ml.hrs[0].Session(), ErrNotHeld, strings.Join(ml.names, ", "))
	}
	cmps := make([]clientv3.Cmp, len(mh.hs))
	gets := make([]clientv3.Op, len(mh.hs))
	for i, h := range mh.hs {
		cmps[i], gets[i] = h.Guard(h.Prefix()), clientv3.OpGet(h.Key(), clientv3.WithKeysOnly())
	}
	resp, err := mh.hs[0].Session().Client().Txn(ctx).If(cmps...).Then(ops...).Else(gets...).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdsync: guarded transaction on %s: %w", strings.Join(ml.names, ", "), err)
	}
	if resp.Succeeded {
		return resp, nil
	}
	for i, h := range mh.hs {
		if kvs := resp.Responses[i].GetResponseRange().GetKvs(); len(kvs) == 0 || kvs[0].CreateRevision != h.Rev() {
			h.Lost(resp.Header.Revision)
			return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.Key(), h.Rev())
		}
	}
	return nil, queue.NotHeldBy(ml.hrs[0].Session(), ErrNotHeld, strings.Join(ml.names, ", "))
}

// Done returns a channel closed when the hold ends on any name (released,
// key deleted, session ended); closed at once when the value does not
// hold. The first call for a hold starts the watch of its keys. It does
// not block.
func (ml *MultiLock) Done() <-chan struct{} {
	mh := ml.current()
	if mh == nil {
		return queue.Closed
	}
	for _, h := range mh.hs {
		h.Done()
	}
	return mh.ctx.Done()
}

// Err returns nil while the value holds every name, else why the hold ended
// (the cause of the first name's hold to end), or ErrNotHeld when it never
// held.
func (ml *MultiLock) Err() error {
	if ml.bad != nil {
		return ml.bad
	}
	ml.mu.Lock()
	defer ml.mu.Unlock()
	switch {
	case ml.cur != nil:
		return context.Cause(ml.cur.ctx)
	case ml.last != nil:
		return ml.last
	}
	return ErrNotHeld
}

// Check is nil while the value holds every name, each hold is current and
// the session passes its Check; else why not. The first call for a hold
// starts the watch of its keys (as Done). It does not block.
func (ml *MultiLock) Check() error {
	mh := ml.current()
	if mh == nil {
		return ml.Err()
	}
	if err := context.Cause(mh.ctx); err != nil {
		return err
	}
	for i := range ml.hrs {
		if err := ml.hrs[i].Check(); err != nil {
			return err
		}
	}
	return nil
}
