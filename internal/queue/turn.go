package queue

// The wait on deletes (turn.wait, turn.watch): older keys can only vanish,
// never appear. A waiter that lists and watches every key that blocks it
// watches the whole prefix on one watch (stream.waitQueue): the event of the
// last one's delete gives it the turn with no further RPC, as the same
// response would show its own key's delete at that revision, and an earlier
// one would have come before it. Any other waiter watches its own key and
// the nearest keys that block it (turn.nearest), and reads what is left when
// one of them goes (turn.settle). When its own key goes first it returns
// ErrSessionExpired. The watches themselves are in stream.go.

import (
	"context"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

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
func (t *turn) watch(ctx context.Context) (err error) {
	st, err := openStream(ctx, t)
	if err != nil {
		return err
	}
	defer func() { st.close(err) }()
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
func Pause(ctx context.Context) error { return Sleep(ctx, retryPause) }

// Sleep waits d, or until ctx ends (returning ctx.Err()).
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
