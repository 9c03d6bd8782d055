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
