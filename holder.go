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
type Holder struct {
	Slot Slot
	Bad  error // why the name or session is unusable, or nil

	mu   sync.Mutex
	H    *Hold
	n    int   // this value's shares of h (more than 1 only for read holds)
	Last error // why the previous hold ended
}

func NewHolder(s *Session, name, kind string) Holder {
	sl, err := NewSlot(s, name, kind)
	if err != nil {
		// The prefix still names a key, so that the always-false guard
		// is a comparison etcd accepts.
		sl.Prefix = name + "/"
	}
	return Holder{Slot: sl, Bad: err}
}

// acquire acquires a hold (see slot.acquire) and makes it current. It returns
// the value the key already had when it existed.
func (hr *Holder) Acquire(ctx context.Context, val string, md Mode) ([]byte, error) {
	return hr.AcquireAs(ctx, &hr.Slot, val, md)
}

// acquireAs is acquire through sl: the holder's slot under the rule of this one
// acquire (a Semaphore's weight).
func (hr *Holder) AcquireAs(ctx context.Context, sl *Slot, val string, md Mode) ([]byte, error) {
	if hr.Bad != nil {
		return nil, hr.Bad
	}
	h, value, err := sl.acquire(ctx, val, md)
	if err != nil {
		return nil, err
	}
	hr.AddShare(h)
	return value, nil
}

// addShare makes h the value's hold and counts one more share of it.
func (hr *Holder) AddShare(h *Hold) {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.H != h {
		hr.H, hr.n = h, 0
	}
	hr.n++
}

// release ends the current hold (unhold). For a shared hold it ends this
// value's share: the value's last share leaves the hold, and the session's
// last share releases the key. When that release fails with the hold still
// there, the value holds again (one share), so it can be retried, and
// nobody joins the hold any more (hold.kept). An ended ctx sends nothing and
// changes nothing.
func (hr *Holder) Release(ctx context.Context) error {
	h, err := hr.Held(ErrLockReleased)
	if err != nil {
		return err
	}
	if !h.Rule.Shared {
		return h.Unhold(ctx)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("etcdsync: release %s: %w", h.Key, err)
	}
	hr.mu.Lock()
	if hr.H != h { // another goroutine released this value's last share meanwhile
		hr.mu.Unlock()
		return fmt.Errorf("%w: %s is not held by this value", ErrLockReleased, hr.Slot.Name())
	}
	for e := HoldIn(ctx); e != nil; e = e.Outer {
		if e.H == h && e.left.CompareAndSwap(false, true) { // fn ends its RRun's share: RRun will not
			break
		}
	}
	if hr.n--; hr.n == 0 {
		hr.H, hr.Last = nil, fmt.Errorf("%w: %s released by this value", ErrLockReleased, h.Key)
	}
	hr.mu.Unlock()
	if !h.leave() {
		return nil
	}
	err = h.Unhold(ctx)
	if err != nil && h.Live() {
		h.kept()
		hr.AddShare(h)
	}
	return err
}

// abandon ends the current hold after a failure that leaves it unwanted: it
// removes the key (bounded, as a cleanup) and frees the reservation.
func (hr *Holder) Abandon() error {
	h := hr.Current()
	if h == nil {
		return nil
	}
	err := h.Slot.Withdraw(h.Rev)
	h.stop(fmt.Errorf("%w: abandoned after a failed campaign", ErrNotHeld))
	hr.Current()
	return err
}

// current returns the live hold, or nil (recording why the last one ended).
func (hr *Holder) Current() *Hold {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.H != nil && !hr.H.Live() {
		hr.H.finish(nil) // frees the key's reservation when the session ended
		hr.Last, hr.H, hr.n = hr.H.Err(), nil, 0
	}
	return hr.H
}

// held returns the live hold, or an error wrapping notHeld (and
// ErrInvalidArgument when the client was closed).
func (hr *Holder) Held(notHeld error) (*Hold, error) {
	if hr.Bad != nil {
		return nil, hr.Bad
	}
	if h := hr.Current(); h != nil {
		return h, nil
	}
	return nil, NotHeldBy(hr.Slot.Session, notHeld, hr.Slot.Name())
}

func (hr *Holder) Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	h, err := hr.Held(ErrNotHeld)
	if err != nil {
		return nil, err
	}
	return h.do(ctx, ops...)
}

func (hr *Holder) Key() string {
	if h := hr.Current(); h != nil {
		return h.Key
	}
	return ""
}

func (hr *Holder) Rev() int64 {
	if h := hr.Current(); h != nil {
		return h.Rev
	}
	return 0
}

func (hr *Holder) Header() *pb.ResponseHeader {
	if h := hr.Current(); h != nil {
		return h.header()
	}
	return nil
}

func (hr *Holder) Guard() clientv3.Cmp { return hr.Current().Guard(hr.Slot.Prefix) }

func (hr *Holder) Done() <-chan struct{} {
	if h := hr.Current(); h != nil {
		return h.Done()
	}
	return Closed
}

// check is the Check of every primitive: nil while the value holds, its
// hold is current and its session passes Check; else why not. The first
// call for a hold starts its loss watch (as Done does), so a key deleted
// behind the holder's back shows within a watch round trip.
func (hr *Holder) Check() error {
	if hr.Bad != nil {
		return hr.Bad
	}
	h := hr.Current()
	if h == nil {
		return hr.Err()
	}
	h.Done()
	if err := h.Session.Check(); err != nil {
		return err
	}
	return h.Err()
}

func (hr *Holder) Err() error {
	if hr.Current() != nil {
		return nil
	}
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.Last == nil {
		return ErrNotHeld
	}
	return hr.Last
}

var Closed = func() chan struct{} {
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
func (hr *Holder) Run(ctx context.Context, n int64, tag string, acquire, release func(context.Context) error, fn func(context.Context) error) (err error) {
	if e, err := hr.Reenter(ctx, n, tag); err != nil || e != nil {
		if err != nil {
			return err
		}
		err = fn(ctx)
		if cause := e.H.Err(); !errors.Is(cause, ErrLockReleased) {
			err = Stated(err, cause)
		}
		return err
	}
	if err := acquire(ctx); err != nil {
		return err
	}
	h := hr.Current()
	if h == nil { // ended as it began
		return hr.Err()
	}
	h.Done() // watch the key: a delete behind our back ends fn's context
	hctx := h.Context()
	e := &CtxHold{H: h, N: n, tag: tag, Outer: HoldIn(ctx)}
	fctx, cancel := context.WithCancelCause(context.WithValue(ctx, CtxHoldKey{}, e))
	defer cancel(nil)
	stop := context.AfterFunc(hctx, func() { cancel(context.Cause(hctx)) })
	defer stop()
	leave, handedOver := h.addRun(cancel)
	defer leave() // after the release below: a Handover waits for both
	defer func() {
		p := recover()
		cause, released := e.afterRun(ctx, release)
		err = Stated(Stated(err, cause), released)
		if p != nil {
			panic(p)
		}
	}()
	if handedOver { // between the acquire and now: fn must not run beside the successor
		return fmt.Errorf("%w: %s was handed over before fn ran", ErrLockReleased, h.Key)
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
func (hr *Holder) Reenter(ctx context.Context, n int64, tag string) (*CtxHold, error) {
	sl := &hr.Slot
	for e := HoldIn(ctx); e != nil; e = e.Outer {
		h := e.H
		sameKey, sameName := h.Key == sl.Key, h.Prefix == sl.Prefix && h.Kind == sl.Kind
		switch {
		case h.Session != sl.Session || !h.Live() || !sameKey && !sameName:
			continue // another lock (an RWMutex and a Mutex on one name use other keys)
		case !sameName: // a Mutex, an Election, a Semaphore on one name; a Mutex on NAME/write
			return nil, fmt.Errorf("%w: %s is held by a %s Run of this context", ErrInvalidArgument, h.Key, h.Kind)
		case e.tag != tag:
			return nil, fmt.Errorf("%w: a Run of %s with %q inside one with %q", ErrInvalidArgument, sl.Name(), tag, e.tag)
		case h.Rule.Dir == sl.Rule.Dir && n <= e.N, sl.Rule.Shared: // same hold, or a read in a write
			return e, nil
		case n > e.N:
			return nil, fmt.Errorf("%w: a Run for %d permits of %s inside one holding %d", ErrInvalidArgument, n, sl.Name(), e.N)
		default:
			return nil, fmt.Errorf("%w: a write Run inside a read Run of %s could never be granted", ErrInvalidArgument, sl.Name())
		}
	}
	return nil, nil
}
