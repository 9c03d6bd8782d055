package queue

// The holder (type Holder) of a primitive value: what a Mutex, an
// Election, one side of an RWMutex or a Semaphore keeps between calls (its
// slot and its current hold), and the calls every primitive shares on it
// (acquire, release, Run and its reentrancy, Do, Done, Err, the guard).

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Holder is the state every primitive value (Mutex, Election) keeps: its
// slot, and its current hold, if any. A primitive is "which keys, which
// guard" on top of it.
type Holder struct {
	slot Slot
	bad  error // why the name, the session or the constructor's arguments are unusable (Refuse), or nil

	mu   sync.Mutex
	h    *Hold
	n    int   // this value's shares of h (more than 1 only for read holds)
	last error // why the previous hold ended
}

// NewHolder returns the holder of a value of kind (mutex, election, ...) on
// name for session s, its key placed and blocked under rule r. It does not
// touch etcd. An invalid name or a nil session is kept as Bad.
func NewHolder(s *Session, name, kind string, r *Rule) Holder {
	sl, err := NewSlot(s, name, kind, r)
	if err != nil {
		// The prefix still names a key, so that the always-false guard
		// is a comparison etcd accepts.
		sl.prefix = name + "/"
	}
	return Holder{slot: sl, bad: err}
}

// Refuse makes err the reason every call of the value fails (Bad), unless it
// has one already: a constructor's check of its own arguments.
func (hr *Holder) Refuse(err error) {
	if hr.bad == nil {
		hr.bad = err
	}
}

// Bad is why the name, the session or the constructor's arguments are
// unusable, or nil.
func (hr *Holder) Bad() error { return hr.bad }

// Name is the primitive's name.
func (hr *Holder) Name() string { return hr.slot.Name() }

// Prefix is the name's prefix NAME/.
func (hr *Holder) Prefix() string { return hr.slot.Prefix() }

// Session is the holder's session (nil when the value was given none).
func (hr *Holder) Session() *Session { return hr.slot.Session() }

// Resume makes the hold this session's key at rev already is (a restarted
// process's, WithLease) the value's hold, as ResumeElection does; it does
// not touch etcd. When key is not the holder's key, or rev not a revision,
// or the key is in use by another value of the session, the value does not
// hold and Err says why. A Bad holder is left as it is.
func (hr *Holder) Resume(key string, rev int64) {
	if hr.bad != nil {
		return
	}
	if key != hr.slot.key || rev <= 0 {
		hr.last = fmt.Errorf("%w: leader key %q at revision %d is not this session's key %q", ErrInvalidArgument, key, rev, hr.slot.key)
		return
	}
	h, err := hr.slot.resume(rev)
	if err != nil {
		hr.last = err
		return
	}
	hr.h = h
}

// Acquire acquires a hold (see Slot.acquire) and makes it current. It returns
// the value the key already had when it existed.
func (hr *Holder) Acquire(ctx context.Context, val string, md Mode) ([]byte, error) {
	return hr.acquire(ctx, &hr.slot, val, md)
}

// AcquireUnder is Acquire under rule r for this one acquire instead of the
// holder's (a Semaphore's request for some permits).
func (hr *Holder) AcquireUnder(ctx context.Context, r *Rule, val string, md Mode) ([]byte, error) {
	sl := hr.slot
	sl.rule = r
	return hr.acquire(ctx, &sl, val, md)
}

// acquire is Acquire through sl: the holder's slot, or a copy of it under
// the rule of one acquire.
func (hr *Holder) acquire(ctx context.Context, sl *Slot, val string, md Mode) ([]byte, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	h, value, err := sl.acquire(ctx, val, md)
	if err != nil {
		return nil, err
	}
	hr.AddShare(h)
	return value, nil
}

// AcquireAll acquires a hold on each of hrs's keys at once, all or none (see
// acquireSlots: one transaction writes them all; a MultiLock), and returns
// them in the order of hrs without making them current: the caller does
// (AddShare). No holder may be Bad.
func AcquireAll(ctx context.Context, hrs []Holder, val string, md Mode) ([]*Hold, error) {
	sls := make([]*Slot, len(hrs))
	for i := range hrs {
		sls[i] = &hrs[i].slot
	}
	hs, _, err := acquireSlots(ctx, sls, val, md)
	return hs, err
}

// AddShare makes h the value's hold and counts one more share of it.
func (hr *Holder) AddShare(h *Hold) {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.h != h {
		hr.h, hr.n = h, 0
	}
	hr.n++
}

// Release ends the current hold (unhold). For a shared hold it ends this
// value's share: the value's last share leaves the hold, and the session's
// last share releases the key. When that release fails with the hold still
// there, the value holds again (one share), so it can be retried, and
// nobody joins the hold any more (Hold.kept). An ended ctx sends nothing and
// changes nothing.
func (hr *Holder) Release(ctx context.Context) error {
	h, err := hr.Held(ErrLockReleased)
	if err != nil {
		return err
	}
	if !h.rule.shared {
		return h.Unhold(ctx)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("etcdsync: release %s: %w", h.key, err)
	}
	hr.mu.Lock()
	if hr.h != h { // another goroutine released this value's last share meanwhile
		hr.mu.Unlock()
		return fmt.Errorf("%w: %s is not held by this value", ErrLockReleased, hr.slot.Name())
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
	err = h.Unhold(ctx)
	if err != nil && h.Live() {
		h.kept()
		hr.AddShare(h)
	}
	return err
}

// Abandon ends the current hold after a failure that leaves it unwanted: it
// removes the key (bounded, as a cleanup) and frees the reservation.
func (hr *Holder) Abandon() error {
	h := hr.Current()
	if h == nil {
		return nil
	}
	err := h.Slot.Withdraw(h.rev)
	h.stop(fmt.Errorf("%w: abandoned after a failed campaign", ErrNotHeld))
	hr.Current()
	return err
}

// Current returns the live hold, or nil (recording why the last one ended).
func (hr *Holder) Current() *Hold {
	hr.mu.Lock()
	defer hr.mu.Unlock()
	if hr.h != nil && !hr.h.Live() {
		hr.h.finish(nil) // frees the key's reservation when the session ended
		hr.last, hr.h, hr.n = hr.h.Err(), nil, 0
	}
	return hr.h
}

// Held returns the live hold, or an error wrapping notHeld (and
// ErrInvalidArgument when the client was closed).
func (hr *Holder) Held(notHeld error) (*Hold, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	if h := hr.Current(); h != nil {
		return h, nil
	}
	return nil, NotHeldBy(hr.slot.session, notHeld, hr.slot.Name())
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
		return h.key
	}
	return ""
}

func (hr *Holder) Rev() int64 {
	if h := hr.Current(); h != nil {
		return h.rev
	}
	return 0
}

func (hr *Holder) Header() *pb.ResponseHeader {
	if h := hr.Current(); h != nil {
		return h.header()
	}
	return nil
}

func (hr *Holder) Guard() clientv3.Cmp { return hr.Current().Guard(hr.slot.prefix) }

func (hr *Holder) Done() <-chan struct{} {
	if h := hr.Current(); h != nil {
		return h.Done()
	}
	return Closed
}

// Check is the Check of every primitive: nil while the value holds, its
// hold is current and its session passes Check; else why not. The first
// call for a hold starts its loss watch (as Done does), so a key deleted
// behind the holder's back shows within a watch round trip.
func (hr *Holder) Check() error {
	if hr.bad != nil {
		return hr.bad
	}
	h := hr.Current()
	if h == nil {
		return hr.Err()
	}
	h.Done()
	if err := h.session.Check(); err != nil {
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
	if hr.last == nil {
		return ErrNotHeld
	}
	return hr.last
}

var Closed = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// Run is the Run of every primitive: it takes a hold (acquire, bounded by ctx),
// calls fn with a context that ends when ctx ends or, with the hold's cause
// (context.Cause), the moment the hold ends, and releases the hold (release)
// once fn has returned or panicked, bounded by the session's TTL whatever ctx
// says; a panic goes on after the release. It returns acquire's error, or fn's
// error joined with why the hold ended if it ended before the release (unless
// fn's error wraps that already: see Stated), and with the release's error.
// fn's context carries the hold (n: its permits; tag: what else a Run inside
// must agree on, an Election's value or a Semaphore's capacity): a Run whose
// ctx carries a live hold of the same session and name enters it (see
// reenter), and returns fn's error joined with why the hold ended if it
// ended meanwhile.
func (hr *Holder) Run(ctx context.Context, n int64, tag string, acquire, release func(context.Context) error, fn func(context.Context) error) (err error) {
	if e, err := hr.reenter(ctx, n, tag); err != nil || e != nil {
		if err != nil {
			return err
		}
		err = fn(ctx)
		if cause := e.h.Err(); !errors.Is(cause, ErrLockReleased) {
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
	e := &ctxHold{h: h, n: n, tag: tag, outer: holdIn(ctx)}
	begin := func(cancel context.CancelCauseFunc) (func(), error) {
		uncount, ended := h.session.BeginRun(h.Context())
		unregister, handedOver := h.addRun(cancel)
		leave := func() { unregister(); uncount() } // after the release: a Handover and a Close wait for both
		switch {
		case ended != nil:
			return leave, ended
		case handedOver: // between the acquire and now: fn must not run beside the successor
			return leave, fmt.Errorf("%w: %s was handed over before fn ran", ErrLockReleased, h.key)
		}
		return leave, nil
	}
	after := func(err error) error {
		cause, released := e.afterRun(ctx, release)
		return Stated(Stated(err, cause), released)
	}
	return RunIn(context.WithValue(ctx, ctxHoldKey{}, e), h.Context(), begin, after, fn)
}

// Reenters reports whether a Run of this session and name for n permits
// and tag, given ctx, enters a hold ctx carries (see reenter); an error
// wraps ErrInvalidArgument.
func (hr *Holder) Reenters(ctx context.Context, n int64, tag string) (bool, error) {
	e, err := hr.reenter(ctx, n, tag)
	return e != nil, err
}

// reenter returns the live hold ctx carries that a Run of this session and
// name, for n permits and tag, enters: the same kind of hold (a Mutex in a
// Mutex, a read or a write in a write of an RWMutex, a read in a read,
// permits within those held, the same Election value or Semaphore
// capacity). A hold ctx carries that such a Run could never get (a write
// inside a read, more permits, another value or capacity, another kind of
// primitive on the same key) is an error wrapping ErrInvalidArgument, not a
// deadlock. With neither, it returns nil.
func (hr *Holder) reenter(ctx context.Context, n int64, tag string) (*ctxHold, error) {
	sl := &hr.slot
	for e := holdIn(ctx); e != nil; e = e.outer {
		h := e.h
		sameKey, sameName := h.key == sl.key, h.prefix == sl.prefix && h.kind == sl.kind
		switch {
		case h.session != sl.session || !h.Live() || !sameKey && !sameName:
			continue // another lock (an RWMutex and a Mutex on one name use other keys)
		case !sameName: // a Mutex, an Election, a Semaphore on one name; a Mutex on NAME/write
			return nil, fmt.Errorf("%w: %s is held by a %s Run of this context", ErrInvalidArgument, h.key, h.kind)
		case e.tag != tag:
			return nil, fmt.Errorf("%w: a Run of %s with %q inside one with %q", ErrInvalidArgument, sl.Name(), tag, e.tag)
		case h.rule.dir == sl.rule.dir && n <= e.n, sl.rule.shared: // same hold, or a read in a write
			return e, nil
		case n > e.n:
			return nil, fmt.Errorf("%w: a Run for %d permits of %s inside one holding %d", ErrInvalidArgument, n, sl.Name(), e.n)
		default:
			return nil, fmt.Errorf("%w: a write Run inside a read Run of %s could never be granted", ErrInvalidArgument, sl.Name())
		}
	}
	return nil, nil
}
