package etcdsync

// The holder (type holder): what a primitive value (a Mutex, an Election,
// one side of an RWMutex, a Semaphore) keeps between calls: its slot and its
// current hold, and the calls every primitive shares on it (acquire,
// release, Run and its reentrancy, Do, Done, Err, the guard).

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// holder is the state every primitive value (Mutex, Election) keeps: its
// slot, and its current hold, if any. A primitive is "which keys, which
// guard" on top of it.
type holder struct {
	slot slot
	bad  error // why the name or session is unusable, or nil

	mu   sync.Mutex
	h    *hold
	n    int   // this value's shares of h (more than 1 only for read holds)
	last error // why the previous hold ended
}

func newHolder(s *Session, name, kind string) holder {
	sl, err := newSlot(s, name, kind)
	if err != nil {
		// The prefix still names a key, so that the always-false guard
		// is a comparison etcd accepts.
		sl.prefix = name + "/"
	}
	return holder{slot: sl, bad: err}
}

// acquire acquires a hold (see slot.acquire) and makes it current. It returns
// the value the key already had when it existed.
func (hr *holder) acquire(ctx context.Context, val string, md mode) ([]byte, error) {
	return hr.acquireAs(ctx, &hr.slot, val, md)
}

// acquireAs is acquire through sl: the holder's slot under the rule of this one
// acquire (a Semaphore's weight).
func (hr *holder) acquireAs(ctx context.Context, sl *slot, val string, md mode) ([]byte, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	h, value, err := sl.acquire(ctx, val, md)
	if err != nil {
		return nil, err
	}
	hr.addShare(h)
	return value, nil
}

// addShare makes h the value's hold and counts one more share of it.
func (hr *holder) addShare(h *hold) {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.h != h {
		hr.h, hr.n = h, 0
	}
	hr.n++
}

// release ends the current hold (unhold). For a shared hold it ends this
// value's share: the value's last share leaves the hold, and the session's
// last share releases the key. When that release fails with the hold still
// there, the value holds again (one share), so it can be retried, and
// nobody joins the hold any more (hold.kept). An ended ctx sends nothing and
// changes nothing.
func (hr *holder) release(ctx context.Context) error {
	h, err := hr.held(ErrLockReleased)
	if err != nil {
		return err
	}
	if !h.rule.shared {
		return h.unhold(ctx)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("etcdsync: release %s: %w", h.key, err)
	}
	hr.mu.Lock()
	if hr.h != h { // another goroutine released this value's last share meanwhile
		hr.mu.Unlock()
		return fmt.Errorf("%w: %s is not held by this value", ErrLockReleased, hr.slot.name())
	}
	for e := holdIn(ctx); e != nil; e = e.outer {
		if e.h == h && e.left.CompareAndSwap(false, true) { // fn ends its RRun's share: RRun will not
			break
		}
	}
	if hr.n--; hr.n == 0 {
		hr.h, hr.last = nil, fmt.Errorf("%w: %s released by this value", ErrLockReleased, h.key)
	}
	hr.mu.Unlock()
	if !h.leave() {
		return nil
	}
	err = h.unhold(ctx)
	if err != nil && h.live() {
		h.kept()
		hr.addShare(h)
	}
	return err
}

// abandon ends the current hold after a failure that leaves it unwanted: it
// removes the key (bounded, as a cleanup) and frees the reservation.
func (hr *holder) abandon() error {
	h := hr.current()
	if h == nil {
		return nil
	}
	err := h.slot.withdraw(h.rev)
	h.stop(fmt.Errorf("%w: abandoned after a failed campaign", ErrNotHeld))
	hr.current()
	return err
}

// current returns the live hold, or nil (recording why the last one ended).
func (hr *holder) current() *hold {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.h != nil && !hr.h.live() {
		hr.h.finish(nil) // frees the key's reservation when the session ended
		hr.last, hr.h, hr.n = hr.h.err(), nil, 0
	}
	return hr.h
}

// held returns the live hold, or an error wrapping notHeld (and
// ErrInvalidArgument when the client was closed).
func (hr *holder) held(notHeld error) (*hold, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	if h := hr.current(); h != nil {
		return h, nil
	}
	return nil, notHeldBy(hr.slot.s, notHeld, hr.slot.name())
}

func (hr *holder) do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	h, err := hr.held(ErrNotHeld)
	if err != nil {
		return nil, err
	}
	return h.do(ctx, ops...)
}

func (hr *holder) key() string {
	if h := hr.current(); h != nil {
		return h.key
	}
	return ""
}

func (hr *holder) rev() int64 {
	if h := hr.current(); h != nil {
		return h.rev
	}
	return 0
}

func (hr *holder) header() *pb.ResponseHeader {
	if h := hr.current(); h != nil {
		return h.header()
	}
	return nil
}

func (hr *holder) guard() clientv3.Cmp { return hr.current().guard(hr.slot.prefix) }

func (hr *holder) done() <-chan struct{} {
	if h := hr.current(); h != nil {
		return h.done()
	}
	return closed
}

// check is the Check of every primitive: nil while the value holds, its
// hold is current and its session passes Check; else why not. The first
// call for a hold starts its loss watch (as Done does), so a key deleted
// behind the holder's back shows within a watch round trip.
func (hr *holder) check() error {
	if hr.bad != nil {
		return hr.bad
	}
	h := hr.current()
	if h == nil {
		return hr.err()
	}
	h.done()
	if err := h.s.Check(); err != nil {
		return err
	}
	return h.err()
}

func (hr *holder) err() error {
	if hr.current() != nil {
		return nil
	}
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.last == nil {
		return ErrNotHeld
	}
	return hr.last
}

var closed = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// run is the Run of every primitive: it takes a hold (acquire, bounded by ctx),
// calls fn with a context that ends when ctx ends or, with the hold's cause
// (context.Cause), the moment the hold ends, and releases the hold (release)
// once fn has returned or panicked, bounded by the session's TTL whatever ctx
// says; a panic goes on after the release. It returns acquire's error, or fn's
// error joined with why the hold ended if it ended before the release (unless
// fn's error wraps that already: see stated), and with the release's error. fn's context carries the hold (n: its permits;
// tag: what else a Run inside must agree on, an Election's value or a
// Semaphore's capacity): a Run whose ctx carries a live hold of the same
// session and name enters it (see reenter), and returns fn's error joined
// with why the hold ended if it ended meanwhile.
func (hr *holder) run(ctx context.Context, n int64, tag string, acquire, release func(context.Context) error, fn func(context.Context) error) (err error) {
	if e, err := hr.reenter(ctx, n, tag); err != nil || e != nil {
		if err != nil {
			return err
		}
		err = fn(ctx)
		if cause := e.h.err(); !errors.Is(cause, ErrLockReleased) {
			err = stated(err, cause)
		}
		return err
	}
	if err := acquire(ctx); err != nil {
		return err
	}
	h := hr.current()
	if h == nil { // ended as it began
		return hr.err()
	}
	h.done() // watch the key: a delete behind our back ends fn's context
	hctx := h.context()
	e := &ctxHold{h: h, n: n, tag: tag, outer: holdIn(ctx)}
	fctx, cancel := context.WithCancelCause(context.WithValue(ctx, ctxHoldKey{}, e))
	defer cancel(nil)
	stop := context.AfterFunc(hctx, func() { cancel(context.Cause(hctx)) })
	defer stop()
	leave, handedOver := h.addRun(cancel)
	defer leave() // after the release below: a Handover waits for both
	defer func() {
		p := recover()
		cause, released := e.afterRun(ctx, release)
		err = stated(stated(err, cause), released)
		if p != nil {
			panic(p)
		}
	}()
	if handedOver { // between the acquire and now: fn must not run beside the successor
		return fmt.Errorf("%w: %s was handed over before fn ran", ErrLockReleased, h.key)
	}
	return fn(fctx)
}

// reenter returns the live hold ctx carries that a Run of this session and
// name, for n permits and tag, enters: the same kind of hold (a Mutex in a
// Mutex, a read or a write in a write of an RWMutex, a read in a read,
// permits within those held, the same Election value or Semaphore
// capacity). A hold ctx carries that such a Run could never get (a write
// inside a read, more permits, another value or capacity, another kind of
// primitive on the same key) is an error wrapping ErrInvalidArgument, not a
// deadlock. With neither, it returns nil.
func (hr *holder) reenter(ctx context.Context, n int64, tag string) (*ctxHold, error) {
	sl := &hr.slot
	for e := holdIn(ctx); e != nil; e = e.outer {
		h := e.h
		sameKey, sameName := h.key == sl.key, h.prefix == sl.prefix && h.kind == sl.kind
		switch {
		case h.s != sl.s || !h.live() || !sameKey && !sameName:
			continue // another lock (an RWMutex and a Mutex on one name use other keys)
		case !sameName: // a Mutex, an Election, a Semaphore on one name; a Mutex on NAME/write
			return nil, fmt.Errorf("%w: %s is held by a %s Run of this context", ErrInvalidArgument, h.key, h.kind)
		case e.tag != tag:
			return nil, fmt.Errorf("%w: a Run of %s with %q inside one with %q", ErrInvalidArgument, sl.name(), tag, e.tag)
		case h.rule.dir == sl.rule.dir && n <= e.n, sl.rule.shared: // same hold, or a read in a write
			return e, nil
		case n > e.n:
			return nil, fmt.Errorf("%w: a Run for %d permits of %s inside one holding %d", ErrInvalidArgument, n, sl.name(), e.n)
		default:
			return nil, fmt.Errorf("%w: a write Run inside a read Run of %s could never be granted", ErrInvalidArgument, sl.name())
		}
	}
	return nil, nil
}
