package etcdsync

// The acquire step and the wait loop that every primitive shares.
//
// A contender writes one key NAME/<lease-hex>, bound to its session's lease,
// in one create-if-absent transaction that also lists, keys only and sorted by
// create revision, the keys under NAME/. The direct children of NAME/ form a
// queue in create-revision order; the oldest holds. A waiter watches only the
// nearest older key (its predecessor) and its own key, both from the revision
// after its read, on one watch stream of its own. Older keys can only vanish,
// never appear, so when the last older key goes the waiter owns the turn with
// no further RPC; when its own key goes first it returns ErrSessionExpired.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// checkName validates a primitive's name.
func checkName(name string) error {
	if name == "" {
		return fmt.Errorf("%w: empty name", ErrInvalidName)
	}
	if strings.IndexByte(name, 0) >= 0 {
		return fmt.Errorf("%w: name %q has a NUL byte", ErrInvalidName, name)
	}
	return nil
}

// slot is one contender's place: the session, the name's prefix and the key.
type slot struct {
	s      *Session
	prefix string // NAME/
	key    string // NAME/<lease-hex>
}

func newSlot(s *Session, name string) (slot, error) {
	if s == nil {
		return slot{}, fmt.Errorf("%w: nil session", ErrInvalidArgument)
	}
	if err := checkName(name); err != nil {
		return slot{}, err
	}
	prefix := name + "/"
	return slot{s: s, prefix: prefix, key: fmt.Sprintf("%s%x", prefix, int64(s.Lease()))}, nil
}

// isChild reports whether key is a direct child NAME/<hex> of prefix: the
// only keys that take part in a queue (a lock on NAME/x never blocks NAME).
func isChild(prefix, key string) bool {
	rest, ok := strings.CutPrefix(key, prefix)
	if !ok || rest == "" {
		return false
	}
	for i := 0; i < len(rest); i++ {
		if c := rest[i]; !('0' <= c && c <= '9' || 'a' <= c && c <= 'f') {
			return false
		}
	}
	return true
}

// ahead returns the direct children of prefix created before rev, oldest first.
func ahead(prefix string, kvs []*mvccpb.KeyValue, rev int64) []*mvccpb.KeyValue {
	var out []*mvccpb.KeyValue
	for _, kv := range kvs {
		if kv.CreateRevision < rev && isChild(prefix, string(kv.Key)) {
			out = append(out, kv)
		}
	}
	return out
}

func listOp(prefix string) clientv3.Op {
	return clientv3.OpGet(prefix, clientv3.WithPrefix(), clientv3.WithKeysOnly(),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
}

// turn is the outcome of an acquire: our key's create revision, the keys
// ahead of it and the header of the read that listed them.
type turn struct {
	slot
	rev   int64
	value []byte // our key's value when it already existed (non-nil), else nil
	ahead []*mvccpb.KeyValue
	hdr   *pb.ResponseHeader
	wrote bool // this call may have written the key
}

// enqueue writes our key if absent and reads the queue, in one transaction.
// A key that already exists with our lease is ours: a resumed hold after a
// restart with WithLease, or a create the client retried after it committed.
func (sl slot) enqueue(ctx context.Context, val string) (turn, error) {
	lease := sl.s.Lease()
	resp, err := sl.s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0)).
		Then(clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)), listOp(sl.prefix)).
		Else(clientv3.OpGet(sl.key), listOp(sl.prefix)).
		Commit()
	if err != nil {
		return turn{slot: sl, wrote: true}, err
	}
	t := turn{slot: sl, hdr: resp.Header, wrote: resp.Succeeded, rev: resp.Header.Revision}
	if !resp.Succeeded {
		kv := resp.Responses[0].GetResponseRange().Kvs[0]
		if clientv3.LeaseID(kv.Lease) != lease {
			return t, fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, sl.key, kv.Lease, int64(lease))
		}
		t.rev, t.value, t.wrote = kv.CreateRevision, append([]byte{}, kv.Value...), true
	}
	t.ahead = ahead(sl.prefix, resp.Responses[1].GetResponseRange().Kvs, t.rev)
	return t, nil
}

// tryEnqueue writes our key only if nothing at all is under NAME/: one RPC and
// no write when the name is held. When only nested keys (NAME/x/…) exist the
// compare fails although nobody holds NAME, so it falls back to enqueue. The
// returned turn has keys ahead when the name is held; the caller then
// withdraws the key if it wrote one.
func (sl slot) tryEnqueue(ctx context.Context) (turn, error) {
	lease := sl.s.Lease()
	resp, err := sl.s.client.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(sl.prefix), "=", 0).WithPrefix()).
		Then(clientv3.OpPut(sl.key, "", clientv3.WithLease(lease))).
		Else(clientv3.OpGet(sl.key), listOp(sl.prefix)).
		Commit()
	if err != nil {
		return turn{slot: sl, wrote: true}, err
	}
	if resp.Succeeded {
		return turn{slot: sl, hdr: resp.Header, wrote: true, rev: resp.Header.Revision}, nil
	}
	// Without a key of ours, every direct child is ahead of where ours would be.
	t := turn{slot: sl, hdr: resp.Header, rev: resp.Header.Revision + 1}
	if own := resp.Responses[0].GetResponseRange().Kvs; len(own) > 0 {
		if clientv3.LeaseID(own[0].Lease) != lease {
			return t, fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, sl.key, own[0].Lease, int64(lease))
		}
		t.rev, t.value, t.wrote = own[0].CreateRevision, append([]byte{}, own[0].Value...), true
	}
	t.ahead = ahead(sl.prefix, resp.Responses[1].GetResponseRange().Kvs, t.rev)
	if len(t.ahead) == 0 && !t.wrote {
		return sl.enqueue(ctx, "")
	}
	return t, nil
}

// withdraw deletes our key if it is still the one at rev (rev 0: whatever key
// with our lease is there). It runs under a bounded context of its own, as it
// cleans up after calls whose context may have ended.
func (sl slot) withdraw(rev int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sl.s.ctx), cleanupTimeout)
	defer cancel()
	cmp := clientv3.Compare(clientv3.CreateRevision(sl.key), "=", rev)
	if rev == 0 {
		cmp = clientv3.Compare(clientv3.LeaseValue(sl.key), "=", sl.s.Lease())
	}
	if _, err := sl.s.client.Txn(ctx).If(cmp).Then(clientv3.OpDelete(sl.key)).Commit(); err != nil {
		return fmt.Errorf("etcdsync: remove %s after a failed acquire: %w", sl.key, err)
	}
	return nil
}

// errOwnKeyGone means a waiter's own key vanished.
var errOwnKeyGone = fmt.Errorf("%w: own key deleted while waiting", ErrSessionExpired)

// wait blocks until no key is ahead of ours, then returns the header of the
// revision at which the turn came. It returns ErrSessionExpired (wrapped) as
// soon as our own key vanishes, and ctx's error when ctx ends; it leaves the
// key in place either way (the caller withdraws it).
func (t *turn) wait(ctx context.Context) (*pb.ResponseHeader, error) {
	for len(t.ahead) > 0 {
		err := t.watch(ctx)
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case errors.Is(err, ErrSessionExpired):
			return nil, err
		default:
			// The stream broke (member restart, lost leader, compaction):
			// re-read where we stand and watch again.
			if err := sleep(ctx, retryPause); err != nil {
				return nil, err
			}
			if err := t.settle(ctx, t.hdr.Revision); err != nil && errors.Is(err, ErrSessionExpired) {
				return nil, err
			}
		}
	}
	return t.hdr, nil
}

// ownWatch is the watch ID of our own key on a waiter's stream; the keys
// ahead get IDs from 2 up.
const ownWatch = 1

// watch opens one watch stream and waits on it: first a watch of our own key,
// then one of the nearest key ahead. It returns nil when the turn came (t.ahead
// empty), an error wrapping ErrSessionExpired when our key went, or another
// error when the stream failed.
//
// Both watches start at the server's current revision (start 0), so the
// server puts them in its synced set at once (a watch from a past revision
// waits up to 100 ms for the server's resync). A synced watcher's events go
// out on its stream in revision order, and our own watch's created response
// arrives before the other watch is asked for, so a delete of our key that
// precedes the predecessor's delete reaches us first. Writes between our last
// read and a watch's creation (its created response is at a later revision)
// leave a gap, which one read at or after that revision closes.
//
// Handoff: when the predecessor's delete arrives and no key was ahead of it at
// our last read, the turn is ours with no RPC; when older keys were listed,
// one serializable read says whether they are gone.
func (t *turn) watch(ctx context.Context) error {
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	stream, err := pb.NewWatchClient(t.s.client.ActiveConnection()).Watch(ctx, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	if err := createWatch(stream, ownWatch, t.key); err != nil {
		return err
	}
	if _, _, err := t.next(ctx, stream, ownWatch, ""); err != nil {
		return err
	}
	for id := int64(ownWatch + 1); len(t.ahead) > 0; id++ {
		key := string(t.ahead[len(t.ahead)-1].Key)
		if err := createWatch(stream, id, key); err != nil {
			return err
		}
		gone, hdr, err := t.next(ctx, stream, id, key)
		switch {
		case err != nil:
			return err
		case gone == 0: // a read moved the queue: watch the new nearest key
		case len(t.ahead) == 1:
			t.ahead, t.hdr = nil, &pb.ResponseHeader{ClusterId: hdr.ClusterId, MemberId: hdr.MemberId, Revision: gone, RaftTerm: hdr.RaftTerm}
		default:
			if err := t.settle(ctx, gone); err != nil {
				return err
			}
		}
	}
	return nil
}

// next reads the stream until watch id reports: for our own watch (key ""),
// its creation; for a key ahead, the revision of its delete, or 0 when the
// read that closes the gap before the watch's creation found the queue moved.
// A delete of our own key is an error wrapping ErrSessionExpired.
func (t *turn) next(ctx context.Context, stream pb.Watch_WatchClient, id int64, key string) (int64, *pb.ResponseHeader, error) {
	for {
		resp, err := stream.Recv()
		if err != nil {
			return 0, nil, err
		}
		if resp.Canceled {
			return 0, nil, fmt.Errorf("etcdsync: watch canceled: %s", resp.CancelReason)
		}
		if resp.Created && resp.WatchId == id {
			if key == "" {
				return 0, resp.Header, nil
			}
			if resp.Header.Revision > t.hdr.Revision {
				if err := t.settle(ctx, resp.Header.Revision); err != nil {
					return 0, nil, err
				}
				if len(t.ahead) == 0 || string(t.ahead[len(t.ahead)-1].Key) != key {
					return 0, resp.Header, nil
				}
			}
		}
		for _, ev := range resp.Events {
			switch {
			case ev.Type != mvccpb.DELETE:
			case resp.WatchId == ownWatch:
				return 0, nil, fmt.Errorf("%w (revision %d)", errOwnKeyGone, ev.Kv.ModRevision)
			case resp.WatchId == id:
				return ev.Kv.ModRevision, resp.Header, nil
			}
		}
	}
}

// createWatch asks for a watch of key's deletes from the current revision.
func createWatch(stream pb.Watch_WatchClient, id int64, key string) error {
	return stream.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{
		CreateRequest: &pb.WatchCreateRequest{
			Key:     []byte(key),
			WatchId: id,
			Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT},
		}}})
}

// settle re-reads the keys up to ours at a revision of at least atLeast
// (serializable when the member is that recent, else linearizable) and
// updates t. It returns an error wrapping ErrSessionExpired when our key is gone.
func (t *turn) settle(ctx context.Context, atLeast int64) error {
	defer func() {
	}()
	opts := []clientv3.OpOption{clientv3.WithPrefix(), clientv3.WithKeysOnly(), clientv3.WithMaxCreateRev(t.rev),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend)}
	resp, err := t.s.client.Get(ctx, t.prefix, append(opts, clientv3.WithSerializable())...)
	if err == nil && resp.Header.Revision < atLeast {
		resp, err = t.s.client.Get(ctx, t.prefix, opts...)
	}
	if err != nil {
		return err
	}
	mine := false
	for _, kv := range resp.Kvs {
		mine = mine || string(kv.Key) == t.key && kv.CreateRevision == t.rev
	}
	if !mine {
		return errOwnKeyGone
	}
	t.ahead, t.hdr = ahead(t.prefix, resp.Kvs, t.rev), resp.Header
	return nil
}

func sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}

// mode says how acquire waits.
type mode int

const (
	waitTurn mode = iota // wait in the queue (Lock, Campaign)
	tryTurn              // never wait (TryLock)
)

// acquire takes the slot's key for one hold: it reserves the key in the
// session, enqueues, and (in waitTurn mode) waits for its turn. ctx bounds it
// all; the session's end also ends it. On error no key is left behind (the
// cleanup runs under a bounded context of its own) and the reservation is
// freed. In tryTurn mode a held name gives an error wrapping ErrLocked.
func (sl slot) acquire(ctx context.Context, val string, m mode) (*hold, []byte, error) {
	if err := sl.s.Err(); err != nil {
		return nil, nil, sl.s.endedErr()
	}
	if err := sl.s.claimKey(ctx, sl.key, m == waitTurn); err != nil {
		return nil, nil, err
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(sl.s.ctx, cancel)
	defer stop()

	// The create is not cancelled with ctx: a cancelled request may still be
	// applied by the server after a cleanup sent behind it (the server can
	// propose it after its context ended), which would leave a key behind.
	// Waiting for its outcome, briefly, lets the cleanup know what to delete.
	ectx, ecancel := context.WithTimeout(context.WithoutCancel(wctx), createBound(ctx))
	defer ecancel()
	var t turn
	var err error
	if m == tryTurn {
		t, err = sl.tryEnqueue(ectx)
	} else {
		t, err = sl.enqueue(ectx, val)
	}
	hdr := t.hdr
	switch {
	case err != nil:
	case wctx.Err() != nil:
		err = wctx.Err()
	case len(t.ahead) > 0 && m == tryTurn:
		err = fmt.Errorf("%w: %s", ErrLocked, sl.prefix)
	case len(t.ahead) > 0:
		hdr, err = t.wait(wctx)
	}
	if err != nil {
		if t.wrote {
			err = errors.Join(sl.why(ctx, err), sl.withdraw(t.rev))
		} else {
			err = sl.why(ctx, err)
		}
		sl.s.releaseKey(sl.key)
		return nil, nil, err
	}
	return newHold(sl, t.rev, hdr), t.value, nil
}

// createBound is how long an acquire's create may take: the time left on
// ctx, but at least one second (so a context that ends while the create is in
// flight still learns the create's outcome) and at most cleanupTimeout.
func createBound(ctx context.Context) time.Duration {
	bound := cleanupTimeout
	if deadline, ok := ctx.Deadline(); ok {
		bound = min(max(time.Until(deadline), time.Second), cleanupTimeout)
	}
	return bound
}

// why wraps err with what ended the call: the caller's context, or the session.
func (sl slot) why(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: acquire %s: %w", sl.prefix, ctx.Err())
	case sl.s.ctx.Err() != nil:
		return sl.s.endedErr()
	}
	return err
}

// hold is one held key: the state a Mutex or Election value has while it
// holds. Loss detection (Done) starts lazily: a hold nobody asked about costs
// no goroutine and no watch.
type hold struct {
	slot
	rev       int64
	hdr       *pb.ResponseHeader
	ctx       context.Context
	end       context.CancelCauseFunc
	releasing atomic.Bool

	once      sync.Once     // finish
	watchOnce sync.Once     // start or forbid the watch
	watched   chan struct{} // closed when the watch returns; nil if never started
}

// newHold makes the hold of a key this session reserved (claimKey); the hold
// frees the reservation when it finishes.
func newHold(sl slot, rev int64, hdr *pb.ResponseHeader) *hold {
	ctx, end := context.WithCancelCause(sl.s.ctx)
	return &hold{slot: sl, rev: rev, hdr: hdr, ctx: ctx, end: end}
}

// live reports whether h is a hold that has not ended.
func (h *hold) live() bool { return h != nil && h.ctx.Err() == nil }

// finish ends the hold with cause and frees the key's reservation, once.
func (h *hold) finish(cause error) {
	h.once.Do(func() {
		h.end(cause)
		h.s.releaseKey(h.key)
	})
}

// stop finishes the hold and waits for its watch, if any.
func (h *hold) stop(cause error) {
	h.finish(cause)
	h.watchOnce.Do(func() {})
	if h.watched != nil {
		<-h.watched
	}
}

// done returns a channel closed when the hold ends, starting the watch that
// notices a key deleted behind our back.
func (h *hold) done() <-chan struct{} {
	h.watchOnce.Do(func() {
		if h.ctx.Err() != nil {
			return
		}
		watched := make(chan struct{})
		if h.s.goWatch(func() { defer close(watched); h.watchKey() }) {
			h.watched = watched
		}
	})
	return h.ctx.Done()
}

// err returns nil while the hold lasts, else why it ended.
func (h *hold) err() error {
	if h.ctx.Err() == nil {
		return nil
	}
	return context.Cause(h.ctx)
}

// lost ends the hold because its key is gone or replaced.
func (h *hold) lost(rev int64) {
	if h.releasing.Load() {
		h.finish(ErrLockReleased)
		return
	}
	h.finish(fmt.Errorf("%w: key %s gone by revision %d (lease expired or revoked, or deleted by someone)", ErrNotHeld, h.key, rev))
	h.s.checkLease()
}

// watchKey ends the hold when its key is deleted. It survives compaction,
// member restarts and lost leaders by re-reading the key.
func (h *hold) watchKey() {
	from := h.hdr.Revision + 1
	for h.ctx.Err() == nil {
		ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(h.ctx))
		for wr := range h.s.client.Watch(ctx, h.key, clientv3.WithRev(from), clientv3.WithFilterPut()) {
			if wr.Canceled {
				break
			}
			for _, ev := range wr.Events {
				if ev.Type == mvccpb.DELETE {
					cancel()
					h.lost(ev.Kv.ModRevision)
					return
				}
			}
			from = max(from, wr.Header.Revision+1)
		}
		cancel()
		if sleep(h.ctx, retryPause) != nil {
			return
		}
		resp, err := h.s.client.Get(h.ctx, h.key)
		if err != nil {
			continue
		}
		if len(resp.Kvs) == 0 || resp.Kvs[0].CreateRevision != h.rev {
			h.lost(resp.Header.Revision)
			return
		}
		from = resp.Header.Revision + 1
	}
}

// guard is the comparison that holds while h is the current hold; with no
// hold it is a valid comparison that is always false.
func (h *hold) guard(prefix string) clientv3.Cmp {
	if !h.live() {
		return clientv3.Compare(clientv3.CreateRevision(prefix), "<", 0)
	}
	return clientv3.Compare(clientv3.CreateRevision(h.key), "=", h.rev)
}

// do runs ops in one transaction only while h is current. When the hold is
// gone it ends h and returns an error wrapping ErrNotHeld.
func (h *hold) do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if !h.live() {
		return nil, fmt.Errorf("%w: no current hold", ErrNotHeld)
	}
	resp, err := h.s.client.Txn(ctx).If(h.guard(h.prefix)).Then(ops...).Commit()
	if err != nil {
		return nil, fmt.Errorf("etcdsync: guarded transaction on %s: %w", h.key, err)
	}
	if !resp.Succeeded {
		h.lost(resp.Header.Revision)
		return nil, fmt.Errorf("%w: %s at revision %d is gone", ErrNotHeld, h.key, h.rev)
	}
	return resp, nil
}

// unhold deletes the key at the held revision only (a retried release never
// deletes a newer hold). On an RPC error the hold stays, so it can be retried;
// when there was nothing to delete the hold ends and the error wraps
// ErrLockReleased. The hold ends once the delete has committed.
func (h *hold) unhold(ctx context.Context) (*pb.ResponseHeader, error) {
	if !h.live() {
		return nil, fmt.Errorf("%w: not held", ErrLockReleased)
	}
	if err := ctx.Err(); err != nil { // nothing is sent: the hold stays as it was
		return nil, fmt.Errorf("etcdsync: release %s: %w", h.key, err)
	}
	h.releasing.Store(true)
	resp, err := h.s.client.Txn(ctx).If(h.guard(h.prefix)).Then(clientv3.OpDelete(h.key)).Commit()
	if err != nil {
		// The delete may have committed: a Done watch that sees it reports
		// a release. The hold stays, so Unlock can be retried.
		return nil, fmt.Errorf("etcdsync: release %s: %w", h.key, err)
	}
	if !resp.Succeeded {
		h.releasing.Store(false)
		h.lost(resp.Header.Revision)
		h.stop(nil)
		return resp.Header, fmt.Errorf("%w: %s at revision %d was already gone", ErrLockReleased, h.key, h.rev)
	}
	h.stop(ErrLockReleased)
	return resp.Header, nil
}

// holder is the state every primitive value (Mutex, Election) keeps: its
// slot, and its current hold, if any. A primitive is "which keys, which
// guard" on top of it.
type holder struct {
	slot slot
	bad  error // why the name or session is unusable, or nil
	name string

	mu   sync.Mutex
	h    *hold
	last error // why the previous hold ended
}

func newHolder(s *Session, name string) holder {
	sl, err := newSlot(s, name)
	return holder{slot: sl, bad: err, name: name}
}

// take acquires a hold (see slot.acquire) and makes it current. It returns
// the value the key already had when it existed.
func (hr *holder) take(ctx context.Context, val string, md mode) ([]byte, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	h, value, err := hr.slot.acquire(ctx, val, md)
	if err != nil {
		return nil, err
	}
	hr.mu.Lock()
	hr.h = h
	hr.mu.Unlock()
	return value, nil
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
		hr.last, hr.h = hr.h.err(), nil
	}
	return hr.h
}

// held returns the live hold, or an error wrapping notHeld.
func (hr *holder) held(notHeld error) (*hold, error) {
	if hr.bad != nil {
		return nil, hr.bad
	}
	if h := hr.current(); h != nil {
		return h, nil
	}
	return nil, fmt.Errorf("%w: %s is not held by this value", notHeld, hr.name)
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
		return h.hdr
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
