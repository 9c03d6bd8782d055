package tests

// Progress answers: a client learns off the critical path whether its
// progress requests are answered (etcd's gRPC proxy never answers them), and
// a wait is not held up by the answer.

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"math/rand/v2"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Through etcd's gRPC proxy, which never answers a progress request, a
// client's waiters learn that once: only the first wait asks (its probe,
// sent as it watches, and its handoff's confirmation, which waits for the
// probe's answer no longer than progressWait from the probe), the later
// ones read at once. Against a member, every handoff is confirmed by a
// progress request and no RPC, and only the first wait sends a probe. Each
// handoff's latency and critical-path RPCs are logged beside the other's.
func TestCompatProgressLearnedOnce(t *testing.T) {
	t.Parallel()
	progressServer(t)
	if testing.Short() {
		t.Skip("skipped in -short")
	}
	c := single(t)
	proxy := etcdtest.StartGRPCProxy(t, c.Endpoints())
	admin := c.Client(t)
	const handoffs = 5
	for _, tc := range []struct {
		name      string
		endpoints []string
		progress  int // progress requests over the handoffs, besides the first wait's probe
		rpcs      int // unary RPCs between the holder's Unlock and the waiter's Lock, from the 2nd handoff on
	}{
		{"direct", c.Endpoints(), handoffs, 0},
		{"grpcproxy", []string{proxy}, 1, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxCell(t)
			name := "progress-" + tc.name
			cli, calls, cnt := wrappedClient(t, tc.endpoints)
			holder := etcdsync.NewMutex(session(t, admin), name)
			waiter := etcdsync.NewMutex(session(t, cli), name)
			var lat []time.Duration
			for i := range handoffs {
				require.NoError(t, holder.Lock(ctx))
				w := async(func() error { return waiter.Lock(ctx) })
				for range 2 { // the waiter's watches of its key and the holder's
					within(t, cnt.created, cellTimeout, "the waiter's watches created")
				}
				before := cnt.unary.Load()
				start := time.Now()
				require.NoError(t, holder.Unlock(ctx))
				require.NoError(t, resultWithin(t, w, cellTimeout, "handoff"))
				lat = append(lat, time.Since(start))
				if n := cnt.unary.Load() - before; i > 0 {
					require.EqualValues(t, tc.rpcs, n, "RPCs on the critical path of handoff %d", i)
				}
				require.NoError(t, waiter.Unlock(ctx))
			}
			progress := calls.count("RequestProgress")
			// The first wait probes as it watches, unless its turn comes
			// first (its confirmation then tells what the probe would).
			require.Contains(t, []int{tc.progress, tc.progress + 1}, progress, "progress requests over %d handoffs", handoffs)
			t.Logf("%s: handoff latencies (holder's Unlock to the waiter's Lock) %v", tc.name, lat)
		})
	}
}

// On a client whose progress requests were answered before, a missing
// answer is a late one (a member busy for a moment, or a request dropped
// while a watch of the stream caught up): the wait asks again every
// progressWait (500 ms) rather than read, and reads only when none came
// within lateAnswerWait (2 s), and the client stays one whose waits ask.
// Handoff 1's first request is dropped: it asks again and takes no RPC.
// Handoff 2's requests are all dropped: it reads, once, after 2 s.
// Handoff 3 asks once and takes no RPC.
func TestCompatLateProgressKeepsClient(t *testing.T) {
	t.Parallel()
	progressServer(t)
	if testing.Short() {
		t.Skip("skipped in -short")
	}
	c := single(t)
	ctx := ctxCell(t)
	cnt := &counter{created: make(chan struct{}, 16)}
	cli := etcdtest.NewClient(t, c.Endpoints(), cnt.dial()...)
	drop := &dropProgress{Watcher: cli.Watcher}
	cli.Watcher = drop
	holder := etcdsync.NewMutex(session(t, c.Client(t)), "late-progress")
	waiter := etcdsync.NewMutex(session(t, cli), "late-progress")
	for i, tc := range []struct {
		drop     int32 // requests dropped from the handoff's first
		requests int32 // requests the handoff sends
		rpcs     int64
		atLeast  time.Duration
	}{
		{0, 1, 0, 0}, // answers the probe, or its turn came first
		{1, 2, 0, 500 * time.Millisecond},
		{100, 4, 1, 2 * time.Second}, // at 0, 0.5, 1 and 1.5 s; 2 s ends the wait
		{0, 1, 0, 0},
	} {
		require.NoError(t, holder.Lock(ctx))
		w := async(func() error { return waiter.Lock(ctx) })
		for range 2 { // the waiter's watches of its key and the holder's
			within(t, cnt.created, cellTimeout, "the waiter's watches created")
		}
		if i == 0 { // the first wait's probe, once answered
			require.Eventually(t, func() bool { return drop.n.Load() > 0 }, cellTimeout, time.Millisecond, "the probe sent")
		}
		n := drop.n.Load()
		drop.from.Store(n + 1)
		drop.until.Store(n + 1 + tc.drop)
		before := cnt.unary.Load()
		start := time.Now()
		require.NoError(t, holder.Unlock(ctx))
		require.NoError(t, resultWithin(t, w, cellTimeout, "handoff"))
		took := time.Since(start)
		require.EqualValues(t, tc.rpcs, cnt.unary.Load()-before, "RPCs on the critical path of handoff %d", i)
		require.EqualValues(t, tc.requests, drop.n.Load()-n, "progress requests of handoff %d", i)
		require.GreaterOrEqual(t, took, tc.atLeast, "handoff %d", i)
		t.Logf("handoff %d: %v", i, took.Round(time.Millisecond))
		require.NoError(t, waiter.Unlock(ctx))
	}
}

// A client learns that its progress requests go unanswered off the
// critical path: through etcd's gRPC proxy, a first wait that lasts longer
// than progressWait has learned it from its probe by the time its turn
// comes, so its handoff reads at once and asks nothing more.
func TestCompatProgressLearnedWhileWaiting(t *testing.T) {
	t.Parallel()
	progressServer(t)
	if testing.Short() {
		t.Skip("skipped in -short")
	}
	c := single(t)
	proxy := etcdtest.StartGRPCProxy(t, c.Endpoints())
	ctx := ctxCell(t)
	cli, calls, cnt := wrappedClient(t, []string{proxy})
	holder := etcdsync.NewMutex(session(t, c.Client(t)), "progress-learned")
	waiter := etcdsync.NewMutex(session(t, cli), "progress-learned")
	require.NoError(t, holder.Lock(ctx))
	w := async(func() error { return waiter.Lock(ctx) })
	for range 2 { // the waiter's watches of its key and the holder's
		within(t, cnt.created, cellTimeout, "the waiter's watches created")
	}
	time.Sleep(2 * time.Second) // the holder holds a while: longer than the probe waits for its answer
	progress := func() int { return calls.count("RequestProgress") }
	require.Equal(t, 1, progress(), "progress requests before the turn: the probe")
	before := cnt.unary.Load()
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, w, cellTimeout, "handoff"))
	require.EqualValues(t, 1, cnt.unary.Load()-before, "RPCs on the critical path: the read")
	require.Equal(t, 1, progress(), "progress requests after the turn: none more")
	require.NoError(t, waiter.Unlock(ctx))
}

// dropProgress is a Watcher that drops its progress requests numbered from
// from to until-1, counting from 1 (it says it sent them).
type dropProgress struct {
	clientv3.Watcher
	n, from, until atomic.Int32
}

func (d *dropProgress) RequestProgress(ctx context.Context) error {
	if n := d.n.Add(1); n >= d.from.Load() && n < d.until.Load() {
		return nil
	}
	return d.Watcher.RequestProgress(ctx)
}

// The probe racing the own key's delete: on a fresh client each round (its
// caps unknown, so the wait checks versions and sends a probe as its own
// key's watch is created), the waiter's key and its predecessor's go in one
// transaction (the turn's revision is the own key's delete), or the own key
// goes first, or just after; at a random moment from 0 to 700 ms after the
// watches' creation (before, around and after the probe's answer or its
// 500 ms end). A Lock that returns nil is a turn taken while the key lived:
// only the "after" order may give one, and then its Done must close. Direct
// and through etcd's gRPC proxy.
func TestProbeNeverConfirmsATurnWhoseKeyWent(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("skipped in -short")
	}
	c := single(t)
	proxy := etcdtest.StartGRPCProxy(t, c.Endpoints())
	admin := c.Client(t)
	hs := session(t, admin)
	for _, tc := range []struct {
		name string
		eps  []string
	}{{"direct", c.Endpoints()}, {"grpcproxy", []string{proxy}}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "ws-probe-" + tc.name
			rng := rand.New(rand.NewPCG(25, 1))
			got := map[string]int{}
			for round := range 12 {
				cnt := &counter{created: make(chan struct{}, 16)}
				cli := etcdtest.NewClient(t, tc.eps, cnt.dial()...)
				ws := session(t, cli)
				holder, waiter := etcdsync.NewMutex(hs, name), etcdsync.NewMutex(ws, name)
				require.NoError(t, holder.Lock(ctx))
				w := async(func() error { return waiter.Lock(ctx) })
				awaitCreated(t, cnt.created, 2, testTimeout, "the waiter's watches")
				time.Sleep(time.Duration(rng.IntN(700)) * time.Millisecond)
				own := keyOf(name, ws)
				order := []string{"same", "own-first", "own-after"}[round%3]
				switch order {
				case "same":
					_, err := admin.Txn(ctx).Then(clientv3.OpDelete(holder.Key()), clientv3.OpDelete(own)).Commit()
					require.NoError(t, err)
				case "own-first":
					_, err := admin.Delete(ctx, own)
					require.NoError(t, err)
					_, err = admin.Delete(ctx, holder.Key())
					require.NoError(t, err)
				case "own-after":
					_, err := admin.Delete(ctx, holder.Key())
					require.NoError(t, err)
					_, err = admin.Delete(ctx, own)
					require.NoError(t, err)
				}
				err := resultWithin(t, w, testTimeout, "the waiter")
				switch {
				case err == nil:
					require.Equal(t, "own-after", order, "round %d: a turn taken with the own key gone by the turn's revision", round)
					within(t, waiter.Done(), testTimeout, "Done of a hold whose key was deleted")
					got[order+":lock"]++
				default:
					require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "round %d (%s)", round, order)
					got[order+":expired"]++
				}
				within(t, holder.Done(), testTimeout, "the holder's Done")
				_ = ws.Close()
			}
			t.Logf("outcomes: %v", got)
		})
	}
}
