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
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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

// name is the primitive's name: the prefix without its slash.
func (sl slot) name() string { return strings.TrimSuffix(sl.prefix, "/") }

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
		return turn{slot: sl, wrote: unsure(err)}, err
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
		return turn{slot: sl, wrote: unsure(err)}, err
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

// withdraw deletes the key this call may have written: the one at rev when
// the create's outcome is known, else (rev 0) any key with our lease created
// after the session began, so never a hold that a restarted process resumes
// (WithLease). It runs under a bounded context of its own, as it cleans up
// after calls whose context may have ended.
func (sl slot) withdraw(rev int64) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(sl.s.ctx), cleanupTimeout)
	defer cancel()
	cmps := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(sl.key), "=", rev)}
	if rev == 0 {
		cmps = []clientv3.Cmp{
			clientv3.Compare(clientv3.LeaseValue(sl.key), "=", sl.s.Lease()),
			clientv3.Compare(clientv3.CreateRevision(sl.key), ">", sl.s.startRev),
		}
	}
	if _, err := sl.s.client.Txn(ctx).If(cmps...).Then(clientv3.OpDelete(sl.key)).Commit(); err != nil {
		return fmt.Errorf("etcdsync: remove %s after a failed acquire: %w", sl.key, err)
	}
	return nil
}

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

// Watch IDs on a waiter's stream: our own key, then the keys ahead from
// firstAhead up. progressID is the ID of the server's answer to a progress
// request on the whole stream.
const (
	ownWatch   = 1
	firstAhead = 2
	progressID = clientv3.InvalidWatchID
)

// progressWait bounds the wait for the answer to a progress request; a member
// whose watchers on the stream are not all synced never answers one, and the
// waiter then reads instead.
const progressWait = 500 * time.Millisecond

// stream is one watch stream of a waiter: a watch of its own key and one of
// the nearest key ahead, both from the serving member's current revision.
type stream struct {
	t      *turn
	ctx    context.Context
	cancel context.CancelCauseFunc
	pb     pb.Watch_WatchClient
	cur    int64 // the watch of the nearest key ahead
}

// watch opens one watch stream and waits on it. It returns nil when the turn
// came (t.ahead empty), an error wrapping ErrSessionExpired when our key went,
// or another error when the stream failed.
//
// Both watches start at the serving member's current revision (start 0), so
// the server puts them in its synced set at once (a watch from a past revision
// waits up to 100 ms for the server's resync). Two things follow:
//
//   - The member may be ahead of our last read (t.hdr): writes between the read
//     and a watch's creation leave a gap, which one read at the created
//     revision closes.
//   - The member may lag behind our last read (a follower cut off from its
//     peers for a moment still serves watches): the stream then replays events
//     up to our read, such as the delete of an older incarnation of the key we
//     watch (same session, unlocked and locked again). A delete at or below the
//     revision of the read that saw the key present cannot be that key's
//     delete, so every event at or below t.hdr.Revision is ignored.
//
// Handoff: when the predecessor's delete arrives at revision R and no key was
// ahead of it at our last read, the turn is ours at R unless our own key went
// at R too (one transaction deleting a whole prefix): the server sends one
// revision's events to the watchers of a stream in no set order. A progress
// request on the stream settles it: the server answers it after every event
// up to its current revision (at least R) has gone out on the stream. When
// older keys were listed ahead, one serializable read says whether they are
// gone.
func (t *turn) watch(ctx context.Context) error {
	sctx, cancel := context.WithCancelCause(clientv3.WithRequireLeader(ctx))
	defer cancel(nil)
	ws, err := pb.NewWatchClient(t.s.client.ActiveConnection()).Watch(sctx, grpc.WaitForReady(true))
	if err != nil {
		return err
	}
	st := &stream{t: t, ctx: sctx, cancel: cancel, pb: ws}
	if err := st.create(ownWatch, t.key); err != nil {
		return err
	}
	if _, err := st.next(ctx, ownWatch, ""); err != nil {
		return err
	}
	for id := int64(firstAhead); len(t.ahead) > 0; id++ {
		if id > firstAhead {
			if err := st.drop(id - 1); err != nil {
				return err
			}
		}
		key := string(t.ahead[len(t.ahead)-1].Key)
		if err := st.create(id, key); err != nil {
			return err
		}
		gone, err := st.next(ctx, id, key)
		switch {
		case err != nil:
			return err
		case gone == 0: // a read moved the queue: watch the new nearest key
		case len(t.ahead) == 1:
			if err := st.confirm(ctx, gone); err != nil {
				return err
			}
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
func (st *stream) next(ctx context.Context, id int64, key string) (int64, error) {
	t := st.t
	for {
		resp, err := st.recv(ctx)
		if err != nil {
			return 0, err
		}
		if resp.WatchId == id && resp.Created {
			if key == "" {
				return 0, nil
			}
			if resp.Header.Revision > t.hdr.Revision {
				if err := t.settle(ctx, resp.Header.Revision); err != nil {
					return 0, err
				}
				if len(t.ahead) == 0 || string(t.ahead[len(t.ahead)-1].Key) != key {
					return 0, nil
				}
			}
		}
		if rev := t.deleted(resp, id); rev > 0 {
			return rev, nil
		}
	}
}

// confirm makes the turn ours at rev, the revision of the last key ahead's
// delete, once the stream shows that our own key was not deleted by then:
// it asks for progress and reads up to the answer. Unanswered, it reads.
func (st *stream) confirm(ctx context.Context, rev int64) error {
	t := st.t
	req := &pb.WatchRequest{RequestUnion: &pb.WatchRequest_ProgressRequest{ProgressRequest: &pb.WatchProgressRequest{}}}
	if err := st.pb.Send(req); err != nil {
		return err
	}
	timer := time.AfterFunc(progressWait, func() { st.cancel(errNoProgress) })
	defer timer.Stop()
	for {
		resp, err := st.recv(ctx)
		if errors.Is(context.Cause(st.ctx), errNoProgress) {
			return t.settle(ctx, rev)
		}
		if err != nil {
			return err
		}
		t.deleted(resp, 0)
		if resp.WatchId == progressID && !resp.Created && resp.Header.Revision >= rev {
			t.ahead = nil
			t.hdr = &pb.ResponseHeader{ClusterId: resp.Header.ClusterId, MemberId: resp.Header.MemberId, Revision: rev, RaftTerm: resp.Header.RaftTerm}
			return nil
		}
	}
}

// recv returns the stream's next response. A delete of our own key (after
// our last read) is an error wrapping ErrSessionExpired, and so is a
// cancelled watch of our own key or of the key we wait for.
func (st *stream) recv(ctx context.Context) (*pb.WatchResponse, error) {
	resp, err := st.pb.Recv()
	if err != nil {
		return nil, err
	}
	if resp.Canceled && (resp.WatchId == ownWatch || resp.WatchId == st.cur) {
		return nil, fmt.Errorf("etcdsync: watch canceled: %s", resp.CancelReason)
	}
	if rev := st.t.deleted(resp, ownWatch); rev > 0 {
		return nil, fmt.Errorf("%w (revision %d)", errOwnKeyGone, rev)
	}
	return resp, nil
}

// deleted returns the revision of a delete that resp reports for watch id
// after our last read, else 0.
func (t *turn) deleted(resp *pb.WatchResponse, id int64) int64 {
	if resp.WatchId != id {
		return 0
	}
	for _, ev := range resp.Events {
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision {
			return ev.Kv.ModRevision
		}
	}
	return 0
}

// create asks for a watch of key's deletes from the current revision.
func (st *stream) create(id int64, key string) error {
	st.cur = id
	return st.pb.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CreateRequest{
		CreateRequest: &pb.WatchCreateRequest{
			Key:     []byte(key),
			WatchId: id,
			Filters: []pb.WatchCreateRequest_FilterType{pb.WatchCreateRequest_NOPUT},
		}}})
}

// drop cancels watch id, a key that is no longer the nearest ahead.
func (st *stream) drop(id int64) error {
	return st.pb.Send(&pb.WatchRequest{RequestUnion: &pb.WatchRequest_CancelRequest{
		CancelRequest: &pb.WatchCancelRequest{WatchId: id}}})
}

// settle re-reads the keys up to ours at a revision of at least atLeast
// (serializable when the member is that recent, else linearizable) and
// updates t. It returns an error wrapping ErrSessionExpired when our key is gone.
func (t *turn) settle(ctx context.Context, atLeast int64) error {
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

// createGrace is how long an acquire's create may run on after the caller's
// context (or the session) ended: long enough to learn, in most cases, whether
// it committed, so that the cleanup knows what to delete.
const createGrace = time.Second

// acquire takes the slot's key for one hold: it reserves the key in the
// session, enqueues, and (in waitTurn mode) waits for its turn. ctx bounds it
// all; the session's end also ends it. A ctx that has ended sends nothing. On
// error no key is left behind: the cleanup runs under a bounded context of
// its own, and a create whose outcome stays unknown is swept by the session
// however late it is applied. The reservation is freed. In tryTurn mode a held
// name gives an error wrapping ErrLocked. A hold is returned only while the
// session lives.
func (sl slot) acquire(ctx context.Context, val string, m mode) (*hold, []byte, error) {
	if err := ctx.Err(); err != nil {
		return nil, nil, sl.why(ctx, err)
	}
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
	// It runs on while ctx lives, and for createGrace after ctx ends.
	ectx, ecancel := context.WithCancel(context.WithoutCancel(wctx))
	defer ecancel()
	stopGrace := context.AfterFunc(wctx, func() { time.AfterFunc(createGrace, ecancel) })
	defer stopGrace()
	var t turn
	var err error
	if m == tryTurn {
		t, err = sl.tryEnqueue(ectx)
	} else {
		t, err = sl.enqueue(ectx, val)
	}
	unknown := err != nil && t.wrote // the create failed, and may yet be applied
	hdr := t.hdr
	switch {
	case err != nil:
	case wctx.Err() != nil:
		err = wctx.Err()
	case len(t.ahead) > 0 && m == tryTurn:
		err = fmt.Errorf("%w: %s is held by %s (create revision %d)", ErrLocked, sl.name(), t.ahead[0].Key, t.ahead[0].CreateRevision)
	case len(t.ahead) > 0:
		hdr, err = t.wait(wctx)
	}
	var h *hold
	if err == nil {
		if h = newHold(sl, t.rev, hdr); !h.live() { // the session ended at this instant
			err = sl.s.endedErr()
		}
	}
	if err == nil {
		return h, t.value, nil
	}
	err = sl.why(ctx, err)
	if t.wrote {
		err = errors.Join(err, sl.withdraw(t.rev))
	}
	if unknown {
		sl.s.sweep(sl.key)
	}
	if h != nil {
		h.finish(err)
	} else {
		sl.s.releaseKey(sl.key)
	}
	return nil, nil, err
}

// unsure reports whether a write that failed with err may have been applied,
// or may still be: anything but the server's definite refusal.
func unsure(err error) bool {
	code := status.Code(err)
	if ee := (rpctypes.EtcdError{}); errors.As(err, &ee) {
		code = ee.Code()
	}
	switch code {
	case codes.InvalidArgument, codes.PermissionDenied, codes.Unauthenticated,
		codes.FailedPrecondition, codes.NotFound, codes.OutOfRange:
		return false
	}
	return true
}

// why wraps err with what ended the call: the caller's context, or the session.
func (sl slot) why(ctx context.Context, err error) error {
	switch {
	case ctx.Err() != nil:
		return fmt.Errorf("etcdsync: acquire %s: %w", sl.name(), ctx.Err())
	case sl.s.ctx.Err() != nil:
		return sl.s.endedErr()
	}
	return err
}
