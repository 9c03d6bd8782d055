package etcdsync

// A wait's watch stream: the watches of one waiter's own key and of the keys
// it waits for, all through the client's Watcher, on one gRPC stream of the
// wait's own (waitContext); responses matched to keys by the channel they
// came on, never by watch IDs; and the probe that asks, off the critical
// path, whether the client's servers answer progress requests (caps.go).

import (
	"context"
	"fmt"
	"reflect"
	"slices"
	"strconv"
	"sync/atomic"
	"time"

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

// stream is a waiter's watches: one of its own key and one of each of the
// nearest keys that block it, all through the client's Watcher, from the
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
	// ownSeen is set once the watch of our own key has shown its creation:
	// a progress answer on it counts only from then on.
	ownSeen bool
	trust   bool // progress answers may confirm the turn (see caps)
	// probe fires when the probe (see caps.probing), a progress request sent
	// once our own key's watch was created, has gone unanswered for
	// progressWait; nil when none is out. probeEnd is when it fires.
	// confirming is set while confirm waits for its own request's answer,
	// which tells the client what a probe would (no probe is sent then).
	confirming bool
	probe      <-chan time.Time
	probeEnd   time.Time
	stopTimer  func() bool
}

// waitSeq numbers waits, so that each has a stream of its own (waitContext).
var waitSeq atomic.Uint64

// waitContext marks the watches and progress requests of one wait with
// metadata of their own, so that the client's Watcher (which groups watches
// on gRPC streams by their contexts' outgoing metadata) puts them on a
// stream of their own: a progress request then concerns, and its answer
// reaches, this waiter's watches only, at any queue length.
//
// Waits do not share streams: the client's Watcher (3.7.3 and before,
// etcd-io/etcd#21969) panics when a progress answer, which it hands to
// every watch of the stream, meets a watch whose cancel it has just
// received and not yet finished; on a shared stream, other waits' progress
// answers come at any time, and their cancels often. On a stream of its
// own, a wait asks for progress only before it cancels its watches.
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
func (st *stream) add(key string) watchOf {
	ctx, cancel := context.WithCancel(context.WithoutCancel(st.ctx))
	return watchOf{ch: st.t.s.client.Watch(ctx, key, clientv3.WithFilterPut(), clientv3.WithCreatedNotify()), cancel: cancel}
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

// receive returns the next response of a watch, or fired when timer fires
// first (a nil timer never does), or ctx's error when ctx ends first.
func (st *stream) receive(ctx context.Context, timer <-chan time.Time) (r keyed, fired bool, err error) {
	cases := make([]reflect.SelectCase, 0, 3+len(st.keys)+len(st.also))
	keys := make([]string, 0, 1+len(st.keys)+len(st.also))
	cases = append(cases,
		reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(ctx.Done())},
		reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(timer)},
		reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(st.own.ch)})
	keys = append(keys, st.t.key)
	for _, ws := range []map[string]watchOf{st.keys, st.also} {
		for key, w := range ws {
			cases = append(cases, reflect.SelectCase{Dir: reflect.SelectRecv, Chan: reflect.ValueOf(w.ch)})
			keys = append(keys, key)
		}
	}
	i, v, ok := reflect.Select(cases)
	switch i {
	case 0:
		return keyed{}, false, ctx.Err()
	case 1:
		return keyed{}, true, nil
	}
	r = keyed{key: keys[i-2], closed: !ok}
	if ok {
		r.wr = v.Interface().(clientv3.WatchResponse)
	}
	return r, false, nil
}

// recv returns the next response of a watch. A delete of our own key
// (after our last read), or of another key of the acquire, is an error
// wrapping ErrSessionExpired; a failed watch of our own key or of a key we
// wait for is an error.
func (st *stream) recv(ctx context.Context) (keyed, error) {
	for {
		r, fired, err := st.receive(ctx, st.probe)
		switch {
		case err != nil:
			return keyed{}, err
		case fired:
			st.probe = nil
			st.t.s.caps.unanswered()
		default:
			return r, st.check(r)
		}
	}
}

// sendProbe sends the probe (see caps.probing), once our own key's watch
// was created, if the client wants one. Its answer is noted by check; its
// silence by recv, once progressWait has passed.
func (st *stream) sendProbe() {
	if st.confirming || !st.t.s.caps.probing() || st.t.s.client.RequestProgress(st.ctx) != nil {
		return
	}
	timer := time.NewTimer(progressWait)
	st.probe, st.probeEnd, st.stopTimer = timer.C, time.Now().Add(progressWait), timer.Stop
}

// stopProbe stops the probe's timer, if one is out.
func (st *stream) stopProbe() {
	if st.probe != nil {
		st.stopTimer()
		st.probe = nil
	}
}

// check returns the error r means, if any (see recv), and notes the
// creation of our own key's watch (then sends the probe) and the answers to
// progress requests on it.
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
		return fmt.Errorf("%w: %s, of the same acquire, was deleted", errOwnKeyGone, r.key)
	case !mine:
		return nil
	case r.wr.Created:
		st.ownSeen = true
		st.sendProbe()
	case st.ownSeen && r.wr.IsProgressNotify():
		st.stopProbe()
		st.t.s.caps.answer()
	}
	if rev := st.t.deleted(r.wr); rev > 0 {
		return fmt.Errorf("%w (revision %d)", errOwnKeyGone, rev)
	}
	return nil
}
