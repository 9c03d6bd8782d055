package queue

// A wait's watches (type stream): all through the client's Watcher, on one
// gRPC stream of the wait's own (waitContext): one of the whole prefix while
// the waiter is at the front of its queue (waitQueue: the turn on a
// delete's event alone), else one of its own key and one of each key ahead
// it watches (place.watched, next); responses matched to watches by the
// channel they came on, never by watch IDs.

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"sync/atomic"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/metadata"
)

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
// its own key and one of each key ahead it watches (place.watched); all through the client's Watcher, from the
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

// openStream starts t's wait's stream under ctx (the wait's: the caller's
// bounds and the session's end), entered in the session, so that Close and
// Orphan wait for the wait to end and for its stream's reaper (close). It
// returns the session's end error when the session has ended.
func openStream(ctx context.Context, t *turn) (*stream, error) {
	if !t.session.enter() {
		return nil, t.session.EndedErr()
	}
	return &stream{t: t, ctx: waitContext(ctx), keys: make(map[string]watchOf)}, nil
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

// add starts the watch of key's deletes from the current revision. The
// client's Watcher blocks until the server's Created answer; the watch's
// context is the wait's (the caller's bounds and the session's end), so
// that a link gone silent cannot hold the wait past them. A watch cancelled
// before it was created, or while its stream reconnects, can keep the
// stream open after its last watch ends (the Watcher keeps a nil in its
// queue of watches to create); close then has the stream closed (reap).
func (st *stream) add(key string, opts ...clientv3.OpOption) watchOf {
	ctx, cancel := context.WithCancel(st.ctx)
	return watchOf{ch: st.t.session.client.Watch(ctx, key, append(opts, clientv3.WithFilterPut(), clientv3.WithCreatedNotify())...), cancel: cancel}
}

// close ends every watch and the wait's hold on the session (openStream).
// The stream may then stay open with no watch (see add) when the wait ended
// with its context (the caller's or the session's), on a failed watch, or
// with more than one watch (one may be waiting to be created again after a
// reconnect, which the Watcher does not say): the session's reaper then
// closes it (reap). A wait that ends on its one watch, the prefix's or its
// own key's, leaves none: the Watcher created that watch after every one
// cancelled before it, and it is created again before it delivers anything
// after a reconnect.
func (st *stream) close(err error) {
	st.own.cancel()
	for _, w := range st.keys {
		w.cancel()
	}
	for _, w := range st.also {
		w.cancel()
	}
	s := st.t.session
	if st.ctx.Err() != nil || err != nil && !final(err) || len(st.keys)+len(st.also) > 0 {
		s.goReap(st.reap)
	}
	s.watchers.Done()
}

// reap closes the wait's gRPC stream, should it still be open with no
// watch (reapStream).
func (st *stream) reap(ctx context.Context) {
	reapStream(ctx, st.t.session.client, st.ctx, st.t.key)
}

// reapStream closes the gRPC stream of the watches opened under md (by its
// outgoing metadata), should it still be open with no watch: it adds one
// watch of key to the stream and ends it once the server created it. The
// Watcher drops the empty places in its queue of watches to create as it
// creates the ones behind them, and it closes a stream whose last watch
// ends with nothing left to create. On a stream the Watcher had already
// closed, it opens a stream and closes it. ctx (the session's reap:
// Orphan, the client's end) bounds it; the stream is then left to the
// client's Close.
func reapStream(ctx context.Context, cli *clientv3.Client, md context.Context, key string) {
	wctx, cancel := context.WithCancel(context.WithoutCancel(md))
	defer cancel()
	stop := context.AfterFunc(ctx, cancel)
	defer stop()
	cli.Watch(wctx, key, clientv3.WithFilterPut())
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

// moved reads what is left ahead after key, a key it watched, went at
// gone. A waiter that the delete leaves at the front (as far as the keys it
// keeps tell), or one with keys ahead it does not keep under a rule that
// lets one key hold at a time (a Mutex's waiter whose third key ahead went:
// keys ahead go oldest first, so it is most likely second in line now),
// moves to the watch of the whole prefix first (toQueue). Any other rereads
// first (turn.reread; readers behind a writer take their turn so), and
// moves only if the read leaves it at the front.
func (st *stream) moved(ctx context.Context, key string, gone int64) error {
	t := st.t
	far := t.farN > 0 || t.unlisted
	if far && t.rule.room == 0 || t.frontWithout(key) {
		return st.toQueue(ctx, gone)
	}
	if err := t.reread(ctx, gone); err != nil {
		return err
	}
	if t.blocked() && t.front() {
		return st.toQueue(ctx, gone)
	}
	return nil
}

// toQueue reads what is left ahead after a key it watched went at gone,
// moving to the watch of the whole prefix first: the read comes once that
// watch is created, at or past the revision it starts from, so that the
// watch misses nothing the read does not show. (Read first and watch
// after, and a write between the two, such as the predecessor's release,
// would need a second read.) When the read leaves the waiter away from the
// front, turn.watch goes back to watching keys one by one.
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

// waitQueue waits on one watch of the whole prefix, for a waiter at the
// front of its queue (place.front), which lists every key that blocks it: a
// delete of any of them may give it the turn. etcd sends the events of one
// revision for one watch in one response, and one watch's events in
// revision order, resumed in order after a reconnect; so when the response
// with the last blocking key's delete shows no delete of our own key, our
// key was there at that revision, and the turn is ours with no further
// request. It returns nil when the turn came, or when the waiter is no
// longer at the front (a reader whose nearest writer went); an error
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
	for t.blocked() && t.front() {
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
				t.drop(i)
				t.gone = max(t.gone, ev.Kv.ModRevision)
			}
		}
		if !t.blocked() {
			t.ahead = nil
			h := r.wr.Header
			t.hdr = &pb.ResponseHeader{ClusterId: h.ClusterId, MemberId: h.MemberId, Revision: t.gone, RaftTerm: h.RaftTerm}
		}
	}
	return nil
}

// watchKeys makes the stream watch the keys ahead place.watched gives, and
// only those.
func (st *stream) watchKeys() {
	near := st.t.watched()
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
// last read), and returns the key and the delete's revision; or until a
// watch's creation past our last read made us read again (the queue may
// have moved), and returns revision 0. A delete of our own key, or of
// another key of the same acquire (turn.also, checked by one read once all
// are watched), is an error wrapping ErrSessionExpired.
func (st *stream) next(ctx context.Context) (string, int64, error) {
	t := st.t
	for {
		r, err := st.recv(ctx)
		if err != nil {
			return "", 0, err
		}
		if also, err := st.alsoSeen(ctx, r); also || err != nil {
			if err != nil {
				return "", 0, err
			}
			continue
		}
		if r.wr.Created && r.wr.Header.Revision > t.hdr.Revision {
			return "", 0, t.reread(ctx, r.wr.Header.Revision)
		}
		if _, ok := st.keys[r.key]; ok {
			if rev := t.deleted(r.wr, false); rev > 0 {
				return r.key, rev, nil
			}
		}
	}
}
