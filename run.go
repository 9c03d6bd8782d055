package etcdsync

// Run: take a hold, run a function under it with a context that ends the
// moment the hold ends, release it after; and reentrancy, a Run inside fn
// (given fn's context) entering the hold that is already there.

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
)

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

// afterRun releases the Run's hold after its fn, if it is still held and fn
// did not release it (its share, for a read hold) itself, bounded by the
// TTL; it returns why the hold ended otherwise (nil when it was released),
// and the release's error.
func (e *ctxHold) afterRun(ctx context.Context, release func(context.Context) error) (cause, released error) {
	h := e.h
	if h.live() && !e.left.Load() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.s.ttl)
		defer cancel()
		released = release(rctx)
	}
	cause = h.err()
	if errors.Is(cause, ErrLockReleased) { // released: by us, or by fn itself
		return nil, released
	}
	if cause != nil && errors.Is(released, ErrLockReleased) {
		released = nil // the release found the hold gone: the cause says why
	}
	return cause, released
}

// stated is fn's error err joined with cause (why the hold ended under fn,
// or what its release failed at) unless err already wraps it, as when fn
// returned context.Cause of its context: each is stated once, and errors.Is
// finds it either way. With nothing to add, err comes back as it is.
func stated(err, cause error) error {
	if cause == nil || errors.Is(err, cause) {
		return err
	}
	return errors.Join(err, cause)
}

// running is a Run under a hold, as a Handover sees it: how to stop its
// work, and a channel closed once the Run has released the hold (or found
// it gone).
type running struct {
	stop context.CancelCauseFunc
	over chan struct{}
}

// addRun registers a Run under h, whose work stop cancels; the returned
// function, called once the Run has released, unregisters it. When a
// Handover has begun on h (stopRuns), it reports handedOver: the Run must
// not start its work.
func (h *hold) addRun(stop context.CancelCauseFunc) (leave func(), handedOver bool) {
	r := &running{stop: stop, over: make(chan struct{})}
	h.mu.Lock()
	x := h.extraLocked()
	if x.runs == nil {
		x.runs = make(map[*running]struct{})
	}
	x.runs[r] = struct{}{}
	handedOver = x.handing
	h.mu.Unlock()
	return func() {
		h.mu.Lock()
		delete(x.runs, r)
		h.mu.Unlock()
		close(r.over)
	}, handedOver
}

// stopRuns begins a Handover of h: no Run registered from now on starts its
// work, and the work of every Run under h is cancelled with cause. It
// returns channels that close as each Run has released.
func (h *hold) stopRuns(cause error) []chan struct{} {
	h.mu.Lock()
	defer h.mu.Unlock()
	x := h.extraLocked()
	x.handing = true
	var over []chan struct{}
	for r := range x.runs {
		r.stop(cause)
		over = append(over, r.over)
	}
	return over
}

// ctxHold is a hold that a Run's context carries, innermost first.
type ctxHold struct {
	h     *hold
	n     int64       // permits (1 but for a Semaphore)
	tag   string      // an Election's value, a Semaphore's capacity
	left  atomic.Bool // fn released the Run's share of a read hold itself
	outer *ctxHold
}

type ctxHoldKey struct{}

func holdIn(ctx context.Context) *ctxHold {
	e, _ := ctx.Value(ctxHoldKey{}).(*ctxHold)
	return e
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

// HoldFrom returns the innermost hold that ctx carries (the context a Run
// hands to its fn, or one derived from it): its key and fencing token (the
// key's create revision), to pass along with fn's writes to other systems.
// ok is false when ctx carries none. It does not touch etcd; the hold may
// have ended since (then fn's context has ended too).
func HoldFrom(ctx context.Context) (key string, rev int64, ok bool) {
	e := holdIn(ctx)
	if e == nil {
		return "", 0, false
	}
	return e.h.key, e.h.rev, true
}
