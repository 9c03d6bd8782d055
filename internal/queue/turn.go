package queue

// The wait on deletes (turn.wait, turn.watch): older keys can only vanish,
// never appear. The first waiters of a queue (turn.front: at most two behind
// the keys that hold) list every key that blocks them and watch the whole
// prefix on one watch (stream.waitQueue): the event of the last one's delete
// gives the turn with no further RPC, as the same response would show its
// own key's delete at that revision, and an earlier one would have come
// before it. Any other waiter watches its own key and a few keys ahead
// (turn.watched), chosen so that a delete reaches it only when it may have
// come to the front or to its turn; it then reads (turn.settle): the keys
// it keeps and its own, one bounded request, when it keeps all that blocks
// it, else the queue. When its own key goes first it returns
// ErrSessionExpired. The watches themselves are in stream.go.

import (
	"context"
	"errors"
	"math"
	"slices"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// frontKeys bounds the front of a queue (turn.front): a waiter is there
// while the blocking weight ahead of it exceeds its room by at most
// frontKeys (a Mutex's first two waiters, a one-permit Semaphore's first
// two), or, under a rule whose keys do not block each other (readers),
// while one key blocks it and fewer than frontKeys keys like its own lie
// between that key and its own (the first two readers behind a writer).
const frontKeys = 2

// keepKeys is how many of the nearest keys ahead a waiter keeps at least
// (turn.keepNearest), so that a reader behind a few writers, or a Mutex's
// waiter, rereads only those when a key it watches goes.
const keepKeys = 4

// recheckKeys bounds the keys a waiter rereads one by one (turn.recheck);
// with more kept it lists the queue (a Semaphore of large capacity).
const recheckKeys = 63

// unknownPeers marks turn.peers or turn.peersNext unknown: keys that
// blocked us went, and how many keys like ours lie behind the nearest one
// left was not read.
const unknownPeers = math.MaxInt

// front reports whether the waiter lists every key that blocks it and is
// at the front of its queue (see frontKeys), or one delete of a key it
// lists would give it the turn (a Semaphore's waiter behind a large
// acquire): it then watches the whole prefix on one watch
// (stream.waitQueue).
func (t *turn) front() bool {
	if t.farN > 0 {
		return false
	}
	w := t.rule.weight(t.ahead)
	if t.rule.peers {
		return t.peers < frontKeys && w <= addWeights(t.rule.room, 1)
	}
	if w <= addWeights(t.rule.room, frontKeys) {
		return true
	}
	for i := range t.ahead {
		if w-t.rule.weight(t.ahead[i:i+1]) <= t.rule.room {
			return true
		}
	}
	return false
}

// frontWithout reports whether the waiter would be blocked and at the
// front once key, a key ahead it keeps, is gone.
func (t *turn) frontWithout(key string) bool {
	i := slices.IndexFunc(t.ahead, func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key })
	if i < 0 {
		return false
	}
	u := *t
	u.ahead = slices.Clone(t.ahead)
	u.drop(i)
	return u.blocked() && u.front()
}

// watched returns the keys ahead a waiter that is not at the front watches
// besides its own: a run of them whose weight exceeds the room, so that the
// turn cannot come before one of them goes, taken past the nearest
// frontKeys keys when the keys behind those weigh enough, so that the
// waiter wakes when it may have come to the front (a Mutex's waiter watches
// the third key ahead of it), else the nearest such run (a reader among
// many behind one writer watches that writer). A key ahead that goes
// without waking the waiter leaves it blocked by the run.
func (t *turn) watched() []*mvccpb.KeyValue {
	i, end := t.watchedRun()
	return t.ahead[i:end]
}

// watchedRun returns the bounds of watched's run in t.ahead. Under a rule
// whose keys ahead may hold together, it takes in keys behind it until
// wakesFirst holds.
func (t *turn) watchedRun() (i, end int) {
	end = max(0, len(t.ahead)-frontKeys)
	if t.rule.weight(t.ahead[:end]) <= t.rule.room {
		end = len(t.ahead)
	}
	i, w := end, int64(0)
	for i > 0 && w <= t.rule.room {
		i--
		w = addWeights(w, t.rule.weight(t.ahead[i:i+1]))
	}
	for end < len(t.ahead) && !t.wakesFirst(i, end) {
		end++
	}
	return i, end
}

// wakesFirst reports whether the delete of a key of the run t.ahead[i:end]
// reaches the waiter before its turn can come, in whatever order the keys
// ahead go: the run less any one of its keys, with the keys behind it that
// wait for it (Rule.waits), still weighs more than the room. Else the turn
// could come on a watched delete (a writer behind three readers that
// watched the oldest, released last), and be taken with a read.
func (t *turn) wakesFirst(i, end int) bool {
	if t.rule.waits == nil {
		return true
	}
	run := t.ahead[i:end]
	w, heaviest := t.rule.weight(run), int64(0)
	for j := range run {
		heaviest = max(heaviest, t.rule.weight(run[j:j+1]))
	}
	w -= heaviest
	for j, kv := range t.ahead[end:] {
		if t.rule.waits(t.prefix, run, kv) {
			w = addWeights(w, t.rule.weight(t.ahead[end+j:end+j+1]))
		}
	}
	return w > t.rule.room
}

// blocked reports whether more weight that blocks us is listed ahead than
// the rule leaves room for.
func (t *turn) blocked() bool { return addWeights(t.rule.weight(t.ahead), t.far) > t.rule.room }

// keepNearest keeps of the keys listed ahead, as small copies, all of them
// at the front, else those from keepStart on; the weight and number of the
// others go into far and farN, so that a waiter's memory does not grow
// with the queue ahead of it.
func (t *turn) keepNearest() {
	start := 0
	if !t.front() {
		start = t.keepStart()
	}
	t.far = addWeights(t.far, t.rule.weight(t.ahead[:start]))
	t.farN += start
	kept := make([]*mvccpb.KeyValue, len(t.ahead)-start)
	for i, kv := range t.ahead[start:] {
		kept[i] = &mvccpb.KeyValue{Key: kv.Key, CreateRevision: kv.CreateRevision, Value: kv.Value}
	}
	t.ahead = kept
}

// keepStart returns the index in t.ahead from which a waiter away from the
// front keeps the keys ahead: the start of its watched run, or earlier, so
// that it keeps at least keepKeys keys and the nearest keys whose weight
// exceeds its room plus twice frontKeys (the front and a run past it). A
// waiter that moves up then rereads those keys, not the queue.
func (t *turn) keepStart() int {
	i, _ := t.watchedRun()
	j, w := len(t.ahead), int64(0)
	for j > 0 && (len(t.ahead)-j < keepKeys || w <= addWeights(t.rule.room, 2*frontKeys)) {
		j--
		w = addWeights(w, t.rule.weight(t.ahead[j:j+1]))
	}
	return min(i, j)
}

// drop removes the key ahead at i, which went. Under a rule whose keys
// like ours do not block us (a reader): when it was the nearest, peers
// takes in those listed between it and the next (they only vanish: at
// most so many), and how many lie before the next is unknown until the
// queue is listed again; when it was the next, how many lie between the
// nearest and the one before is unknown.
func (t *turn) drop(i int) {
	switch n := len(t.ahead); {
	case !t.rule.peers:
	case i == n-1 && t.peersNext != unknownPeers && t.peers != unknownPeers:
		t.peers, t.peersNext = t.peers+t.peersNext, unknownPeers
	case i == n-1:
		t.peers, t.peersNext = unknownPeers, unknownPeers
	case i == n-2:
		t.peersNext = unknownPeers
	}
	t.ahead = slices.Delete(t.ahead, i, i+1)
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
// A waiter at the front (turn.front: the first waiters of a queue, which
// list every key that blocks them) watches the whole prefix on one watch
// and takes its turn on the event of the last blocking key's delete
// (stream.waitQueue). Any other waiter watches its own key and the run of
// keys ahead that turn.watched gives (a Mutex's waiter: the third key
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
