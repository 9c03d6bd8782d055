package queue

// A held key (type Hold): the state a primitive value has while it holds
// (Done, Err and the causes of loss), the watch that learns of its loss,
// and the Runs under it (run.go). Its guarded writes and fenced release are
// in fence.go; the holder that keeps it between calls in holder.go.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Hold is one held key: the state a Mutex or Election value has while it
// holds. It ends with the session, or earlier (finish). Loss detection (Done)
// and the hold's context start lazily: a hold nobody asked about costs no
// goroutine, no watch and no context.
type Hold struct {
	*Slot     // the holder's
	rev       int64
	start     startHeader  // of the revision at which the hold began
	releasing atomic.Int32 // Unlocks in flight: a delete seen meanwhile may be theirs
	shares    int32        // values of the session that share the hold (s.reg.mu; 1 but for read holds)
	over      atomic.Bool  // finish ran
	closing   bool         // its last share is releasing it: nobody joins (s.reg.mu)

	mu    sync.Mutex
	cause error      // why it ended, once over
	x     *holdExtra // what only some holds need; nil until one does (extra)
	once  sync.Once  // finish
}

// holdExtra is the part of a hold that only a hold someone asked about
// needs (Done, Run, Proclaim, Handover), kept apart so that a plain held
// lock stays small.
type holdExtra struct {
	writing sync.Mutex // one write of the key's value (put) at a time
	wrote   int64      // the key's mod revision after our last put (writing); 0: its create

	// under Hold.mu:
	last    *pb.ResponseHeader      // of the last write through the hold (Proclaim)
	ctx     context.Context         // ends with the hold; nil until asked for
	end     context.CancelCauseFunc // ends ctx
	runs    map[*running]struct{}   // the Runs under the hold (run.go); nil until one starts
	handing bool                    // a Handover has begun: no Run starts its work

	release context.CancelFunc // cancels the release in flight (Unhold), if any, when the hold ends

	watchOnce sync.Once     // start or forbid the watch
	watched   chan struct{} // closed when the watch returns; nil if never started
}

// extraLocked returns h's extra part, made on first use. h.mu is held.
func (h *Hold) extraLocked() *holdExtra {
	if h.x == nil {
		h.x = &holdExtra{}
	}
	return h.x
}

// extra is extraLocked for a caller without h.mu.
func (h *Hold) extra() *holdExtra {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.extraLocked()
}

// newHold makes the hold of a key this session reserved (claimKey); the hold
// frees the reservation when it finishes.
func newHold(sl *Slot, rev int64, hdr *pb.ResponseHeader) *Hold {
	h := &Hold{Slot: sl, rev: rev, shares: 1, start: startHeader{cluster: hdr.ClusterId, member: hdr.MemberId, rev: hdr.Revision, term: hdr.RaftTerm}}
	sl.session.reg.mu.Lock()
	use := sl.session.reg.keys[sl.key]
	use.hold = h
	sl.session.reg.keys[sl.key] = use
	if sl.rule.shared {
		sl.session.reg.wakeLocked(sl.key) // those waiting to share it join
	}
	sl.session.reg.mu.Unlock()
	return h
}

// leave drops one share of h and reports whether it was the last, which
// then releases the key (unhold) while nobody joins.
func (h *Hold) leave() bool {
	h.session.reg.mu.Lock()
	defer h.session.reg.mu.Unlock()
	h.shares--
	h.closing = h.shares == 0
	return h.closing
}

// kept takes back the last share after its release failed with the hold
// seemingly still there. Its delete may have committed, or may yet: nobody
// joins the hold any more (it stays closing), and its watch, started here,
// ends it if the key goes.
func (h *Hold) kept() {
	h.session.reg.mu.Lock()
	h.shares++
	h.session.reg.mu.Unlock()
	h.Done()
}

// check reads h's key: while the key is h's it returns the read's revision;
// when the key is gone or replaced it ends h and returns an error wrapping
// ErrNotHeld.
func (h *Hold) check(ctx context.Context) (int64, error) {
	resp, err := h.session.client.Get(ctx, h.key)
	if err != nil {
		return 0, err
	}
	if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != h.rev {
		h.Lost(resp.Header.Revision)
		return 0, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
	}
	return resp.Header.Revision, nil
}

// Context returns a context that ends when the hold ends, with its cause.
func (h *Hold) Context() context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	x := h.extraLocked()
	switch {
	case x.ctx != nil:
	case h.over.Load(): // with its own cause, whether or not the session ended since
		x.ctx, x.end = context.WithCancelCause(context.WithoutCancel(h.session.ctx))
		x.end(h.cause)
	default:
		x.ctx, x.end = context.WithCancelCause(h.session.ctx)
	}
	return x.ctx
}

// Advance records the header of a later write through the hold (Proclaim);
// headers only move forward.
func (h *Hold) Advance(hdr *pb.ResponseHeader) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if x := h.extraLocked(); x.last == nil || hdr.Revision > x.last.Revision {
		x.last = hdr
	}
}

// startHeader is the header a hold began with, kept as values rather than
// as the response's message, so that a held lock stays small.
type startHeader struct {
	cluster, member uint64
	rev             int64
	term            uint64
}

// header is the header of the last write through the hold, or of its start.
func (h *Hold) header() *pb.ResponseHeader {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.x != nil && h.x.last != nil && h.x.last.Revision > h.start.rev {
		return h.x.last
	}
	return &pb.ResponseHeader{ClusterId: h.start.cluster, MemberId: h.start.member, Revision: h.start.rev, RaftTerm: h.start.term}
}

// Inherited reports whether h's key was created before the session began: a
// hold of a restarted process that this session adopted (WithLease).
func (h *Hold) Inherited() bool { return h.rev <= h.session.startRev }

// Rev is the hold's fencing token: its key's create revision.
func (h *Hold) Rev() int64 { return h.rev }

// Live reports whether h is a hold that has not ended.
func (h *Hold) Live() bool { return h != nil && !h.over.Load() && h.session.ctx.Err() == nil }

// finish ends the hold with cause (the session's, if it has ended) and frees
// the key's reservation, once.
func (h *Hold) finish(cause error) {
	h.once.Do(func() {
		h.mu.Lock()
		if h.session.ctx.Err() != nil || cause == nil {
			cause = context.Cause(h.session.ctx)
		}
		if cause == nil { // not reached: nil is passed only once the hold or session ended
			cause = ErrNotHeld
		}
		h.cause = cause
		h.over.Store(true)
		var end context.CancelCauseFunc
		var release context.CancelFunc
		if h.x != nil {
			end, release = h.x.end, h.x.release
		}
		h.mu.Unlock()
		if release != nil {
			release()
		}
		if rep := h.session.rep; rep != nil {
			rep.HoldEnded(h, cause) // before Done closes
		}
		if end != nil {
			end(cause)
		}
		h.session.reg.releaseKey(h.key)
	})
}

// stop finishes the hold and waits for its watch, if any.
func (h *Hold) stop(cause error) {
	h.finish(cause)
	h.mu.Lock()
	x := h.x
	h.mu.Unlock()
	if x == nil { // never asked about: no watch; a later done finds the hold over
		return
	}
	x.watchOnce.Do(func() {})
	if x.watched != nil {
		<-x.watched
	}
}

// Done returns a channel closed when the hold ends, starting the watch that
// notices a key deleted behind our back.
func (h *Hold) Done() <-chan struct{} {
	ctx := h.Context()
	x := h.extra()
	x.watchOnce.Do(func() {
		if ctx.Err() != nil {
			return
		}
		watched := make(chan struct{})
		if h.session.goWatch(func() { defer close(watched); h.watchKey(ctx) }) {
			x.watched = watched
		}
	})
	return ctx.Done()
}

// Err returns nil while the hold lasts, else why it ended.
func (h *Hold) Err() error {
	if h.over.Load() {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.cause
	}
	if h.session.ctx.Err() != nil {
		return context.Cause(h.session.ctx)
	}
	return nil
}

// Lost ends the hold because its key is gone or replaced.
func (h *Hold) Lost(rev int64) {
	if h.releasing.Load() > 0 {
		h.finish(ErrLockReleased)
		return
	}
	h.finish(fmt.Errorf("%w: key %s gone by revision %d (lease expired or revoked, or deleted by someone)", ErrNotHeld, h.key, rev))
	h.session.checkLease()
}

// watchKey ends the hold when its key is deleted; hctx is the hold's context.
func (h *Hold) watchKey(hctx context.Context) {
	if rev, err := WatchGone(hctx, h.session.client, h.key, h.rev, h.start.rev+1); err == nil {
		h.Lost(rev)
	}
}

// WatchGone blocks until the incarnation of key created at rev is gone
// (deleted, or deleted and created again), watching from revision from (the
// key was there at from-1), and returns the revision at which it was seen
// gone. It keeps one watch; when the watch fails (compaction, a member
// restart, a lost leader) it reads the key once (linearizable) and watches
// again from that read, so it survives them. It returns ctx's error when ctx
// ends, and an error when the client is closed.
func WatchGone(ctx context.Context, cli *clientv3.Client, key string, rev, from int64) (int64, error) {
	for {
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		for wr := range cli.Watch(wctx, key, clientv3.WithRev(from), clientv3.WithFilterPut()) {
			if wr.Canceled {
				break
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					cancel()
					return ev.Kv.ModRevision, nil
				}
			}
			from = max(from, wr.Header.Revision+1)
		}
		cancel()
		if err := Pause(ctx); err != nil {
			return 0, err
		}
		resp, err := cli.Get(ctx, key)
		switch {
		case err != nil && cli.Ctx().Err() != nil:
			return 0, fmt.Errorf("etcdsync: watch %s: client closed: %w", key, err)
		case err != nil:
		case len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != rev:
			return resp.Header.Revision, nil
		default:
			from = resp.Header.Revision + 1
		}
	}
}

// cancelOnEnd makes the hold's end call cancel, a release's in flight, and
// reports true; cancelOnEnd(nil) undoes it. It is called at once when the
// hold has ended already. It reports false, changing nothing, when another
// release has the place.
func (h *Hold) cancelOnEnd(cancel context.CancelFunc) bool {
	h.mu.Lock()
	x := h.extraLocked()
	if cancel != nil && x.release != nil {
		h.mu.Unlock()
		return false
	}
	x.release = cancel
	over := h.over.Load()
	h.mu.Unlock()
	if over && cancel != nil {
		cancel()
	}
	return true
}

// addRun registers a Run under h, whose work stop cancels; the returned
// function, called once the Run has released, unregisters it. When a
// Handover has begun on h (stopRuns), it reports handedOver: the Run must
// not start its work.
func (h *Hold) addRun(stop context.CancelCauseFunc) (leave func(), handedOver bool) {
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

// StopRuns begins a Handover of h: no Run registered from now on starts its
// work, and the work of every Run under h is cancelled with cause. It
// returns channels that close as each Run has released.
func (h *Hold) StopRuns(cause error) []chan struct{} {
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
