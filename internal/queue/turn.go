package queue

// A turn (type turn): one key's place in its queue and the wait for it; and
// the wait's watch stream (type stream).
//
// The enqueue transaction writes the keys of one acquire if absent and lists
// the queues in one transaction (or, for a try, writes only where nothing is
// there); its response gives a turn per key, with the keys ahead of it, and
// whether the keys of one acquire share one create revision.
//
// The wait on deletes (turn.wait, turn.watch): older keys can only vanish,
// never appear. A waiter that lists and watches every key that blocks it
// watches the whole prefix on one watch (stream.waitQueue): the event of the
// last one's delete gives it the turn with no further RPC, as the same
// response would show its own key's delete at that revision, and an earlier
// one would have come before it. Any other waiter watches its own key and
// the nearest keys that block it (turn.nearest), and reads what is left when
// one of them goes. When its own key goes first it returns
// ErrSessionExpired.
//
// The stream: the watches a waiter waits on, all through the client's
// Watcher, on one gRPC stream of the wait's own (waitContext): one of the
// whole prefix while it lists and watches every key that blocks it
// (waitQueue: the turn on a delete's event alone), else one of its own key
// and one of each of the nearest keys ahead (next); responses matched to
// watches by the channel they came on, never by watch IDs.

import (
	"context"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
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
	// unlisted: a limited list (Rule.newest) did not reach the oldest key:
	// older keys may block us too. far and farN then count one such key,
	// unseen, so that only a read that lists them lets the turn come.
	unlisted bool
	hdr      *pb.ResponseHeader
	wrote    bool // this call may have written the key
	// also are the keys of the same acquire on other names (a MultiLock's),
	// whose deletes end our wait too (stream.check).
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
	lease := sls[0].session.Lease()
	cmps := make([]clientv3.Cmp, 0, len(sls))
	then := make([]clientv3.Op, 0, 2*len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		list := sl.listOp()
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0))
		then = append(then, clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)), list)
		els = append(els, clientv3.OpGet(sl.key), list)
	}
	resp, err := sls[0].session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
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
				ErrInvalidArgument, ts[i].key, ts[i].rev, ts[i+1].key, ts[i+1].rev)
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
	if t.rule.newest && len(kvs) > 0 && kvs[0].CreateRevision > kvs[len(kvs)-1].CreateRevision {
		kvs = slices.Clone(kvs)
		slices.Reverse(kvs)
	}
	ahead, err := t.blocking(kvs, t.rev)
	if err != nil {
		return err
	}
	t.ahead, t.far, t.farN, t.unlisted = ahead, 0, 0, t.rule.newest && more
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
	return t.session.made(kv) || t.blocked()
}

// tryEnqueue writes our keys only if nothing at all is under any NAME/
// (under NAME/<Rule.free>): one RPC and no write when a name is held. When
// a compare fails although nothing blocks us (only nested keys NAME/x/…, or
// keys that leave us room), it falls back to enqueue. The returned turns
// have keys ahead where a name is held; the caller then withdraws the keys
// it wrote.
func tryEnqueue(ctx context.Context, sls []*Slot, val string) ([]turn, error) {
	lease := sls[0].session.Lease()
	cmps := make([]clientv3.Cmp, 0, 2*len(sls))
	then := make([]clientv3.Op, 0, len(sls))
	els := make([]clientv3.Op, 0, 2*len(sls))
	for _, sl := range sls {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(sl.prefix+sl.rule.free), "=", 0).WithPrefix(),
			clientv3.Compare(clientv3.CreateRevision(sl.key), "=", 0)) // ours may lie outside rule.free
		then = append(then, clientv3.OpPut(sl.key, val, clientv3.WithLease(lease)))
		els = append(els, clientv3.OpGet(sl.key), sl.listOp())
	}
	resp, qerr := sls[0].session.client.Txn(ctx).If(cmps...).Then(then...).Else(els...).Commit()
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
	for i > 0 && w <= t.rule.room {
		i--
		w = addWeights(w, t.rule.weight(t.ahead[i:i+1]))
	}
	if t.rule.exact {
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
	w := t.rule.weight(t.ahead)
	for i := range t.ahead {
		if addWeights(w-t.rule.weight(t.ahead[i:i+1]), t.far) <= t.rule.room {
			return true
		}
	}
	return false
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (t *turn) blocked() bool { return addWeights(t.rule.weight(t.ahead), t.far) > t.rule.room }

// keepNearest keeps of the keys listed ahead only those a waiter watches
// (nearest), as small copies, and the weight and number of the others, so
// that a waiter's memory does not grow with the queue ahead of it.
func (t *turn) keepNearest() {
	near := t.nearest()
	t.far = addWeights(t.far, t.rule.weight(t.ahead[:len(t.ahead)-len(near)]))
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
			st.own, st.queue = st.add(t.key), false
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
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision && (!own || string(ev.Kv.Key) == t.key) {
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
	if !t.session.caps.cached() {
		resp, err = t.session.client.Get(ctx, t.prefix, append(opts, clientv3.WithSerializable())...)
		if err == nil && resp.Header.Revision < atLeast {
			t.session.caps.behind()
		}
	}
	if resp == nil && err == nil || err == nil && resp.Header.Revision < atLeast {
		resp, err = t.session.client.Get(ctx, t.prefix, opts...)
	}
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

// Pause waits retryPause, the pause before a failed request or a broken
// watch is retried, or until ctx ends (returning ctx.Err()).
func Pause(ctx context.Context) error { return sleep(ctx, retryPause) }

// sleep waits d, or until ctx ends (returning ctx.Err()).
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

// keyed is one response of the watch of one key, or (closed) the end of it.
type keyed struct {
	key    string
	wr     clientv3.WatchResponse
	closed bool
}

// watchOf is the watch of one key: its channel, and what ends it.
type watchOf struct {
	ch     clientv3.WatchChan
	cancel context.CancelFunc
}

// stream is a waiter's watches: one of the whole prefix (queue), or one of
// its own key and one of each of the nearest keys that block it; all through the client's Watcher, from the
// serving member's current revision, on one gRPC stream of the wait's own
// (see waitContext). A response is matched to its key by the channel it
// came on, never by a watch ID; the wait reads the channels itself (no
// goroutine of its own stands between the Watcher and the wait).
type stream struct {
	t    *turn
	ctx  context.Context // the wait's, on a stream of its own (waitContext)
	own  watchOf
	keys map[string]watchOf // key ahead -> its watch
	// also are the watches of the other keys of the same acquire (a
	// MultiLock's on its other names): their deletes end the wait too.
	// alsoPending counts those not yet created; once all are, one read
	// shows that none went before.
	also        map[string]watchOf
	alsoPending int
	// queue is set while own watches the whole prefix (see waitQueue), not
	// our own key alone; keys is then empty.
	queue bool
}

// waitSeq numbers waits, so that each has a stream of its own (waitContext).
var waitSeq atomic.Uint64

// waitContext marks the watches of one wait with metadata of their own, so
// that the client's Watcher (which groups watches on gRPC streams by their
// contexts' outgoing metadata) puts them on a stream of their own. Waits
// share no stream with each other or with the caller's own watches: the
// client's Watcher (3.7.3 and before, etcd-io/etcd#21969) panics when a
// progress answer, which it hands to every watch of the stream, meets a
// watch whose cancel it has just received and not yet finished; a caller's
// own progress requests, or its WithProgressNotify watches, would bring
// such answers to a shared stream at any time, and waits cancel often.
func waitContext(ctx context.Context) context.Context {
	return metadata.AppendToOutgoingContext(clientv3.WithRequireLeader(ctx), "etcdsync-wait", strconv.FormatUint(waitSeq.Add(1), 36))
}

// add starts the watch of key's deletes from the current revision. It does
// not wait for the watch's creation (its Created response says so). The
// watch ends when the wait cancels it (close), not with the caller's
// context: the client's Watcher opens the wait's gRPC stream before it
// hands the request over, and closes the stream only when its last watch
// ends, so a watch whose context ended before the handover would leave an
// empty stream open for the client's life.
func (st *stream) add(key string, opts ...clientv3.OpOption) watchOf {
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	return watchOf{ch: st.t.session.client.Watch(ctx, key, append(opts, clientv3.WithFilterPut(), clientv3.WithCreatedNotify())...), cancel: cancel}
}

// close ends every watch.
func (st *stream) close() {
	st.own.cancel()
	for _, w := range st.keys {
		w.cancel()
	}
	for _, w := range st.also {
		w.cancel()
	}
}

// receive returns the next response of a watch, or ctx's error when ctx
// ends first. A response of own is keyed by our own key.
func (st *stream) receive(ctx context.Context) (r keyed, err error) {
	cases := make([]reflect.SelectCase, 0, 2+len(st.keys)+len(st.also))
	keys := make([]string, 0, 1+len(st.keys)+len(st.also))
	cases = append(cases,
		reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ctx.Done())},
		reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(st.own.ch)})
	keys = append(keys, st.t.key)
	for _, ws := range []map[string]watchOf{st.keys, st.also} {
		for key, w := range ws {
			cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(w.ch)})
			keys = append(keys, key)
		}
	}
	i, v, ok := reflect.Select(cases)
	if i == 0 {
		return keyed{}, ctx.Err()
	}
	r = keyed{key: keys[i-1], closed: !ok}
	if ok {
		r.wr = v.Interface().(clientv3.WatchResponse)
	}
	return r, nil
}

// recv returns the next response of a watch. A delete of our own key
// (after our last read), or of another key of the acquire, is an error
// wrapping ErrSessionExpired; a failed watch of our own key or of a key we
// wait for is an error.
func (st *stream) recv(ctx context.Context) (keyed, error) {
	r, err := st.receive(ctx)
	if err != nil {
		return keyed{}, err
	}
	return r, st.check(r)
}

// check returns the error r means, if any (see recv).
func (st *stream) check(r keyed) error {
	_, watched := st.keys[r.key]
	_, also := st.also[r.key]
	mine := r.key == st.t.key
	switch {
	case !watched && !mine && !also: // a watch dropped since
		return nil
	case r.closed:
		return fmt.Errorf("etcdsync: watch of %s ended", r.key)
	case r.wr.Canceled || r.wr.Err() != nil:
		return fmt.Errorf("etcdsync: watch of %s canceled: %w", r.key, r.wr.Err())
	case also && slices.ContainsFunc(r.wr.Events, func(ev *clientv3.Event) bool {
		return ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > st.t.rev // not an older incarnation's, replayed by a member behind
	}):
		return fmt.Errorf("%w: %s, of the same acquire, was deleted", ErrOwnKeyGone, r.key)
	case !mine:
		return nil
	}
	if rev := st.t.deleted(r.wr, st.queue); rev > 0 {
		return fmt.Errorf("%w (revision %d)", ErrOwnKeyGone, rev)
	}
	return nil
}

// watchQueue makes the stream watch the whole prefix in place of our own key
// and the keys ahead, unless it does already.
func (st *stream) watchQueue() {
	if st.queue {
		return
	}
	st.own.cancel()
	for key, w := range st.keys {
		w.cancel()
		delete(st.keys, key)
	}
	st.own, st.queue = st.add(st.t.prefix, clientv3.WithPrefix()), true
}

// toQueue reads what is left ahead after a key it watched went at gone (it
// has keys ahead it does not watch), moving to the watch of the whole
// prefix first: the read comes once that watch is created, at or past the
// revision it starts from, so that the watch misses nothing the read does
// not show. (Read first and watch after, and a write between the two, such
// as the predecessor's release, would need a second read.) When the read
// leaves the waiter with keys ahead it does not list, turn.watch goes back
// to watching keys one by one.
func (st *stream) toQueue(ctx context.Context, gone int64) error {
	t := st.t
	st.watchQueue()
	for {
		r, err := st.recvOwn(ctx)
		switch {
		case err != nil:
			return err
		case r.wr.Created:
			return t.settle(ctx, max(gone, r.wr.Header.Revision))
		}
	}
}

// recvOwn returns the next response of own (the watch of the prefix, or of
// our own key), seeing to those of the acquire's other keys (alsoSeen) on
// the way.
func (st *stream) recvOwn(ctx context.Context) (keyed, error) {
	for {
		r, err := st.recv(ctx)
		if err != nil || r.key == st.t.key {
			return r, err
		}
		if _, err := st.alsoSeen(ctx, r); err != nil {
			return keyed{}, err
		}
	}
}

// alsoSeen reports whether r is of the watch of another key of the same
// acquire (turn.also), whose deletes end the wait (check); once all of
// those watches are created, one read shows that none of the keys went
// before.
func (st *stream) alsoSeen(ctx context.Context, r keyed) (bool, error) {
	if _, also := st.also[r.key]; !also {
		return false, nil
	}
	if r.wr.Created {
		if st.alsoPending--; st.alsoPending == 0 {
			return true, keysAt(ctx, st.t.session.client, st.t.also, st.t.rev, nil)
		}
	}
	return true, nil
}

// waitQueue waits on one watch of the whole prefix, for a waiter that
// lists every key that blocks it and watches them all (turn.single): a
// delete of any of them may give it the turn. etcd sends the events of one
// revision for one watch in one response, and one watch's events in
// revision order, resumed in order after a reconnect; so when the response
// with the last blocking key's delete shows no delete of our own key, our
// key was there at that revision, and the turn is ours with no further
// request. It returns nil when the turn came, or when a read (the watch was
// created past our last read) left the waiter no longer single; an error
// wrapping ErrSessionExpired when our key went; another error when the
// watch failed.
//
// The watch replaces the watches of our own key and of the keys ahead, and
// starts at the serving member's current revision, so that the server puts
// it in its synced set at once. The gap between our last read and its
// creation is read (as in next). Events at or below our last read are
// replays by a member behind it, and are ignored; so are deletes of keys
// that do not block us (keys behind ours, other names nested under ours).
func (st *stream) waitQueue(ctx context.Context) error {
	t := st.t
	st.watchQueue()
	for t.blocked() && t.single() {
		r, err := st.recvOwn(ctx)
		switch {
		case err != nil:
			return err
		case r.wr.Created:
			if r.wr.Header.Revision > t.hdr.Revision {
				if err := t.settle(ctx, r.wr.Header.Revision); err != nil {
					return err
				}
			}
			continue
		}
		for _, ev := range r.wr.Events {
			i := slices.IndexFunc(t.ahead, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == string(ev.Kv.Key) })
			if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision && i >= 0 {
				t.ahead = slices.Delete(t.ahead, i, i+1)
				t.gone = max(t.gone, ev.Kv.ModRevision)
			}
		}
		switch {
		case !t.blocked():
			t.ahead, t.far, t.farN = nil, 0, 0
			h := r.wr.Header
			t.hdr = &pb.ResponseHeader{ClusterId: h.ClusterId, MemberId: h.MemberId, Revision: t.gone, RaftTerm: h.RaftTerm}
		case !t.single(): // only the far keys, which it does not list, can give it the turn now: read them
			if err := t.settle(ctx, t.gone); err != nil {
				return err
			}
		}
	}
	return nil
}

// watchNearest makes the stream watch the nearest keys that block us (see
// turn.nearest), and only those.
func (st *stream) watchNearest() {
	near := st.t.nearest()
	for key, w := range st.keys {
		if !slices.ContainsFunc(near, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key }) {
			w.cancel()
			delete(st.keys, key)
		}
	}
	for _, kv := range near {
		if _, ok := st.keys[string(kv.Key)]; !ok {
			st.keys[string(kv.Key)] = st.add(string(kv.Key))
		}
	}
}

// next reads the watches until a watched key ahead is deleted (after our
// last read), and returns the delete's revision; or until a watch's
// creation past our last read made us read again (the queue may have moved),
// and returns 0. A delete of our own key, or of another key of
// the same acquire (turn.also, checked by one read once all are watched), is
// an error wrapping ErrSessionExpired.
func (st *stream) next(ctx context.Context) (int64, error) {
	t := st.t
	for {
		r, err := st.recv(ctx)
		if err != nil {
			return 0, err
		}
		if also, err := st.alsoSeen(ctx, r); also || err != nil {
			if err != nil {
				return 0, err
			}
			continue
		}
		if r.wr.Created && r.wr.Header.Revision > t.hdr.Revision {
			return 0, t.settle(ctx, r.wr.Header.Revision)
		}
		if _, ok := st.keys[r.key]; ok {
			if rev := t.deleted(r.wr, false); rev > 0 {
				return rev, nil
			}
		}
	}
}
