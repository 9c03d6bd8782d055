package tests

// The handoff under deployments: a waiter takes its turn on its
// predecessor's delete event alone, directly and through etcd's gRPC proxy,
// and never while its own key is gone.

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
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
