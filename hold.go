package etcdsync

// A held key (type hold): the state a primitive value has while it holds
// (Done, the guard, Do and the causes of loss), the watch that learns of its
// loss, the Runs under it (run.go), and the fenced release: a held key is
// deleted only while it is the hold's (its create revision), one hold or
// several in one transaction, so that a retried or late release never
// deletes a newer hold.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// hold is one held key: the state a Mutex or Election value has while it
// holds. It ends with the session, or earlier (finish). Loss detection (Done)
// and the hold's context start lazily: a hold nobody asked about costs no
// goroutine, no watch and no context.
type Hold struct {
	*Slot     // the holder's
	Rev       int64
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

	// under hold.mu:
	last    *pb.ResponseHeader      // of the last write through the hold (Proclaim)
	ctx     context.Context         // ends with the hold; nil until asked for
	end     context.CancelCauseFunc // ends ctx
	runs    map[*running]struct{}   // the Runs under the hold (run.go); nil until one starts
	handing bool                    // a Handover has begun: no Run starts its work

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
	h := &Hold{Slot: sl, Rev: rev, shares: 1, start: startHeader{cluster: hdr.ClusterId, member: hdr.MemberId, rev: hdr.Revision, term: hdr.RaftTerm}}
	sl.Session.Reg.mu.Lock()
	use := sl.Session.Reg.keys[sl.Key]
	use.hold = h
	sl.Session.Reg.keys[sl.Key] = use
	if sl.Rule.Shared {
		sl.Session.Reg.wakeLocked(sl.Key) // those waiting to share it join
	}
	sl.Session.Reg.mu.Unlock()
	return h
}

// leave drops one share of h and reports whether it was the last, which
// then releases the key (unhold) while nobody joins.
func (h *Hold) leave() bool {
	h.Session.Reg.mu.Lock()
	defer h.Session.Reg.mu.Unlock()
	h.shares--
	h.closing = h.shares == 0
	return h.closing
}

// kept takes back the last share after its release failed with the hold
// seemingly still there. Its delete may have committed, or may yet: nobody
// joins the hold any more (it stays closing), and its watch, started here,
// ends it if the key goes.
func (h *Hold) kept() {
	h.Session.Reg.mu.Lock()
	h.shares++
	h.Session.Reg.mu.Unlock()
	h.Done()
}

// check reads h's key: while the key is h's it returns the read's revision;
// when the key is gone or replaced it ends h and returns an error wrapping
// ErrNotHeld.
func (h *Hold) check(ctx context.Context) (int64, error) {
	resp, err := h.Session.client.Get(ctx, h.Key)
	if err != nil {
		return 0, err
	}
	if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != h.Rev {
		h.Lost(resp.Header.Revision)
		return 0, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.Key, h.Rev)
	}
	return resp.Header.Revision, nil
}

// context returns a context that ends when the hold ends, with its cause.
func (h *Hold) Context() context.Context {
	h.mu.Lock()
	defer h.mu.Unlock()
	x := h.extraLocked()
	switch {
	case x.ctx != nil:
	case h.over.Load(): // with its own cause, whether or not the session ended since
		x.ctx, x.end = context.WithCancelCause(context.WithoutCancel(h.Session.ctx))
		x.end(h.cause)
	default:
		x.ctx, x.end = context.WithCancelCause(h.Session.ctx)
	}
	return x.ctx
}

// advance records the header of a later write through the hold (Proclaim);
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

// inherited reports whether h's key was created before the session began: a
// hold of a restarted process that this session adopted (WithLease).
func (h *Hold) Inherited() bool { return h.Rev <= h.Session.startRev }

// live reports whether h is a hold that has not ended.
func (h *Hold) Live() bool { return h != nil && !h.over.Load() && h.Session.ctx.Err() == nil }

// finish ends the hold with cause (the session's, if it has ended) and frees
// the key's reservation, once.
func (h *Hold) finish(cause error) {
	h.once.Do(func() {
		h.mu.Lock()
		if h.Session.ctx.Err() != nil || cause == nil {
			cause = context.Cause(h.Session.ctx)
		}
		if cause == nil { // not reached: nil is passed only once the hold or session ended
			cause = ErrNotHeld
		}
		h.cause = cause
		h.over.Store(true)
		var end context.CancelCauseFunc
		if h.x != nil {
			end = h.x.end
		}
		h.mu.Unlock()
		if rep := h.Session.rep; rep != nil {
			rep.HoldEnded(h, cause) // before Done closes
		}
		if end != nil {
			end(cause)
		}
		h.Session.Reg.ReleaseKey(h.Key)
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

// done returns a channel closed when the hold ends, starting the watch that
// notices a key deleted behind our back.
func (h *Hold) Done() <-chan struct{} {
	ctx := h.Context()
	x := h.extra()
	x.watchOnce.Do(func() {
		if ctx.Err() != nil {
			return
		}
		watched := make(chan struct{})
		if h.Session.goWatch(func() { defer close(watched); h.watchKey(ctx) }) {
			x.watched = watched
		}
	})
	return ctx.Done()
}

// err returns nil while the hold lasts, else why it ended.
func (h *Hold) Err() error {
	if h.over.Load() {
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.cause
	}
	if h.Session.ctx.Err() != nil {
		return context.Cause(h.Session.ctx)
	}
	return nil
}

// lost ends the hold because its key is gone or replaced.
func (h *Hold) Lost(rev int64) {
	if h.releasing.Load() > 0 {
		h.finish(ErrLockReleased)
		return
	}
	h.finish(fmt.Errorf("%w: key %s gone by revision %d (lease expired or revoked, or deleted by someone)", ErrNotHeld, h.Key, rev))
	h.Session.checkLease()
}

// watchKey ends the hold when its key is deleted; hctx is the hold's context.
func (h *Hold) watchKey(hctx context.Context) {
	if rev, err := WatchGone(hctx, h.Session.client, h.Key, h.Rev, h.start.rev+1); err == nil {
		h.Lost(rev)
	}
}

// watchGone blocks until the incarnation of key created at rev is gone
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
		if err := Sleep(ctx, RetryPause); err != nil {
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

// guard is the comparison that holds while h is the current hold; with no
// hold it is a valid comparison that is always false.
func (h *Hold) Guard(prefix string) clientv3.Cmp {
	if !h.Live() {
		return clientv3.Compare(clientv3.CreateRevision(prefix), "<", 0)
	}
	return clientv3.Compare(clientv3.CreateRevision(h.Key), "=", h.Rev)
}

// do runs ops in one transaction only while h is current. When the hold is
// gone it ends h and returns an error wrapping ErrNotHeld.
func (h *Hold) do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if !h.Live() {
		return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
	}
	// The Else range keeps the transaction linearizable: one of compares and
	// serializable reads alone is served by any member, which may lag.
	resp, err := h.Session.client.Txn(ctx).If(h.Guard(h.Prefix)).Then(ops...).Else(clientv3.OpGet(h.Key, clientv3.WithCountOnly())).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdsync: guarded transaction on %s: %w", h.Key, err)
	}
	if !resp.Succeeded {
		h.Lost(resp.Header.Revision)
		return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.Key, h.Rev)
	}
	return resp, nil
}

// put sets the key's value while h is current, and only over the value of
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
		x.wrote = h.Rev
	}
	for range putTries {
		if !h.Live() {
			return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
		}
		resp, err := h.Session.client.Txn(ctx).
			If(h.Guard(h.Prefix), clientv3.Compare(clientv3.ModRevision(h.Key), "=", x.wrote)).
			Then(clientv3.OpPut(h.Key, val, clientv3.WithLease(h.Session.Lease()))).
			Else(clientv3.OpGet(h.Key)).
			Commit()
		if err != nil {
			return nil, fmt.Errorf("etcdsync: set the value of %s: %w", h.Key, err)
		}
		if resp.Succeeded {
			x.wrote = resp.Header.Revision
			return resp.Header, nil
		}
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 || kvs[0].CreateRevision != h.Rev {
			h.Lost(resp.Header.Revision)
			return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.Key, h.Rev)
		}
		x.wrote = kvs[0].ModRevision
	}
	return nil, fmt.Errorf("etcdsync: set the value of %s: it changed under each of %d tries", h.Key, putTries)
}

// putTries bounds how often put writes over a value it did not expect.
const putTries = 4

// unhold deletes the key at the held revision only (a retried release never
// deletes a newer hold). It is bounded by ctx and by the hold itself: when the
// hold ends meanwhile (the session reached its local deadline, the key was
// deleted) it returns at once. On an RPC error the hold stays, so it can be
// retried; when there was nothing to delete the hold ends and the error wraps
// ErrLockReleased. The hold ends once the delete has committed.
func (h *Hold) Unhold(ctx context.Context) error { return Unhold(ctx, []*Hold{h})[0] }

// unhold releases several holds of one session in one RPC (see hold.unhold
// for each): one transaction deletes each key that is still its hold's, at
// one revision. It returns one error per hold, nil for those released; it
// is bounded by ctx and, with one hold, by that hold.
func Unhold(ctx context.Context, hs []*Hold) []error {
	errs := make([]error, len(hs))
	var live []int
	for i, h := range hs {
		switch {
		case !h.Live():
			errs[i] = fmt.Errorf("%w: not held", ErrLockReleased)
		case ctx.Err() != nil: // nothing is sent: the hold stays as it was
			errs[i] = fmt.Errorf("etcdsync: release %s: %w", h.Key, ctx.Err())
		default:
			live = append(live, i)
		}
	}
	if len(live) == 0 {
		return errs
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	txn := hs[live[0]].Session.client.Txn(ctx)
	if len(hs) == 1 {
		h := hs[0]
		stop := context.AfterFunc(h.Context(), cancel)
		defer stop()
		txn = txn.If(h.Guard(h.Prefix)).Then(clientv3.OpDelete(h.Key))
	} else {
		ops := make([]clientv3.Op, len(live))
		for j, i := range live {
			h := hs[i]
			ops[j] = clientv3.OpTxn([]clientv3.Cmp{h.Guard(h.Prefix)}, []clientv3.Op{clientv3.OpDelete(h.Key)}, nil)
		}
		txn = txn.Then(ops...)
	}
	for _, i := range live {
		hs[i].releasing.Add(1)
	}
	resp, err := txn.Commit()
	for j, i := range live {
		h := hs[i]
		switch {
		case err != nil:
			// The delete may have committed; a Done watch that saw it while
			// it was in flight has reported a release. From now on a loss is
			// someone else's doing.
			h.releasing.Add(-1)
			switch {
			case h.Live():
				errs[i] = fmt.Errorf("etcdsync: release %s: %w", h.Key, err)
			case !errors.Is(h.Err(), ErrLockReleased):
				errs[i] = fmt.Errorf("%w: %s: the hold ended while releasing: %w", ErrLockReleased, h.Key, h.Err())
			}
		case len(hs) == 1 && resp.Succeeded, len(hs) > 1 && resp.Responses[j].GetResponseTxn().Succeeded:
			h.stop(ErrLockReleased)
		default:
			h.releasing.Add(-1)
			h.Lost(resp.Header.Revision)
			h.stop(nil)
			errs[i] = fmt.Errorf("%w: %s at revision %d was already gone", ErrLockReleased, h.Key, h.Rev)
		}
	}
	return errs
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

// stopRuns begins a Handover of h: no Run registered from now on starts its
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
