package tests

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// semLock is a Semaphore's one-permit hold as a lock.
type semLock struct{ *etcdsync.Semaphore }

func (l semLock) Lock(ctx context.Context) error { return l.Acquire(ctx, 1) }

// waitCreated waits until n watches of a stream have been created.
func waitCreated(t *testing.T, ctx context.Context, created <-chan int64, n int64) {
	t.Helper()
	for seen := map[int64]bool{}; int64(len(seen)) < n; {
		select {
		case id := <-created:
			seen[id] = true
		case <-ctx.Done():
			t.Fatalf("the waiter's %d watches were not created", n)
		}
	}
}

// TestTurnAfterEveryDeleteSeen: a waiter watches the two nearest keys ahead
// (watch 1 the older, watch 2 the newer). The newer goes first, then the
// older; the stream delivers the older's delete first. The hold begins at
// the later delete, and Header says so: never at the earlier one, while the
// older key still existed. Mutex (the newer key a waiter that gives up) and
// RWMutex (a writer behind two readers); and a Semaphore, where the reorder
// would make three permits of two.
func TestTurnAfterEveryDeleteSeen(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	type lock interface {
		Lock(context.Context) error
		Header() *pb.ResponseHeader
	}
	cases := []struct {
		name string
		// ahead makes the two keys ahead (older first) and returns the
		// calls that delete them.
		ahead  func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (older, newer func())
		waiter func(s *etcdsync.Session, name string) lock
		// early, late: the watches whose deletes the stream swaps, by the
		// IDs the server gives them (the waiter creates its watches one at
		// a time: watch 0 is its own key, 1 up the keys ahead, oldest
		// first); watches: how many the waiter opens.
		early, late, watches int64
	}{
		{name: "mutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			m1, m2 := etcdsync.NewMutex(s1, name), etcdsync.NewMutex(s2, name)
			require.NoError(t, m1.Lock(ctx))
			wctx, cancel := context.WithCancel(ctx)
			gaveUp := async(func() error { return m2.Lock(wctx) })
			waitKeys(t, admin, name+"/", 2)
			return func() { require.NoError(t, m1.Unlock(ctx)) },
				func() { cancel(); require.ErrorIs(t, <-gaveUp, context.Canceled) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewMutex(s, name) }, early: 1, late: 2, watches: 3},
		{name: "rwmutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			r1, r2 := etcdsync.NewRWMutex(s1, name), etcdsync.NewRWMutex(s2, name)
			require.NoError(t, r1.RLock(ctx))
			require.NoError(t, r2.RLock(ctx))
			return func() { require.NoError(t, r1.RUnlock(ctx)) }, func() { require.NoError(t, r2.RUnlock(ctx)) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewRWMutex(s, name) }, early: 1, late: 2, watches: 3},
		// Two permits: A and B hold one each, C waits for one; the waiter
		// for one watches A, B and C. B goes (C holds from then), then C:
		// the waiter's turn is C's delete, which the stream delivers first.
		// A hold from B's delete would make three permits of two.
		{name: "semaphore", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			a := etcdsync.NewSemaphore(s1, name, 2)
			b := etcdsync.NewSemaphore(s2, name, 2)
			c := etcdsync.NewSemaphore(session(t, admin), name, 2)
			require.NoError(t, a.Acquire(ctx, 1))
			require.NoError(t, b.Acquire(ctx, 1))
			got := async(func() error { return c.Acquire(ctx, 1) })
			waitKeys(t, admin, name+"/", 3)
			return func() { require.NoError(t, <-got); require.NoError(t, c.Release(ctx)) },
				func() { require.NoError(t, b.Release(ctx)) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return semLock{etcdsync.NewSemaphore(s, name, 2)} }, early: 3, late: 2, watches: 4},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "reorder/" + tc.name
			created := make(chan int64, 16)
			cli, arm := faults.LateClient(t, c.Endpoints(), tc.early, tc.late, created)
			older, newer := tc.ahead(t, ctx, session(t, admin), session(t, admin), name)
			w := tc.waiter(session(t, cli), name)
			arm()
			locked := async(func() error { return w.Lock(ctx) })
			waitCreated(t, ctx, created, tc.watches)
			newer()
			older()
			resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			require.NoError(t, err)
			last := resp.Header.Revision // the older key's delete
			require.NoError(t, <-locked)
			require.GreaterOrEqual(t, w.Header().Revision, last, "the hold began before the older key's delete")
		})
	}
}

// TestTurnAfterLaggingReplay: the waiter's only endpoint is a follower cut
// off from its peers while the newer key ahead and then the older go; once
// healed, it replays both deletes, the older's first. The waiter does not
// hold while its member lags, and its hold begins at the older's delete.
func TestTurnAfterLaggingReplay(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("3-member cluster skipped in -short")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx := ctxT(t)
	f := c.Follower()
	require.NotNil(t, f)
	up := c.Members()[(slices.Index(c.Members(), f)+1)%3]
	admin := etcdtest.NewClient(t, []string{up.Endpoint()})
	name := "reorder/lag"
	created := make(chan int64, 16)
	cli, arm := faults.LateClient(t, []string{f.Endpoint()}, 2, 3, created)
	m1, m2 := etcdsync.NewMutex(session(t, admin), name), etcdsync.NewMutex(session(t, admin), name)
	require.NoError(t, m1.Lock(ctx))
	wctx, cancel := context.WithCancel(ctx)
	gaveUp := async(func() error { return m2.Lock(wctx) })
	waitKeys(t, admin, name+"/", 2)
	w := etcdsync.NewMutex(session(t, cli), name)
	arm()
	locked := async(func() error { return w.Lock(ctx) })
	waitCreated(t, ctx, created, 3)
	require.NoError(t, c.CutPeers(f))
	t.Cleanup(func() { c.HealPeers(f) })
	cancel()
	require.ErrorIs(t, <-gaveUp, context.Canceled)
	require.NoError(t, m1.Unlock(ctx))
	resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	last := resp.Header.Revision // the older key's delete
	notYet(t, locked, 200*time.Millisecond, "the waiter while its member lagged")
	require.NoError(t, c.HealPeers(f))
	require.NoError(t, <-locked)
	require.GreaterOrEqual(t, w.Header().Revision, last, "the hold began before the older key's delete")
}
