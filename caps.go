package etcdsync

// What the library learns about the servers behind a client (type caps):
// whether a waiter may confirm its turn by a watch progress request
// (stream.confirm) rather than by a read. Learned once per client from the
// servers' versions (Maintenance.Status: releases from 3.6.0 on, see
// progressOrdered), and from whether progress requests are answered at all
// (a probe off the critical path; etcd's gRPC proxy never answers them).

import (
	"context"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"weak"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// caps is what the library has learned about the servers behind one
// client: whether a waiter may confirm its turn by a watch progress request
// (see stream.confirm) rather than by a read.
type caps struct {
	state atomic.Int32 // one of capsUnknown, capsProgress, capsOldServer, capsUnanswered
	mu    sync.Mutex   // one version check at a time
	// answered is set once a progress request on the client was answered:
	// its servers answer them, and a later one that comes late (a member
	// busy or lagging for a moment) does not mark the client.
	answered atomic.Bool
	reprobe  atomic.Int64 // when a client marked unanswered asks again, UnixNano (see probing)
}

const (
	capsUnknown    int32 = iota
	capsProgress         // progress answers confirm a turn
	capsOldServer        // a server released before etcd#15220's fix (see progressOrdered): reads confirm a turn
	capsUnanswered       // a progress request went unanswered: etcd's gRPC proxy, whose serializable reads come from a cache
)

// versionTimeout bounds the version check of a client's servers.
const versionTimeout = time.Second

// clientCaps maps a client (weakly: it does not keep the client alive) to
// its caps.
var clientCaps sync.Map // weak.Pointer[clientv3.Client] -> *caps

// capsOf returns cli's caps, made on first use and dropped when cli is
// garbage.
func capsOf(cli *clientv3.Client) *caps {
	k := weak.Make(cli)
	if c, ok := clientCaps.Load(k); ok {
		return c.(*caps)
	}
	c, loaded := clientCaps.LoadOrStore(k, &caps{})
	if !loaded {
		runtime.AddCleanup(cli, func(k weak.Pointer[clientv3.Client]) { clientCaps.Delete(k) }, k)
	}
	return c.(*caps)
}

// progress reports whether a progress answer may confirm a turn on cli. The
// first call per client asks the server behind each endpoint for its
// version (client.Maintenance.Status, all at once; without endpoints, as
// for an in-process client, once with none), blocking for those calls,
// bounded by ctx and versionTimeout. Only servers released with the fix of
// etcd-io/etcd#15220 are trusted (releases from 3.6.0 on: see
// progressOrdered): before it an answer could overtake the events it
// vouches for. The answer is kept for
// the client once one server answered and none is older; an endpoint that
// does not answer is not counted (a member down at that moment, which etcd's
// upgrade rules keep within one minor version of the others). When none
// answers the caps stay unknown: this call says false, the next one asks
// again.
func (c *caps) progress(ctx context.Context, cli *clientv3.Client) bool {
	if s := c.state.Load(); s != capsUnknown {
		return s == capsProgress
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if s := c.state.Load(); s != capsUnknown {
		return s == capsProgress
	}
	ctx, cancel := context.WithTimeout(ctx, versionTimeout)
	defer cancel()
	eps := cli.Endpoints()
	if len(eps) == 0 {
		eps = []string{""}
	}
	versions := make([]string, len(eps)) // "" where no answer came
	var wg sync.WaitGroup
	for i, ep := range eps {
		wg.Go(func() {
			if resp, err := cli.Status(ctx, ep); err == nil {
				versions[i] = resp.Version
			}
		})
	}
	wg.Wait()
	answered := false
	for _, v := range versions {
		if v == "" {
			continue
		}
		answered = true
		if !progressOrdered(v) {
			c.state.Store(capsOldServer)
			return false
		}
	}
	if answered {
		c.state.Store(capsProgress)
	}
	return answered
}

// unanswered records that a progress request on cli went unanswered (etcd's
// gRPC proxy ignores them): from now on its waiters read instead, and
// linearizably (see cached), until a probe is answered (see probing). A
// client that answered one before is left as it is: that wait reads, later
// ones ask again.
func (c *caps) unanswered() {
	if !c.answered.Load() && c.state.CompareAndSwap(capsProgress, capsUnanswered) {
		c.reprobe.Store(time.Now().Add(reprobeAfter).UnixNano())
	}
}

// answer records that a progress request on the client was answered: its
// servers answer them, whatever a late one said before.
func (c *caps) answer() {
	c.answered.Store(true)
	c.state.CompareAndSwap(capsUnanswered, capsProgress)
}

// reprobeAfter is how long a client marked unanswered goes before one of its
// waits asks again.
const reprobeAfter = time.Minute

// probing reports whether a wait should ask, as soon as it watches, whether
// the client's servers answer progress requests, so that the client learns
// it off the critical path (a wait that lasts progressWait learns it before
// its turn comes): every wait until one was answered, on a client whose
// servers are recent enough; and one wait a reprobeAfter on a client marked
// unanswered, so that it learns again when its servers do answer (a member
// was busy, not a proxy).
func (c *caps) probing() bool {
	switch c.state.Load() {
	case capsProgress:
		return !c.answered.Load()
	case capsUnanswered:
		at, now := c.reprobe.Load(), time.Now()
		return now.UnixNano() >= at && c.reprobe.CompareAndSwap(at, now.Add(reprobeAfter).UnixNano())
	}
	return false
}

// cached reports whether serializable reads on the client are likely served
// from etcd's gRPC proxy's cache, which writes made elsewhere and lease
// expiry do not invalidate: such a read is checked against the revision it
// must reach anyway, but it would mostly be behind, and a linearizable read
// right away saves a round trip.
func (c *caps) cached() bool { return c.state.Load() == capsUnanswered }

// progressOrdered reports whether progress answers of a server of version v
// (major.minor.patch) may confirm a turn: releases from 3.6.0 on.
//
// The property needed is that a member sends the answer to a progress
// request after every event up to its revision. Before the fix of
// etcd-io/etcd#15220 a member answered on its stream's control channel with
// its store's revision while events of that revision could still be queued
// for the watch, so the answer could overtake them (v3rpc/watch.go's
// recvLoop in server v3.5.7: "sws.ctrlStream <- &pb.WatchResponse{Header:
// sws.newResponseHeader(sws.watchStream.Rev()) ..."). The fix (etcd PR
// #15237, in 3.6.0; backported to 3.5.8) answers through the watchers' own
// channel, behind their events, and only while every watcher of the stream
// is synced (mvcc's progressIfSync, the same in v3.5.35 as in v3.7.3). A
// probe cannot tell a member with the fix: before it, answers came in order
// unless a race was lost, so the release is the test.
//
// 3.5.8 and later 3.5 releases have the fix too (measured: no event after
// the answer that covers it, on 3.5.35), but a client is judged once, from
// the versions its endpoints answered with: a 3.5 member before 3.5.8 that
// was down when asked, or rolled back to later, would go unseen, and etcd's
// upgrade rules do not rule that out within one minor line. Until each
// answer is checked against the member that sent it, 3.5 servers read. A
// pre-release (3.6.0-alpha.0 was built from main before the fix) reads too.
func progressOrdered(v string) bool {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) != 3 || strings.ContainsAny(v, "+-") { // strconv.Atoi takes a sign
		return false
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	_, err3 := strconv.Atoi(parts[2]) // a suffix ("-rc.0", "-alpha.0") is not trusted
	if err1 != nil || err2 != nil || err3 != nil {
		return false
	}
	return major > 3 || major == 3 && minor >= 6
}
