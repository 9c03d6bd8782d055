package tests

// The handoff under deployments: a waiter takes its turn on its
// predecessor's delete event alone, directly and through etcd's gRPC proxy,
// and never while its own key is gone.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/namespace"
)

// Directly and through etcd's gRPC proxy (which never answers a progress
// request, and serves serializable reads from a cache), every handoff takes
// no RPC between the holder's Unlock and the waiter's Lock, the first wait
// on a client included, and no progress request. Each handoff's latency is
// logged beside the other's.
func TestHandoffTakesNoRPCDirectAndThroughTheProxy(t *testing.T) {
	t.Parallel()
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
	}{
		{"direct", c.Endpoints()},
		{"grpcproxy", []string{proxy}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxCell(t)
			name := "handoff-" + tc.name
			cli, calls, cnt := wrappedClient(t, tc.endpoints)
			holder := etcdsync.NewMutex(session(t, admin), name)
			waiter := etcdsync.NewMutex(session(t, cli), name)
			var lat []time.Duration
			for i := range handoffs {
				require.NoError(t, holder.Lock(ctx))
				w := async(func() error { return waiter.Lock(ctx) })
				within(t, cnt.created, cellTimeout, "the waiter's watch of the prefix")
				before := cnt.unary.Load()
				start := time.Now()
				require.NoError(t, holder.Unlock(ctx))
				require.NoError(t, resultWithin(t, w, cellTimeout, "handoff"))
				lat = append(lat, time.Since(start))
				require.Zero(t, cnt.unary.Load()-before, "RPCs on the critical path of handoff %d", i)
				require.NoError(t, waiter.Unlock(ctx))
			}
			require.Zero(t, calls.count("RequestProgress"), "progress requests over %d handoffs", handoffs)
			t.Logf("%s: handoff latencies (holder's Unlock to the waiter's Lock) %v", tc.name, lat)
		})
	}
}

// A waiter's key and its predecessor's go in one transaction (the turn's
// revision is the own key's delete), or the own key goes first, or just
// after; at a random moment from 0 to 700 ms after the waiter's watch's
// creation; on a fresh client each round. A Lock that returns nil is a turn
// taken while the key lived: only the "after" order may give one, and then
// its Done must close. Directly and through etcd's gRPC proxy.
func TestTurnNeverTakenWithOwnKeyGone(t *testing.T) {
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
			name := "own-gone-" + tc.name
			rng := rand.New(rand.NewPCG(25, 1))
			got := map[string]int{}
			for round := range 12 {
				cnt := &counter{created: make(chan struct{}, 16)}
				cli := etcdtest.NewClient(t, tc.eps, cnt.dial()...)
				ws := session(t, cli)
				holder, waiter := etcdsync.NewMutex(hs, name), etcdsync.NewMutex(ws, name)
				require.NoError(t, holder.Lock(ctx))
				w := async(func() error { return waiter.Lock(ctx) })
				within(t, cnt.created, testTimeout, "the waiter's watch of the prefix")
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

// Through etcd's gRPC proxy, with other watchers of the same prefix
// already broadcast (a user's watch from the current revision, and one
// from revision 1 still replaying history), so that the waiters' prefix
// watches join or are coalesced into existing broadcasts: the waiters
// still exclude each other, every Lock's key exists, and a waiter whose
// key is deleted learns it.
func TestPrefixWatchesCoalescedByTheProxyExclude(t *testing.T) {
	t.Parallel()
	c := single(t)
	proxy := etcdtest.StartGRPCProxy(t, c.Endpoints())
	admin := c.Client(t)
	ctx := ctxT(t)
	name := "pxco"
	// History under the prefix, so that a watch from revision 1 replays.
	for i := range 50 {
		_, err := admin.Put(ctx, fmt.Sprintf("%s/x/%d", name, i), "v")
		require.NoError(t, err)
		_, err = admin.Delete(ctx, fmt.Sprintf("%s/x/%d", name, i))
		require.NoError(t, err)
	}
	user := etcdtest.NewClient(t, []string{proxy})
	wctx, wcancel := context.WithCancel(ctx)
	defer wcancel()
	for _, opts := range [][]clientv3.OpOption{
		{clientv3.WithPrefix()},
		{clientv3.WithPrefix(), clientv3.WithRev(1)},
		{clientv3.WithPrefix(), clientv3.WithFilterPut()},
	} {
		wch := user.Watch(wctx, name+"/", opts...)
		go func() {
			for range wch {
			}
		}()
	}
	var ms []*etcdsync.Mutex
	for range 4 {
		cli := etcdtest.NewClient(t, []string{proxy})
		ms = append(ms, etcdsync.NewMutex(session(t, cli), name))
	}
	contendMutexes(t, ctx, admin, ms, 15)

	// A waiter's own key deleted while it waits on the prefix through the
	// proxy: ErrSessionExpired, never the turn.
	holder := heldMutex(t, ctx, admin, name)
	waiterLosesOwnKey(t, ctx, admin, name+"/", holder.Key(), func() error { return ms[0].Lock(ctx) }, "proxied waiter")
	require.NoError(t, holder.Unlock(ctx))
}

// Through a namespace (namespace.NewKV/NewWatcher/NewLease): exclusion
// under contention, a holder and its waiter deleted in one transaction
// grant nobody, and the waiter behind both gets the turn.
func TestNamespacedWaitersOnThePrefixExclude(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const ns = "tenant1/"
	nsClient := func() *clientv3.Client {
		cli := etcdtest.NewClient(t, c.Endpoints())
		cli.KV = namespace.NewKV(cli.KV, ns)
		cli.Watcher = namespace.NewWatcher(cli.Watcher, ns)
		cli.Lease = namespace.NewLease(cli.Lease, ns)
		return cli
	}
	name := "nsq"
	var ms []*etcdsync.Mutex
	for range 3 {
		ms = append(ms, etcdsync.NewMutex(session(t, nsClient()), name))
	}
	contendMutexes(t, ctx, nsClient(), ms, 15)

	h, w1, w2 := ms[0], ms[1], ms[2]
	require.NoError(t, h.Lock(ctx))
	g1 := async(func() error { return w1.Lock(ctx) })
	waitKeys(t, admin, ns+name+"/", 2)
	g2 := async(func() error { return w2.Lock(ctx) })
	waitKeys(t, admin, ns+name+"/", 3)
	time.Sleep(200 * time.Millisecond) // the waits' watches are created
	w1key := nthKey(t, ctx, admin, ns+name+"/", 1)
	require.NotEmpty(t, w1key)
	_, err := admin.Txn(ctx).Then(clientv3.OpDelete(ns+h.Key()), clientv3.OpDelete(w1key)).Commit()
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, g1, testTimeout, "w1 whose key went with the holder's"), etcdsync.ErrSessionExpired)
	require.NoError(t, resultWithin(t, g2, testTimeout, "w2 behind both"))
	require.NoError(t, w2.Unlock(ctx))
	within(t, h.Done(), testTimeout, "the holder's Done")
	waitNoKeys(t, admin, ns+name+"/")
}
