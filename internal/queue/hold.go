package queue

// A held key (type Hold) and the holder (type Holder) of a primitive value.
//
// The hold: the state a primitive value has while it holds (Done, the guard,
// Do and the causes of loss), the watch that learns of its loss, the Runs
// under it (run.go), and the fenced release: a held key is deleted only
// while it is the hold's (its create revision), one hold or several in one
// transaction, so that a retried or late release never deletes a newer hold.
//
// The holder: what a primitive value (a Mutex, an Election, one side of an
// RWMutex, a Semaphore) keeps between calls: its slot and its current hold,
// and the calls every primitive shares on it (acquire, release, Run and its
// reentrancy, Do, Done, Err, the guard).

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

// Unhold releases several holds of one session in one RPC (see Hold.Unhold
// for each): one transaction deletes each key that is still its hold's, at
// one revision. It returns one error per hold, nil for those released; it
// is bounded by ctx and, with one hold, by that hold.
func Unhold(ctx context.Context, hs []*Hold) []error {
	if len(hs) == 1 {
		return []error{hs[0].Unhold(ctx)}
	}
	errs := make([]error, len(hs))
	var live []int
	var ops []clientv3.Op
	for i, h := range hs {
		if errs[i] = h.unholdable(ctx); errs[i] == nil {
			live = append(live, i)
			ops = append(ops, clientv3.OpTxn([]clientv3.Cmp{h.Guard(h.prefix)}, []clientv3.Op{clientv3.OpDelete(h.key)}, nil))
		}
	}
	if len(live) == 0 {
		return errs
	}
	for _, i := range live {
		hs[i].releasing.Add(1)
	}
	resp, err := hs[live[0]].session.client.Txn(ctx).Then(ops...).Commit()
	for j, i := range live {
		if err != nil {
			errs[i] = hs[i].released(err, false, 0)
		} else {
			errs[i] = hs[i].released(nil, resp.Responses[j].GetResponseTxn().Succeeded, resp.Header.Revision)
		}
	}
	return errs
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
		leave, handedOver := h.addRun(cancel)
		if handedOver { // between the acquire and now: fn must not run beside the successor
			return leave, fmt.Errorf("%w: %s was handed over before fn ran", ErrLockReleased, h.key)
		}
		return leave, nil // called after the release: a Handover waits for both
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
