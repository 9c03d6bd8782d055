package etcdsync

// The holder: what a primitive value (a Mutex, an Election, one side of an
// RWMutex, a Semaphore) keeps between calls: its slot and its current hold,
// and the calls every primitive shares on it (acquire, release, Do, Done,
// Err, the guard).

import (
	"context"
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
