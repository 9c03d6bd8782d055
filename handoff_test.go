package etcdsync_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// queued is one waiter of a test queue, on a client of its own so that its
// RPCs and watches are counted alone.
type queued struct {
	i   int
	cnt *counter
	s   *etcdsync.Session
	m   *etcdsync.Mutex
	err chan error // Lock's result, or held's
}

// enqueue starts n waiters on name behind a holder, one at a time (each on a
// client of one member, the members in turn), each in its watches (its own key and the two nearest keys ahead) before the next
// starts, so that nobody writes between a waiter's read and its watches.
// Waiter i's Lock runs under ctxFor(i); once it holds, held runs.
func enqueue(t *testing.T, c *etcdtest.Cluster, name string, n int, ctxFor func(i int) context.Context, held func(q *queued) error) []*queued {
	var qs []*queued
	for i := range n {
		q := &queued{i: i, cnt: &counter{created: make(chan struct{}, 16), returned: make(chan struct{}, 16)}, err: make(chan error, 1)}
		// One member serves its watches and its reads, so that a read after
		// an event is never behind it (else a serializable read may be
		// followed by a linearizable one).
		member := c.Members()[i%len(c.Members())]
		q.s = session(t, etcdtest.NewClient(t, []string{member.Endpoint()}, q.cnt.dial()...))
		q.m = etcdsync.NewMutex(q.s, name)
		go func() {
			err := q.m.Lock(ctxFor(i))
			if err == nil {
				err = held(q)
			}
			q.err <- err
		}()
		for range min(i+2, 3) {
			within(t, q.cnt.created, testTimeout, fmt.Sprintf("waiter %d's watch created", i))
		}
		for len(q.cnt.returned) > 0 { // its session's grant and its enqueue
			<-q.cnt.returned
		}
		qs = append(qs, q)
	}
	return qs
}

// Once a waiter's predecessor releases, the waiter owns the lock with no
// RPC, at every position of the queue: the read a waiter needs when keys
// it does not watch were listed ahead of it happens when its second-nearest
// key goes, while its predecessor still holds.
func TestNoRPCOnTheCriticalPath(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		holder := etcdsync.NewMutex(session(t, admin), "critical")
		require.NoError(t, holder.Lock(ctx))
		const n = 6
		var qs []*queued
		before := make([]atomic.Int64, n) // a waiter's RPCs when its predecessor began to unlock
		handOn := func(next int) {
			if next >= n {
				return
			}
			if next >= 2 { // it listed keys it does not watch: one read, now
				select {
				case <-qs[next].cnt.returned:
				case <-time.After(testTimeout):
					t.Errorf("waiter %d made no read while its predecessor held", next)
				}
			}
			before[next].Store(qs[next].cnt.unary.Load())
		}
		var mu sync.Mutex // the waiters' locks run in order; qs is set by then
		mu.Lock()
		qs = enqueue(t, c, "critical", n, func(int) context.Context { return ctx }, func(q *queued) error {
			mu.Lock()
			defer mu.Unlock()
			if got := q.cnt.unary.Load(); got != before[q.i].Load() {
				t.Errorf("waiter %d: %d RPCs between its predecessor's Unlock and its Lock's return", q.i, got-before[q.i].Load())
			}
			handOn(q.i + 1)
			return q.m.Unlock(ctx)
		})
		handOn(0)
		mu.Unlock()
		require.NoError(t, holder.Unlock(ctx))
		for _, q := range qs {
			require.NoError(t, <-q.err)
		}
		require.Empty(t, keys(t, admin, "critical/"))
	})
}

// Keys leave the queue at every position while the others wait: a waiter
// gives up, its lease is revoked, or an admin deletes its key; one at a time
// or two neighbours in one revision. The others are served in order, one at
// a time; the ones that left return at once (their own error) and never
// hold; nothing is left behind.
func TestQueueChangesAtEveryPosition(t *testing.T) {
	t.Parallel()
	const n = 5
	type leave func(t *testing.T, admin *clientv3.Client, qs []*queued, cancels []context.CancelFunc, at ...int)
	giveUp := func(t *testing.T, _ *clientv3.Client, _ []*queued, cancels []context.CancelFunc, at ...int) {
		for _, i := range at {
			cancels[i]()
		}
	}
	revoke := func(t *testing.T, admin *clientv3.Client, qs []*queued, _ []context.CancelFunc, at ...int) {
		for _, i := range at {
			_, err := admin.Revoke(ctxT(t), qs[i].s.Lease())
			require.NoError(t, err)
		}
	}
	deleteKeys := func(t *testing.T, admin *clientv3.Client, qs []*queued, _ []context.CancelFunc, at ...int) {
		var ops []clientv3.Op
		for _, i := range at {
			ops = append(ops, clientv3.OpDelete(fmt.Sprintf("pos/%x", int64(qs[i].s.Lease()))))
		}
		_, err := admin.Txn(ctxT(t)).Then(ops...).Commit() // one revision
		require.NoError(t, err)
	}
	c := single(t)
	admin := c.Client(t)
	for _, how := range []struct {
		name  string
		leave leave
		want  error
	}{{"give-up", giveUp, context.Canceled}, {"revoke", revoke, etcdsync.ErrSessionExpired}, {"delete", deleteKeys, etcdsync.ErrSessionExpired}} {
		for _, at := range [][]int{{0}, {1}, {2}, {3}, {4}, {0, 1}, {1, 2}, {2, 3}, {3, 4}, {0, 2}, {1, 3}} {
			t.Run(fmt.Sprintf("%s/%v", how.name, at), func(t *testing.T) {
				ctx := ctxT(t)
				holder := etcdsync.NewMutex(session(t, admin), "pos")
				require.NoError(t, holder.Lock(ctx))
				var (
					mu      sync.Mutex
					order   []int
					holding atomic.Int32
				)
				cancels := make([]context.CancelFunc, n)
				ctxs := make([]context.Context, n)
				for i := range n {
					ctxs[i], cancels[i] = context.WithCancel(ctx)
					t.Cleanup(cancels[i])
				}
				qs := enqueue(t, c, "pos", n, func(i int) context.Context { return ctxs[i] }, func(q *queued) error {
					if holding.Add(1) != 1 {
						t.Errorf("waiter %d holds with another", q.i)
					}
					mu.Lock()
					order = append(order, q.i)
					mu.Unlock()
					holding.Add(-1)
					return q.m.Unlock(ctx)
				})
				waitKeys(t, admin, "pos/", n+1)
				how.leave(t, admin, qs, cancels, at...)
				var want []int
				for i, q := range qs {
					if !slices.Contains(at, i) {
						want = append(want, i)
						continue
					}
					select { // it returns at once, before anyone releases
					case err := <-q.err:
						require.ErrorIs(t, err, how.want, "waiter %d", i)
						q.err <- err
					case <-ctx.Done():
						t.Fatalf("waiter %d did not return", i)
					}
				}
				require.NoError(t, holder.Unlock(ctx))
				for i, q := range qs {
					err := <-q.err
					if slices.Contains(at, i) {
						require.True(t, errors.Is(err, how.want), "waiter %d: %v", i, err)
					} else {
						require.NoError(t, err, "waiter %d", i)
					}
				}
				require.Equal(t, want, order, "served in queue order")
				require.Empty(t, keys(t, admin, "pos/"))
			})
		}
	}
}
