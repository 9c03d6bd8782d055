package queue

// How every Run calls fn under its hold (RunIn); what Run's context carries
// (type ctxHold): the holds of the Runs it is inside, innermost first, so
// that a Run inside fn (given fn's context) enters the hold that is already
// there (Holder.Run, Holder.reenter), and HoldFrom finds them; how Run
// states a hold's cause once; and the Runs under a hold as a Handover sees
// them (type runSet).

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
)

// RunIn is how every Run calls fn under its hold: with a context that is
// inner (the caller's, carrying the holds) and that ends, with hctx's cause,
// the moment hctx (the hold's) ends. Once fn has returned or panicked it
// calls after with fn's error (the release, stating why the hold ended) and
// returns what after returns; a panic goes on after that. begin, when not
// nil, runs first with the function that ends fn's context: it returns a
// function to call once after has returned (or nil), and an error that, when
// not nil, is what after gets instead of fn being called.
func RunIn(inner, hctx context.Context, begin func(stop context.CancelCauseFunc) (func(), error), after func(error) error, fn func(context.Context) error) (err error) {
	fctx, cancel := context.WithCancelCause(inner)
	defer cancel(nil)
	stop := context.AfterFunc(hctx, func() { cancel(context.Cause(hctx)) })
	defer stop()
	var refused error
	if begin != nil {
		var leave func()
		leave, refused = begin(cancel)
		if leave != nil {
			defer leave()
		}
	}
	defer func() {
		p := recover()
		err = after(err)
		if p != nil {
			panic(p)
		}
	}()
	if refused != nil {
		return refused
	}
	return fn(fctx)
}

// afterRun releases the Run's hold after its fn, if it is still held and fn
// did not release it (its share, for a read hold) itself, bounded by the
// TTL; it returns why the hold ended otherwise (nil when it was released),
// and the release's error.
func (e *ctxHold) afterRun(ctx context.Context, release func(context.Context) error) (cause, released error) {
	h := e.h
	if h.Live() && !e.left.Load() {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), h.session.ttl)
		defer cancel()
		released = release(rctx)
	}
	cause = h.Err()
	if errors.Is(cause, ErrLockReleased) { // released: by us, or by fn itself
		return nil, released
	}
	if cause != nil && errors.Is(released, ErrLockReleased) {
		released = nil // the release found the hold gone: the cause says why
	}
	return cause, released
}

// Stated is fn's error err joined with cause (why the hold ended under fn,
// or what its release failed at) unless err already wraps it, as when fn
// returned context.Cause of its context: each is stated once, and errors.Is
// finds it either way. With nothing to add, err comes back as it is.
func Stated(err, cause error) error {
	if cause == nil || errors.Is(err, cause) {
		return err
	}
	return errors.Join(err, cause)
}

// runSet is the Runs under a hold, as a Handover sees them.
type runSet struct {
	mu      sync.Mutex
	runs    map[*running]struct{} // nil until one starts
	handing bool                  // a Handover has begun: no Run starts its work
}

// add registers a Run whose work stop cancels; the returned function,
// called once the Run has released, unregisters it. When a Handover has
// begun (stop), it reports handedOver: the Run must not start its work.
func (rs *runSet) add(stop context.CancelCauseFunc) (leave func(), handedOver bool) {
	r := &running{stop: stop, over: make(chan struct{})}
	rs.mu.Lock()
	if rs.runs == nil {
		rs.runs = make(map[*running]struct{})
	}
	rs.runs[r] = struct{}{}
	handedOver = rs.handing
	rs.mu.Unlock()
	return func() {
		rs.mu.Lock()
		delete(rs.runs, r)
		rs.mu.Unlock()
		close(r.over)
	}, handedOver
}

// stop begins a Handover: no Run added from now on starts its work, and the
// work of every Run in the set is cancelled with cause. It returns channels
// that close as each Run has released.
func (rs *runSet) stop(cause error) []chan struct{} {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	rs.handing = true
	var over []chan struct{}
	for r := range rs.runs {
		r.stop(cause)
		over = append(over, r.over)
	}
	return over
}

// running is a Run under a hold, as a Handover sees it: how to stop its
// work, and a channel closed once the Run has released the hold (or found
// it gone).
type running struct {
	stop context.CancelCauseFunc
	over chan struct{}
}

// ctxHold is a hold that a Run's context carries, innermost first.
type ctxHold struct {
	h     *Hold
	n     int64       // permits (1 but for a Semaphore)
	tag   string      // an Election's value, a Semaphore's capacity
	left  atomic.Bool // fn released the Run's share of a read hold itself
	outer *ctxHold
}

type ctxHoldKey struct{}

// WithHolds returns ctx carrying hs, one permit each and no tag, inside the
// holds ctx carries already: the context of a MultiLock's Run.
func WithHolds(ctx context.Context, hs []*Hold) context.Context {
	e := holdIn(ctx)
	for _, h := range hs {
		e = &ctxHold{h: h, n: 1, outer: e}
	}
	return context.WithValue(ctx, ctxHoldKey{}, e)
}

// HoldFrom returns the key and create revision of the innermost hold ctx
// carries; ok is false when it carries none.
func HoldFrom(ctx context.Context) (key string, rev int64, ok bool) {
	e := holdIn(ctx)
	if e == nil {
		return "", 0, false
	}
	return e.h.key, e.h.rev, true
}

func holdIn(ctx context.Context) *ctxHold {
	e, _ := ctx.Value(ctxHoldKey{}).(*ctxHold)
	return e
}
