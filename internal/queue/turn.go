package queue

// The wait on deletes (turn.wait, turn.watch): older keys can only vanish,
// never appear. The first waiters of a queue (place.front: at most two behind
// the keys that hold) list every key that blocks them and watch the whole
// prefix on one watch (stream.waitQueue): the event of the last one's delete
// gives the turn with no further RPC, as the same response would show its
// own key's delete at that revision, and an earlier one would have come
// before it. Any other waiter watches its own key and a few keys ahead
// (place.watched), chosen so that a delete reaches it only when it may have
// come to the front or to its turn; it then reads (turn.settle): the keys
// it keeps and its own, one bounded request, when it keeps all that blocks
// it, else the queue. When its own key goes first it returns
// ErrSessionExpired. The watches themselves are in stream.go. A turn is
// made from the enqueue's reply (turn.queued), with its place in the queue
// (place.go).

import (
	"context"
	"errors"
	"fmt"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// recheckKeys bounds the keys a waiter rereads one by one (turn.recheck);
// with more kept it lists the queue (a Semaphore of large capacity).
const recheckKeys = 63

// turn is one acquire's wait for a key's turn: the key's place in its
// queue, our key's value if it existed, and the header of the last read.
type turn struct {
	place
	value []byte // our key's value when it already existed (non-nil), else nil
	hdr   *pb.ResponseHeader
	wrote bool // this call may have written the key
	// also are the keys of the same acquire on other names (a MultiLock's),
	// whose deletes end our wait too (stream.check).
	also []string
	// gone is the latest delete of a key listed ahead seen since: one
	// stream delivers the deletes of different watches out of revision
	// order (a watch's events wait until the server has sent its creation),
	// and the turn comes no earlier than the latest.
	gone int64
}

// queued fills t from an enqueue's responses for its slot (rs: the get of
// our key, empty after a put, and the list): our key as it already was, if
// the response has it (it must have our lease and, under a rule that weighs
// keys, the value val asks for), and the keys ahead of it (t.rev: our key's
// create revision if it is new). When a limited list leaves it unsure
// whether anything blocks us (only keys that do not block, or keys newer
// than our existing key, were listed), it lists them all (one more RPC,
// bounded by ctx).
func (t *turn) queued(ctx context.Context, rs []*pb.ResponseOp, val string) error {
	var own *mvccpb.KeyValue
	if kvs := rs[0].GetResponseRange().GetKvs(); len(kvs) > 0 { // none after a put
		own = kvs[0]
		if lease := t.session.Lease(); clientv3.LeaseID(own.Lease) != lease {
			return fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, t.key, own.Lease, int64(lease))
		}
		if t.rule.weigh != nil && string(own.Value) != val { // a restarted process's key, resumed
			return fmt.Errorf("%w: key %s exists with %q, and this call asks for %q: acquire it as it is, then release it", ErrInvalidArgument, t.key, own.Value, val)
		}
		t.rev, t.value = own.CreateRevision, append([]byte{}, own.Value...)
	}
	rr := rs[1].GetResponseRange()
	if err := t.list(rr.Kvs, rr.More); err != nil {
		return err
	}
	if t.unlisted && (own != nil || len(t.ahead) < t.needs()) {
		if err := t.relist(ctx, t.hdr.Revision, true); err != nil {
			return err
		}
	}
	if own != nil {
		t.wrote = t.mine(own) // after t.ahead: a waiting key is ours to withdraw
	}
	return nil
}

// needs is how many blocking keys a limited list must show to be enough:
// a waiter, one more than the front holds (place.front), as fewer with
// older keys unlisted leave it unsure whether it is at the front (the
// second in line behind keys of nested names would watch its predecessor
// alone and read on its release); a try that wrote nothing needs one (the
// name is taken).
func (t *turn) needs() int {
	if !t.wrote {
		return 1
	}
	return frontKeys + 1
}

// mine reports whether a key of ours that existed before this call is this
// call's to withdraw if it fails: one this session made (a create applied
// late), or a restarted process's key (WithLease) that still waits; never a
// restarted process's hold.
func (t *turn) mine(kv *mvccpb.KeyValue) bool {
	return t.session.made(kv) || t.blocked()
}

// wait blocks until the keys ahead of ours no longer block it (see rule),
// then returns the header of the revision at which the turn came. It returns ErrSessionExpired (wrapped) as
// soon as our own key vanishes, and ctx's error when ctx ends; it leaves the
// key in place either way (the caller withdraws it).
func (t *turn) wait(ctx context.Context) (*pb.ResponseHeader, error) {
	for t.blocked() {
		err := t.watch(ctx)
		switch {
		case err == nil:
		case ctx.Err() != nil:
			return nil, ctx.Err()
		case final(err):
			return nil, err
		default:
			// The stream broke (member restart, lost leader, compaction):
			// re-read where we stand and watch again.
			if err := Pause(ctx); err != nil {
				return nil, err
			}
			if err := t.settle(ctx, t.hdr.Revision); err != nil && final(err) {
				return nil, err
			}
		}
	}
	return t.hdr, nil
}

// watch watches the keys that block us and waits. It returns nil when the
// turn came (nothing blocks us), an error wrapping ErrSessionExpired when
// our key went, or another error when a watch failed.
//
// A waiter at the front (place.front: the first waiters of a queue, which
// list every key that blocks them) watches the whole prefix on one watch
// and takes its turn on the event of the last blocking key's delete
// (stream.waitQueue). Any other waiter watches its own key and the run of
// keys ahead that place.watched gives (a Mutex's waiter: the third key
// ahead); when one of them goes it reads (stream.moved), off the critical
// path, until it is at the front or its turn came. All watches start at
// the serving member's current revision (start 0), so the server puts them
// in its synced set at once (a watch from a past revision waits up to 100
// ms for the server's resync). Two things follow:
//
//   - The member may be ahead of our last read (t.hdr): writes between the read
//     and a watch's creation leave a gap, which one read at the created
//     revision closes.
//   - The member may lag behind our last read (a follower cut off from its
//     peers for a moment still serves watches): the stream then replays events
//     up to our read, such as the delete of an older incarnation of a key we
//     watch (same session, unlocked and locked again). A delete at or below the
//     revision of the read that saw the key present cannot be that key's
//     delete, so every event at or below t.hdr.Revision is ignored.
func (t *turn) watch(ctx context.Context) (err error) {
	st, err := openStream(ctx, t)
	if err != nil {
		return err
	}
	defer func() { st.close(err) }()
	t.keepNearest()
	if t.front() {
		st.own, st.queue = st.add(t.prefix, clientv3.WithPrefix()), true
	} else {
		st.own = st.add(t.key)
	}
	for _, key := range t.also {
		if st.also == nil {
			st.also = make(map[string]watchOf, len(t.also))
		}
		st.also[key] = st.add(key)
		st.alsoPending++
	}
	for t.blocked() {
		if t.front() {
			if err := st.waitQueue(ctx); err != nil {
				return err
			}
			continue
		}
		if st.queue { // no longer at the front (a reader whose nearest writer went): watch keys
			st.own.cancel()
			st.own, st.queue = st.add(t.key), false
		}
		st.watchKeys()
		key, gone, err := st.next(ctx)
		if err == nil && gone > 0 { // a key it watches went: read what is left
			t.gone = max(t.gone, gone)
			err = st.moved(ctx, key, gone)
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// deleted returns the revision of a delete that wr reports after our last
// read, else 0: of any key it reports, or with own (wr is of a watch of the
// whole prefix) of our own key.
func (t *turn) deleted(wr clientv3.WatchResponse, own bool) int64 {
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision && (!own || string(ev.Kv.Key) == t.key) {
			return ev.Kv.ModRevision
		}
	}
	return 0
}

// settle re-reads where we stand at a revision of at least atLeast and of
// the latest delete seen, and updates t: when it keeps every key that
// blocks it, those keys and our own, one by one (recheck); else the keys
// up to ours (relist). It returns an error wrapping ErrSessionExpired when
// our key is gone.
func (t *turn) settle(ctx context.Context, atLeast int64) error {
	var err error
	if t.farN == 0 && !t.unlisted && len(t.ahead) <= recheckKeys {
		err = t.recheck(ctx, atLeast)
	} else {
		err = t.relist(ctx, atLeast, false)
		if err == nil && t.unlisted && len(t.ahead) < t.needs() { // keys that do not block filled the list
			err = t.relist(ctx, atLeast, true)
		}
	}
	if err != nil {
		return err
	}
	t.keepNearest()
	return nil
}

// reread is settle for a waiter that watches keys ahead one by one: with
// keys ahead it does not keep, it rereads those it keeps and its own
// (recheck), and lists the queue (settle) only when the keys it keeps no
// longer keep it from the front, so that a waiter far back (a Semaphore's,
// whose holders release in any order) reads no more than its kept keys as
// keys ahead of it go.
func (t *turn) reread(ctx context.Context, atLeast int64) error {
	if (t.farN > 0 || t.unlisted) && len(t.ahead) > 0 && len(t.ahead) <= recheckKeys {
		if err := t.recheck(ctx, atLeast); err != nil {
			return err
		}
		if t.rule.weight(t.ahead) > addWeights(t.rule.room, frontKeys) {
			t.keepNearest()
			return nil
		}
	}
	return t.settle(ctx, atLeast)
}

// fresh runs a read, get, serializable (get's extra option) when its
// answer (whose header get returns) is at least atLeast recent, else
// linearizable; linearizable at once on a client whose serializable reads
// came back behind (caps.cached). A cached answer, such as etcd's gRPC
// proxy gives, is a true state at its revision, and when that is too old it
// does not count.
func (t *turn) fresh(atLeast int64, get func(extra ...clientv3.OpOption) (*pb.ResponseHeader, error)) error {
	if !t.session.caps.cached() {
		hdr, err := get(clientv3.WithSerializable())
		if err != nil || hdr.Revision >= atLeast {
			return err
		}
		t.session.caps.behind()
	}
	_, err := get()
	return err
}

// relist is settle's read of the keys up to ours: limited (listOpts)
// unless full.
func (t *turn) relist(ctx context.Context, atLeast int64, full bool) error {
	opts := append(t.listOpts(full), clientv3.WithMaxCreateRev(t.rev))
	var resp *clientv3.GetResponse
	err := t.fresh(max(atLeast, t.gone), func(extra ...clientv3.OpOption) (hdr *pb.ResponseHeader, err error) {
		resp, err = t.session.client.Get(ctx, t.prefix, append(opts[:len(opts):len(opts)], extra...)...)
		if err != nil {
			return nil, err
		}
		return resp.Header, nil
	})
	if err != nil {
		return err
	}
	mine := t.value == nil && !t.wrote // a try that wrote nothing has no key to find
	for _, kv := range resp.Kvs {
		mine = mine || string(kv.Key) == t.key && kv.CreateRevision == t.rev
	}
	if !mine {
		return ErrOwnKeyGone
	}
	if err := t.list(resp.Kvs, resp.More); err != nil {
		return err
	}
	t.hdr = resp.Header
	return nil
}

// recheck is settle's read when the waiter keeps every key that blocks it
// (and reread's when it keeps the nearest): one transaction of gets of our
// own key and of the keys it keeps (at most recheckKeys), whatever the
// queue holds. Keys ahead of ours only vanish, so those of them still there
// (same create revision) are all that blocks us among those it keeps. A
// server whose --max-txn-ops is below those gets refuses them: the queue
// is listed instead (relist).
func (t *turn) recheck(ctx context.Context, atLeast int64) error {
	var resp *clientv3.TxnResponse
	err := t.fresh(max(atLeast, t.gone), func(extra ...clientv3.OpOption) (hdr *pb.ResponseHeader, err error) {
		opts := append([]clientv3.OpOption{clientv3.WithKeysOnly()}, extra...)
		ops := make([]clientv3.Op, 0, 1+len(t.ahead))
		ops = append(ops, clientv3.OpGet(t.key, opts...))
		for _, kv := range t.ahead {
			ops = append(ops, clientv3.OpGet(string(kv.Key), opts...))
		}
		resp, err = t.session.client.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return nil, err
		}
		return resp.Header, nil
	})
	if errors.Is(err, rpctypes.ErrTooManyOps) {
		return t.relist(ctx, atLeast, true)
	}
	if err != nil {
		return err
	}
	same := func(i int, rev int64) bool {
		kvs := resp.Responses[i].GetResponseRange().GetKvs()
		return len(kvs) == 1 && kvs[0].CreateRevision == rev
	}
	if !(t.value == nil && !t.wrote) && !same(0, t.rev) {
		return ErrOwnKeyGone
	}
	for i := len(t.ahead) - 1; i >= 0; i-- { // nearest first (drop)
		if !same(1+i, t.ahead[i].CreateRevision) {
			t.drop(i)
		}
	}
	t.hdr = resp.Header
	return nil
}
