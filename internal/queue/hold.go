package queue

// A held key (type Hold): the state a primitive value has while it holds
// (Done, Err and the causes of loss), the watch that learns of its loss
// (watchgone.go), the Runs under it (run.go), and its fenced writes: the
// guard (a comparison true only while the hold is current), Do and Put
// under it, and the release, which deletes a held key only while it is the
// hold's incarnation (its create revision), so that a retried or late
// release never deletes a newer hold (several at once: fence.go). The
// holder that keeps it between calls is in holder.go.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
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

	runs runSet // the Runs under the hold (run.go), under a lock of their own

	// under Hold.mu:
	last *pb.ResponseHeader      // of the last write through the hold (Proclaim)
	ctx  context.Context         // ends with the hold; nil until asked for
	end  context.CancelCauseFunc // ends ctx

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

// addRun registers a Run under h, whose work stop cancels (see runSet.add).
func (h *Hold) addRun(stop context.CancelCauseFunc) (leave func(), handedOver bool) {
	return h.extra().runs.add(stop)
}

// StopRuns begins a Handover of h: no Run registered from now on starts its
// work, and the work of every Run under h is cancelled with cause. It
// returns channels that close as each Run has released.
func (h *Hold) StopRuns(cause error) []chan struct{} {
	return h.extra().runs.stop(cause)
}

// Guard is the comparison that holds while h is the current hold; with no
// hold it is a valid comparison that is always false.
func (h *Hold) Guard(prefix string) clientv3.Cmp {
	if !h.Live() {
		return clientv3.Compare(clientv3.CreateRevision(prefix), "<", 0)
	}
	return clientv3.Compare(clientv3.CreateRevision(h.key), "=", h.rev)
}

// do runs ops in one transaction only while h is current. When the hold is
// gone it ends h and returns an error wrapping ErrNotHeld.
func (h *Hold) do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if !h.Live() {
		return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
	}
	// The Else range keeps the transaction linearizable: one of compares and
	// serializable reads alone is served by any member, which may lag.
	resp, err := h.session.client.Txn(ctx).If(h.Guard(h.prefix)).Then(ops...).Else(clientv3.OpGet(h.key, clientv3.WithCountOnly())).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdsync: guarded transaction on %s: %w", h.key, err)
	}
	if !resp.Succeeded {
		h.Lost(resp.Header.Revision)
		return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
	}
	return resp, nil
}

// Put sets the key's value while h is current, and only over the value of
// our last put (or the create): a put of ours that the server applies late,
// after a newer one, finds the key changed and writes nothing. When the key
// has changed since our last put (such a late put of ours landed first, or
// someone else's), the newer put writes over it. Puts run one at a time.
// When the hold is gone it ends h and returns an error wrapping ErrNotHeld.
func (h *Hold) Put(ctx context.Context, val string) (*pb.ResponseHeader, error) {
	x := h.extra()
	x.writing.Lock()
	defer x.writing.Unlock()
	if x.wrote == 0 {
		x.wrote = h.rev
	}
	for range putTries {
		if !h.Live() {
			return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
		}
		resp, err := h.session.client.Txn(ctx).
			If(h.Guard(h.prefix), clientv3.Compare(clientv3.ModRevision(h.key), "=", x.wrote)).
			Then(clientv3.OpPut(h.key, val, clientv3.WithLease(h.session.Lease()))).
			Else(clientv3.OpGet(h.key)).
			Commit()
		if err != nil {
			return nil, fmt.Errorf("etcdsync: set the value of %s: %w", h.key, err)
		}
		if resp.Succeeded {
			x.wrote = resp.Header.Revision
			return resp.Header, nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 || kvs[0].CreateRevision != h.rev {
			h.Lost(resp.Header.Revision)
			return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
		}
		x.wrote = kvs[0].ModRevision
	}
	return nil, fmt.Errorf("etcdsync: set the value of %s: it changed under each of %d tries", h.key, putTries)
}

// putTries bounds how often put writes over a value it did not expect.
const putTries = 4

// Unhold deletes the key at the held revision only (a retried release never
// deletes a newer hold). It is bounded by ctx and by the hold itself: when
// the hold ends meanwhile (the session ended, or reached its local deadline;
// the key was deleted) it returns at once. On an RPC error the hold stays, so
// it can be retried; when there was nothing to delete the hold ends and the
// error wraps ErrLockReleased. The hold ends once the delete has committed.
func (h *Hold) Unhold(ctx context.Context) error {
	if err := h.unholdable(ctx); err != nil {
		return err
	}
	// The session's end cancels the request at once (Bound), whatever the
	// session's loop is doing; the hold's own end, through finish.
	ctx, cancel := h.session.Bound(ctx)
	defer cancel()
	if h.cancelOnEnd(cancel) {
		defer h.cancelOnEnd(nil)
	} else { // another release of h is in flight: the hold's context bounds this one
		defer context.AfterFunc(h.Context(), cancel)()
	}
	h.releasing.Add(1)
	resp, err := h.session.client.Txn(ctx).If(h.Guard(h.prefix)).Then(clientv3.OpDelete(h.key)).Commit()
	if err != nil {
		return h.released(err, false, 0)
	}
	return h.released(nil, resp.Succeeded, resp.Header.Revision)
}

// unholdable is nil when h can be released under ctx, else why not: the
// hold has ended, or ctx has (nothing is sent: the hold stays as it was).
func (h *Hold) unholdable(ctx context.Context) error {
	switch {
	case !h.Live():
		return fmt.Errorf("%w: not held", ErrLockReleased)
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: release %s: %w", h.key, ctx.Err())
	}
	return nil
}

// released ends a release of h that Unhold sent (h.releasing counted it):
// err is the RPC's error, else deleted says whether the key was still h's
// at revision rev. It returns the release's error for the caller.
func (h *Hold) released(err error, deleted bool, rev int64) error {
	switch {
	case err != nil:
		// The delete may have committed; a Done watch that saw it while
		// it was in flight has reported a release. From now on a loss is
		// someone else's doing.
		h.releasing.Add(-1)
		switch {
		case h.Live():
			return fmt.Errorf("etcdsync: release %s: %w", h.key, err)
		case !errors.Is(h.Err(), ErrLockReleased):
			return fmt.Errorf("%w: %s: the hold ended while releasing: %w", ErrLockReleased, h.key, h.Err())
		}
		return nil
	case deleted:
		h.stop(ErrLockReleased)
		return nil
	}
	h.releasing.Add(-1)
	h.Lost(rev)
	h.stop(nil)
	return fmt.Errorf("%w: %s at revision %d was already gone", ErrLockReleased, h.key, h.rev)
}
