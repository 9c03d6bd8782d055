package etcdsync

// A turn (type turn): one key's place in its queue and the wait for it.
//
// The enqueue transaction writes the keys of one acquire if absent and lists
// the queues in one transaction (or, for a try, writes only where nothing is
// there); its response gives a turn per key, with the keys ahead of it, and
// whether the keys of one acquire share one create revision.
//
// The wait on deletes (turn.wait, turn.watch): older keys can only vanish,
// never appear. A waiter that lists and watches every key that blocks it
// watches the whole prefix on one watch (stream.go): the event of the last
// one's delete gives it the turn with no further RPC, as the same response
// would show its own key's delete at that revision, and an earlier one
// would have come before it. Any other waiter watches its own key and the
// nearest keys that block it (turn.nearest), and reads what is left when
// one of them goes. When its own key goes first it returns
// ErrSessionExpired.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// turn is the outcome of an acquire: our key's create revision, the keys
// ahead of it and the header of the read that listed them.
type turn struct {
	*Slot
	rev   int64
	value []byte // our key's value when it already existed (non-nil), else nil
	ahead []*mvccpb.KeyValue
	// far and farN are the weight and number of blocking keys listed
	// ahead that a waiter does not keep in ahead (see keepNearest): it
	// watches only the nearest, so it keeps only those.
	far  int64
	farN int
	// unlisted: a limited list (rule.newest) did not reach the oldest key:
	// older keys may block us too. far and farN then count one such key,
	// unseen, so that only a read that lists them lets the turn come.
	unlisted bool
	hdr      *pb.ResponseHeader
	wrote    bool // this call may have written the key
	// also are the keys of the same acquire on other names (a MultiLock's),
	// whose deletes end our wait too (stream.go).
	also []string
	// gone is the latest delete of a key listed ahead seen since: one
	// stream delivers the deletes of different watches out of revision
	// order (a watch's events wait until the server has sent its creation),
	// and the turn comes no earlier than the latest.
	gone int64
}

// enqueue writes our keys if absent and reads their queues, in one
// transaction: every key, or (when one exists) none, so that the keys of
// one call share one create revision. A key that already exists with our
// lease is ours: a resumed hold after a restart with WithLease, or a create
// the client retried after it committed. It returns one turn per slot, in
// the slots' order, also with an error (for the cleanup).
func enqueue(ctx context.Context, sls []*Slot, val string) ([]turn, error) {
	lease := sls[0].Session.Lease()
	cmps := make([]clientv3.Cmp, 0, len(sls))
	then := make([]clientv3.Op, 0, 2*len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		list := sl.listOp()
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.Key), "=", 0))
		then = append(then, clientv3.OpPut(sl.Key, val, clientv3.WithLease(lease)), list)
		els = append(els, clientv3.OpGet(sl.Key), list)
	}
	resp, err := sls[0].Session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	return turns(ctx, sls, resp, err, val, true)
}

// turns makes the turns of an enqueue's response (see queued), and checks
// that the keys of one call share one create revision: those this session
// had on some of the names but not all (a restarted process's, WithLease),
// or from different calls, are an error wrapping ErrInvalidArgument (the
// caller withdraws those it may).
//
// Where the transaction wrote, every key has the response's revision; where
// it did not, a key of ours that exists has its own, and one that does not
// would come after every key listed. listed says whether the response has,
// per slot, the get of our key (empty after a put) and the list.
func turns(ctx context.Context, sls []*Slot, resp *clientv3.TxnResponse, err error, val string, listed bool) ([]turn, error) {
	if errors.Is(err, rpctypes.ErrTooManyOps) { // refused: nothing written
		err = fmt.Errorf("%w: %d names in one transaction are more than the server's --max-txn-ops allows (128 by default: 64 names): %w", ErrInvalidArgument, len(sls), err)
	}
	ts := make([]turn, len(sls))
	for i, sl := range sls {
		switch {
		case err != nil:
			ts[i] = turn{Slot: sl, wrote: Unsure(err)}
		case resp.Succeeded:
			ts[i] = turn{Slot: sl, hdr: resp.Header, wrote: true, rev: resp.Header.Revision}
		default:
			ts[i] = turn{Slot: sl, hdr: resp.Header, rev: resp.Header.Revision + 1}
		}
	}
	if err != nil || !listed {
		return ts, err
	}
	var errs []error
	for i := range ts {
		errs = append(errs, ts[i].queued(ctx, resp.Responses[2*i:2*i+2], val))
	}
	if err := errors.Join(errs...); err != nil {
		return ts, err
	}
	for i := range ts[1:] {
		if (ts[i].value == nil) != (ts[i+1].value == nil) || ts[i].rev != ts[i+1].rev {
			return ts, fmt.Errorf("%w: this session's keys on %s (create revision %d) and %s (%d) are not from one acquire: release them first",
				ErrInvalidArgument, ts[i].Key, ts[i].rev, ts[i+1].Key, ts[i+1].rev)
		}
	}
	return ts, nil
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
		if lease := t.Session.Lease(); clientv3.LeaseID(own.Lease) != lease {
			return fmt.Errorf("%w: key %s exists with lease %x, not this session's %x", ErrInvalidArgument, t.Key, own.Lease, int64(lease))
		}
		if t.Rule.weigh != nil && string(own.Value) != val { // a restarted process's key, resumed
			return fmt.Errorf("%w: key %s exists with %q, and this call asks for %q: acquire it as it is, then release it", ErrInvalidArgument, t.Key, own.Value, val)
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

// needs is how many blocking keys a limited list of an enqueue must show
// to be enough: a waiter watches the nearest two; a try that wrote nothing
// needs one (the name is taken).
func (t *turn) needs() int {
	if !t.wrote {
		return 1
	}
	return 2
}

// list sets the keys ahead from kvs, a list of the keys under the prefix
// (listOpts: under a limited list, newest first; more: keys it did not
// reach exist).
func (t *turn) list(kvs []*mvccpb.KeyValue, more bool) error {
	if t.Rule.newest && len(kvs) > 0 && kvs[0].CreateRevision > kvs[len(kvs)-1].CreateRevision {
		kvs = slices.Clone(kvs)
		slices.Reverse(kvs)
	}
	ahead, err := t.blocking(kvs, t.rev)
	if err != nil {
		return err
	}
	t.ahead, t.far, t.farN, t.unlisted = ahead, 0, 0, t.Rule.newest && more
	if t.unlisted && len(ahead) > 0 {
		t.far, t.farN = 1, 1
	}
	return nil
}

// mine reports whether a key of ours that existed before this call is this
// call's to withdraw if it fails: one this session made (a create applied
// late), or a restarted process's key (WithLease) that still waits; never a
// restarted process's hold.
func (t *turn) mine(kv *mvccpb.KeyValue) bool {
	return t.Session.made(kv) || t.blocked()
}

// tryEnqueue writes our keys only if nothing at all is under any NAME/
// (under NAME/<rule.free>): one RPC and no write when a name is held. When
// a compare fails although nothing blocks us (only nested keys NAME/x/…, or
// keys that leave us room), it falls back to enqueue. The returned turns
// have keys ahead where a name is held; the caller then withdraws the keys
// it wrote.
func tryEnqueue(ctx context.Context, sls []*Slot, val string) ([]turn, error) {
	lease := sls[0].Session.Lease()
	cmps := make([]clientv3.Cmp, 0, 2*len(sls))
	then := make([]clientv3.Op, 0, len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.Prefix+sl.Rule.free), "=", 0).WithPrefix(),
			clientv3.Compare(clientv3.CreateRevision(sl.Key), "=", 0)) // ours may lie outside rule.free
		then = append(then, clientv3.OpPut(sl.Key, val, clientv3.WithLease(lease)))
		els = append(els, clientv3.OpGet(sl.Key), sl.listOp())
	}
	resp, qerr := sls[0].Session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
	ts, err := turns(ctx, sls, resp, qerr, val, qerr == nil && !resp.Succeeded)
	if err != nil || resp.Succeeded || slices.ContainsFunc(ts, func(t turn) bool { return t.blocked() || t.value != nil }) {
		return ts, err
	}
	return enqueue(ctx, sls, val)
}

// nearest returns the keys ahead a waiter watches: the nearest ones whose
// weight exceeds the room (the turn cannot come before one of them goes),
// and, unless the rule is exact, the one behind them.
func (t *turn) nearest() []*mvccpb.KeyValue {
	i, w := len(t.ahead), int64(0)
	for i > 0 && w <= t.Rule.room {
		i--
		w = addWeights(w, t.Rule.weight(t.ahead[i:i+1]))
	}
	if t.Rule.exact {
		return t.ahead[i:]
	}
	return t.ahead[max(0, i-1):]
}

// single reports whether the waiter waits on one watch of the whole prefix
// (stream.waitQueue): when it lists every key that blocks it (no far keys:
// the first waiters of a queue, a Mutex's first two), or when the delete of
// one key it lists would give it the turn with the far keys still counted
// (a Semaphore's waiter behind a large acquire): a delete of a listed key
// can then give it the turn, which one watch tells exactly.
func (t *turn) single() bool {
	if t.farN == 0 {
		return true
	}
	w := t.Rule.weight(t.ahead)
	for i := range t.ahead {
		if addWeights(w-t.Rule.weight(t.ahead[i:i+1]), t.far) <= t.Rule.room {
			return true
		}
	}
	return false
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (t *turn) blocked() bool { return addWeights(t.Rule.weight(t.ahead), t.far) > t.Rule.room }

// keepNearest keeps of the keys listed ahead only those a waiter watches
// (nearest), as small copies, and the weight and number of the others, so
// that a waiter's memory does not grow with the queue ahead of it.
func (t *turn) keepNearest() {
	near := t.nearest()
	t.far = addWeights(t.far, t.Rule.weight(t.ahead[:len(t.ahead)-len(near)]))
	t.farN += len(t.ahead) - len(near)
	t.ahead = make([]*mvccpb.KeyValue, len(near))
	for i, kv := range near {
		t.ahead[i] = &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, Value: kv.Value}
	}
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
			if err := Sleep(ctx, RetryPause); err != nil {
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
// A waiter that lists every key that blocks it, and keeps them all
// (turn.single: the first waiters of a queue), watches the whole prefix on
// one watch and takes its turn on the event of the last blocking key's
// delete (stream.waitQueue). Any other waiter watches its own key and the
// nearest keys that block it (turn.nearest): the nearest ones whose weight
// exceeds the rule's room, as the turn cannot come before one of them
// goes, and the one behind them too; it has keys ahead it does not watch,
// so a delete of a key it watches makes it read what is left (settle), off
// the critical path, until it lists all that blocks it. All watches start
// at the serving member's current revision (start 0), so the server puts
// them in its synced set at once (a watch from a past revision waits up to
// 100 ms for the server's resync). Two things follow:
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
func (t *turn) watch(ctx context.Context) error {
	st := &stream{t: t, ctx: waitContext(ctx), keys: make(map[string]watchOf)}
	t.keepNearest()
	if t.single() {
		st.own, st.queue = st.add(t.Prefix, clientv3.WithPrefix()), true
	} else {
		st.own = st.add(t.Key)
	}
	for _, key := range t.also {
		if st.also == nil {
			st.also = make(map[string]watchOf, len(t.also))
		}
		st.also[key] = st.add(key)
		st.alsoPending++
	}
	defer st.close()
	for t.blocked() {
		if t.single() {
			if err := st.waitQueue(ctx); err != nil {
				return err
			}
			continue
		}
		if st.queue { // not expected (a read lists no more than the last), but watch what it listed
			st.own.cancel()
			st.own, st.queue = st.add(t.Key), false
		}
		st.watchNearest()
		gone, err := st.next(ctx)
		if err == nil && gone > 0 { // a key it watches went: read what is left, watching the prefix
			t.gone = max(t.gone, gone)
			err = st.toQueue(ctx, gone)
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
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision && (!own || string(ev.Kv.Key) == t.Key) {
			return ev.Kv.ModRevision
		}
	}
	return 0
}

// settle re-reads the keys up to ours at a revision of at least atLeast and
// of the latest delete seen, and updates t: serializable when the answer is
// that recent (its header's revision is checked: a cached answer, such as
// etcd's gRPC proxy gives, is a true state at its revision, and when that
// is too old it does not count), else linearizable; linearizable at once on
// a client whose serializable reads came back behind (caps.cached). It
// returns an error wrapping ErrSessionExpired when our key is gone.
func (t *turn) settle(ctx context.Context, atLeast int64) error {
	err := t.relist(ctx, atLeast, false)
	if err == nil && t.unlisted && len(t.ahead) < t.needs() { // keys that do not block filled the list
		err = t.relist(ctx, atLeast, true)
	}
	if err != nil {
		return err
	}
	t.keepNearest()
	return nil
}

// relist is settle's read: limited (listOpts) unless full.
func (t *turn) relist(ctx context.Context, atLeast int64, full bool) error {
	atLeast = max(atLeast, t.gone) // a list from before a delete seen would wait for it again
	opts := append(t.listOpts(full), clientv3.WithMaxCreateRev(t.rev))
	var resp *clientv3.GetResponse
	var err error
	if !t.Session.caps.cached() {
		resp, err = t.Session.client.Get(ctx, t.Prefix, append(opts, clientv3.WithSerializable())...)
		if err == nil && resp.Header.Revision < atLeast {
			t.Session.caps.behind()
		}
	}
	if resp == nil && err == nil || err == nil && resp.Header.Revision < atLeast {
		resp, err = t.Session.client.Get(ctx, t.Prefix, opts...)
	}
	if err != nil {
		return err
	}
	mine := t.value == nil && !t.wrote // a try that wrote nothing has no key to find
	for _, kv := range resp.Kvs {
		mine = mine || string(kv.Key) == t.Key && kv.CreateRevision == t.rev
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

func Sleep(ctx context.Context, d time.Duration) error {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-timer.C:
		return nil
	}
}
