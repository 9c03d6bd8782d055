package etcdsync

// The wait on deletes: how a waiter whose key was created behind others
// learns that its turn came, or that its own key went.
//
// A waiter watches its own key and the nearest keys that block it (see
// turn.nearest) on a watch stream of its own (watchstream.go). Older keys
// can only vanish, never appear, so when the last key that blocks it goes
// the waiter owns the turn with no further RPC: a progress request on its
// stream shows its own key still there, or, where the server's answers
// cannot be trusted or do not come (caps.go), one read does. When its own
// key goes first it returns ErrSessionExpired. When keys it does not watch
// were listed ahead, a delete of one it watches makes it read what is left.

import (
	"context"
	"slices"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

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
			if err := sleep(ctx, retryPause); err != nil {
				return nil, err
			}
			if err := t.settle(ctx, t.hdr.Revision); err != nil && final(err) {
				return nil, err
			}
		}
	}
	return t.hdr, nil
}

// progressWait bounds the wait for the answer to a progress request. etcd's
// gRPC proxy never answers one, and a member answers only once every watch
// on the stream is synced; unanswered, the waiter reads instead, and the
// client is marked as one whose progress requests go unanswered (see caps).
// A client learns that off the critical path: the first waits on it send a
// probe as soon as they watch, and one that waits progressWait learns the
// answer before its turn comes; a turn that comes sooner waits for the
// probe's answer no longer than the probe's own progressWait.
const progressWait = 500 * time.Millisecond

// lateAnswerWait bounds the wait for the answer to a progress request on a
// client whose servers have answered one before: there a missing answer is
// a late one (a loaded member; or a request a member dropped because a
// watch of the stream was catching up after a resume), so the waiter asks
// again every progressWait rather than adding a read, herd-like, to the
// load that made the answer late; past lateAnswerWait it reads.
const lateAnswerWait = 2 * time.Second

// watch watches our key and the nearest keys ahead and waits. It returns
// nil when the turn came (nothing blocks us), an error wrapping
// ErrSessionExpired when our key went, or another error when a watch
// failed.
//
// It watches our own key and the nearest keys that block us (turn.nearest):
// the nearest ones whose weight exceeds the rule's room, as the turn cannot
// come before one of them goes, and the one behind them too, so that when it
// goes first (while the nearest still block us) the waiter learns, off the
// critical path, what is left ahead: by a read when keys it does not watch
// were listed, else at once. When the turn then comes, the list is exact and
// needs no read. All watches start at the serving member's current revision
// (start 0), so the server puts them in its synced set at once (a watch from
// a past revision waits up to 100 ms for the server's resync). Two things
// follow:
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
//
// Handoff: when a watched key's delete leaves no more blocking keys listed
// than the rule allows (older keys can only vanish, never appear), the turn
// is ours at R, the latest delete of a listed key seen (the watches' channels
// deliver the deletes of different keys in no set order), unless our own key
// went by R (one transaction deleting a whole prefix). A progress request
// settles it: the server answers it, on every watch of the stream, after
// every event up to its current revision (at least R) has gone out. Where
// the server's answer cannot be trusted or does not come (see caps), one
// read at R or later settles it instead. When more keys are listed and all
// of them are watched, they all still block us (their deletes have not
// arrived); when some are not watched, one read says which are gone.
func (t *turn) watch(ctx context.Context) error {
	st := &stream{t: t, ctx: waitContext(ctx), keys: make(map[string]watchOf)}
	st.trust = t.s.caps.progress(ctx, t.s.client) // before the watches: a gap it leaves is read
	st.own = st.add(t.key)
	for _, key := range t.also {
		if st.also == nil {
			st.also = make(map[string]watchOf, len(t.also))
		}
		st.also[key] = st.add(key)
		st.alsoPending++
	}
	defer st.close()
	defer st.stopProbe()
	t.keepNearest()
	for t.blocked() {
		st.watchNearest()
		key, gone, err := st.next(ctx)
		switch {
		case err != nil:
			return err
		case gone == 0: // a read moved the queue: watch the new nearest keys
		default:
			// The list changes only once the turn is confirmed or a read
			// says what is left: a watch that fails meanwhile leaves us
			// as blocked as before.
			rest := slices.DeleteFunc(slices.Clone(t.ahead), func(kv *mvccpb.KeyValue) bool { return string(kv.Key) == key })
			t.gone = max(t.gone, gone)
			switch {
			case addWeights(t.rule.weight(rest), t.far) <= t.rule.room:
				err = st.confirm(ctx, t.gone)
			case t.farN == 0 && st.watchesAll(rest):
				t.ahead = rest // still blocked: nothing to undo if a watch fails
			default:
				err = t.settle(ctx, gone)
			}
			if err != nil {
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

// watchesAll reports whether the stream watches every key of kvs.
func (st *stream) watchesAll(kvs []*mvccpb.KeyValue) bool {
	for _, kv := range kvs {
		if _, ok := st.keys[string(kv.Key)]; !ok {
			return false
		}
	}
	return true
}

// next reads the watches until a watched key ahead is deleted (after our
// last read), and returns it with the delete's revision; or until a watch's
// creation past our last read made us read again (the queue may have moved),
// and returns a revision of 0. A delete of our own key, or of another key of
// the same acquire (turn.also, checked by one read once all are watched), is
// an error wrapping ErrSessionExpired.
func (st *stream) next(ctx context.Context) (string, int64, error) {
	t := st.t
	for {
		r, err := st.recv(ctx)
		if err != nil {
			return "", 0, err
		}
		if _, also := st.also[r.key]; also { // its deletes end the wait (check)
			if r.wr.Created {
				if st.alsoPending--; st.alsoPending == 0 { // all watched: one read shows none went before
					if err := keysAt(ctx, t.s.client, t.also, t.rev, nil); err != nil {
						return "", 0, err
					}
				}
			}
			continue
		}
		if r.wr.Created && r.wr.Header.Revision > t.hdr.Revision {
			return "", 0, t.settle(ctx, r.wr.Header.Revision)
		}
		if _, ok := st.keys[r.key]; ok {
			if rev := t.deleted(r.wr); rev > 0 {
				return r.key, rev, nil
			}
		}
	}
}

// confirm makes the turn ours at rev, the latest delete of a key ahead
// seen, once our own key's watch shows that it was not deleted by then: it
// asks for progress and waits for the answer on that watch. Where progress
// answers cannot be trusted, or the answer does not come within
// progressWait (the client is then marked, see caps; lateAnswerWait on a
// client whose servers answered before), it reads instead.
func (st *stream) confirm(ctx context.Context, rev int64) error {
	t := st.t
	c := t.s.caps
	if !st.trust || c.state.Load() != capsProgress || t.s.client.RequestProgress(st.ctx) != nil {
		return t.settle(ctx, rev)
	}
	wait := progressWait
	if st.probe != nil { // the probe is out: its answer would have come by its end
		wait = max(0, time.Until(st.probeEnd))
	}
	late := time.Now().Add(lateAnswerWait)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	st.confirming = true
	defer func() { st.confirming = false }()
	for {
		r, fired, err := st.receive(ctx, timer.C)
		switch {
		case err != nil:
			return err
		case fired:
			if c.answered.Load() && time.Now().Before(late) && t.s.client.RequestProgress(st.ctx) == nil {
				timer.Reset(min(progressWait, time.Until(late))) // late, not absent: ask again
				continue
			}
			c.unanswered()
			return t.settle(ctx, rev)
		}
		if err := st.check(r); err != nil {
			return err
		}
		switch {
		case r.key != t.key:
		case r.wr.Created && r.wr.Header.Revision > t.hdr.Revision:
			// Our key's watch began after our last read: the gap
			// is read.
			return t.settle(ctx, max(rev, r.wr.Header.Revision))
		case st.ownSeen && r.wr.IsProgressNotify():
			if r.wr.Header.Revision < rev { // a member behind the delete (after a reconnect): wait on
				continue
			}
			t.ahead, t.far, t.farN = nil, 0, 0
			h := r.wr.Header
			t.hdr = &pb.ResponseHeader{ClusterId: h.ClusterId, MemberId: h.MemberId, Revision: rev, RaftTerm: h.RaftTerm}
			return nil
		}
	}
}

// deleted returns the revision of a delete that wr reports after our last
// read, else 0.
func (t *turn) deleted(wr clientv3.WatchResponse) int64 {
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && ev.Kv.ModRevision > t.hdr.Revision {
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
// a client whose serializable reads come from that cache (caps.cached). It returns an error wrapping ErrSessionExpired when our key is gone.
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
	if !t.s.caps.cached() {
		resp, err = t.s.client.Get(ctx, t.prefix, append(opts, clientv3.WithSerializable())...)
	}
	if resp == nil && err == nil || err == nil && resp.Header.Revision < atLeast {
		resp, err = t.s.client.Get(ctx, t.prefix, opts...)
	}
	if err != nil {
		return err
	}
	mine := t.value == nil && !t.wrote // a try that wrote nothing has no key to find
	for _, kv := range resp.Kvs {
		mine = mine || string(kv.Key) == t.key && kv.CreateRevision == t.rev
	}
	if !mine {
		return errOwnKeyGone
	}
	if err := t.list(resp.Kvs, resp.More); err != nil {
		return err
	}
	t.hdr = resp.Header
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
