package tests

// What the try calls and calls on an ended context cost in RPCs.

import (
	"context"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// Lock, TryLock and Campaign on an ended context send nothing.
func TestEndedContextSendsNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	s := session(t, c.Client(t, cnt.dial()...))
	m := etcdsync.NewMutex(s, "ended")
	e := etcdsync.NewElection(s, "ended")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	cnt.take()
	streams := cnt.streams.Load()
	for _, ctx := range []context.Context{cancelled, expired} {
		require.ErrorIs(t, m.Lock(ctx), ctx.Err())
		require.ErrorIs(t, m.TryLock(ctx), ctx.Err())
		require.ErrorIs(t, e.Campaign(ctx, "v"), ctx.Err())
	}
	n, methods := cnt.take()
	require.Zero(t, n, "RPCs sent on an ended context: %v", methods)
	require.Equal(t, streams, cnt.streams.Load(), "streams opened on an ended context")
	require.Empty(t, keys(t, c.Client(t), "ended/"))
}

// Costs of the try calls: TryAcquire on a free name 1 RPC; with permits
// taken but enough free 2; with too few free 1 RPC and no write; TryRLock
// beside readers 1 RPC.
func TestTryCallCosts(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	sm := etcdsync.NewSemaphore(session(t, cli), "r12cost", 3)
	other := etcdsync.NewSemaphore(session(t, admin), "r12cost", 3)
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m := cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire on a free name: %v", m)
	require.NoError(t, sm.Release(ctx))
	require.NoError(t, other.Acquire(ctx, 1))
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m = cnt.take()
	require.Equal(t, int64(2), n, "TryAcquire beside a hold: %v", m)
	require.NoError(t, sm.Release(ctx))
	cnt.take()
	rev := storeRev(t, admin)
	require.ErrorIs(t, sm.TryAcquire(ctx, 3), etcdsync.ErrLocked)
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire with too few free: %v", m)
	require.Equal(t, rev, storeRev(t, admin), "a failed TryAcquire wrote")
	require.NoError(t, other.Release(ctx))

	r1 := etcdsync.NewRWMutex(session(t, admin), "r12costrw")
	require.NoError(t, r1.RLock(ctx))
	r2 := etcdsync.NewRWMutex(session(t, cli), "r12costrw")
	cnt.take()
	require.NoError(t, r2.TryRLock(ctx))
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryRLock beside a reader: %v", m)
	require.NoError(t, r2.RUnlock(ctx))
	require.NoError(t, r1.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12cost"))
}

// Failing try calls cost one RPC and write nothing: TryRLock with a writer
// holding or waiting, TryLock beside a reader, TryAcquire with someone
// waiting ahead; a TryRLock on a session whose read hold is being released
// sends nothing.
func TestFailingTryCallsCostOneRPC(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		admin := c.Client(t)
		ctx := ctxT(t)
		var cnt counter
		cli := c.Client(t, cnt.dial()...)
		check := func(what string, f func() error) {
			t.Helper()
			rev := storeRev(t, admin)
			cnt.take()
			require.ErrorIs(t, f(), etcdsync.ErrLocked, what)
			n, m := cnt.take()
			require.Equal(t, int64(1), n, "%s: %v", what, m)
			require.Equal(t, rev, storeRev(t, admin), "%s wrote", what)
		}
		w := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, w.Lock(ctx))
		rw := etcdsync.NewRWMutex(session(t, cli), "r12bcost")
		check("TryRLock with a writer holding", func() error { return rw.TryRLock(ctx) })
		check("TryLock with a writer holding", func() error { return rw.TryLock(ctx) })
		require.NoError(t, w.Unlock(ctx))

		r := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, r.RLock(ctx))
		w2 := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		w2got := async(func() error { return w2.Lock(ctx) })
		waitKeys(t, admin, "r12bcost/", 2)
		check("TryRLock with a writer waiting", func() error { return rw.TryRLock(ctx) })
		check("TryLock beside a reader", func() error { return rw.TryLock(ctx) })
		require.NoError(t, r.RUnlock(ctx))
		require.NoError(t, resultWithin(t, w2got, testTimeout, "w2"))
		require.NoError(t, w2.Unlock(ctx))

		h := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		require.NoError(t, h.Acquire(ctx, 3))
		q := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		qgot := async(func() error { return q.Acquire(ctx, 1) })
		waitKeys(t, admin, "r12bcostsem/", 2)
		sm := etcdsync.NewSemaphore(session(t, cli), "r12bcostsem", 3)
		check("TryAcquire with a waiter ahead", func() error { return sm.TryAcquire(ctx, 1) })
		m := etcdsync.NewMutex(session(t, cli), "r12bcostsem")
		check("Mutex TryLock on a semaphore's name", func() error { return m.TryLock(ctx) })
		require.NoError(t, h.Release(ctx))
		require.NoError(t, resultWithin(t, qgot, testTimeout, "q"))
		require.NoError(t, q.Release(ctx))
		require.Empty(t, keys(t, admin, "r12bcost"))
	})
}
