package tests

// Calls while etcd is unreachable: how long they keep their caller, and a
// Lock that waits through a long partition.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/client/v3/concurrency"
)

// A Lock whose context has no deadline waits through a partition longer
// than the library's cleanup bound (5 s) and then acquires.
func TestLockWaitsThroughLongPartition(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("7 s partition skipped in -short")
	}
	c := single(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "nodeadline")
	p.Blackhole(true)
	errc := async(func() error { return m.Lock(context.Background()) })
	notYet(t, errc, 7*time.Second, "Lock(Background) during the partition")
	p.Blackhole(false)
	require.NoError(t, resultWithin(t, errc, testTimeout, "Lock after the partition healed"))
	require.NoError(t, m.Unlock(ctxT(t)))
}

// With etcd unreachable, Unlock and Resign of a live hold return by the
// session's local deadline whatever their context says, and a release of a
// hold that has ended returns at once.
func TestReleaseBoundedWhileEtcdUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(2*time.Second))
	m := etcdsync.NewMutex(s, "down-m")
	e := etcdsync.NewElection(s, "down-e")
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, e.Campaign(ctx, "v"))
	p.Blackhole(true)
	defer p.Blackhole(false)
	cut := time.Now()
	unlocked, resigned := make(chan error, 1), make(chan error, 1)
	go func() { unlocked <- m.Unlock(context.Background()) }()
	go func() { resigned <- e.Resign(context.Background()) }()
	bound := s.TTL() + 1500*time.Millisecond
	select {
	case err := <-unlocked:
		require.ErrorIs(t, err, etcdsync.ErrLockReleased)
	case <-time.After(bound):
		t.Fatalf("Unlock(Background) still blocked %v after etcd became unreachable", bound)
	}
	select {
	case err := <-resigned:
		require.NoError(t, err, "Resign of a leadership that ended is nil, as when not leading")
	case <-time.After(bound - time.Since(cut) + 100*time.Millisecond):
		t.Fatalf("Resign(Background) still blocked %v after etcd became unreachable", bound)
	}
	require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
	// etcd is unreachable: a release that sent an RPC would not return.
	released := async(func() error {
		if err := m.Unlock(context.Background()); !errors.Is(err, etcdsync.ErrLockReleased) {
			return fmt.Errorf("Unlock: %v, want ErrLockReleased", err)
		}
		return e.Resign(context.Background())
	})
	require.NoError(t, resultWithin(t, released, 10*time.Second, "a release of an ended hold, with etcd unreachable"))
}

// A Lock whose ctx ends while etcd is unreachable keeps its caller past the
// deadline by a bounded time (createGrace for the create, then the cleanup's
// own bound, in the caller's goroutine): less than 2 s past a 300 ms
// deadline.
func TestLockOverrunBoundedWhileUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "r8-overrun")
	p.Blackhole(true)
	defer p.Blackhole(false)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := m.Lock(ctx)
	took := time.Since(start)
	t.Logf("Lock(300ms) returned after %v: %v", took, err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, took, 300*time.Millisecond+2*time.Second, "the caller waits past its deadline")
}

// A waiting Lock whose context ends while etcd is unreachable returns
// within a bounded time: withdrawing its key is bounded too, and the session
// removes the key once etcd answers again (etcd-io/etcd#18082: etcd's Lock
// withdraws its key under the client's context, which never ends, so it
// blocks for as long as etcd cannot be reached).
func TestCancelledWaitReturnsWhileUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "wait-unreachable"
	holder := etcdsync.NewMutex(session(t, admin), name)
	require.NoError(t, holder.Lock(ctx))

	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 8)}
	m := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...), etcdsync.WithTTL(30*time.Second)), name)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := async(func() error { return m.Lock(lctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "the waiter's watches (its own key, the holder's)")
	p.Blackhole(true)
	defer p.Blackhole(false)
	cancel()
	cut := time.Now()
	require.ErrorIs(t, resultWithin(t, got, 3*time.Second, "the cancelled Lock with etcd unreachable"), context.Canceled)
	t.Logf("the cancelled Lock returned %v after the cancel", time.Since(cut))
	p.Blackhole(false)
	waitCount(t, admin, name+"/", testTimeout, func(n int) bool { return n == 1 }) // the holder's key alone
	require.NoError(t, holder.Unlock(ctx))

	// etcd's Mutex in the same sequence.
	const theirs = "wait-unreachable-etcd"
	eholder := etcdsync.NewMutex(session(t, admin), theirs)
	require.NoError(t, eholder.Lock(ctx))
	ep := faults.Proxy(t, c)
	ecnt := counter{created: make(chan struct{}, 8)}
	es, err := concurrency.NewSession(etcdtest.NewClient(t, []string{ep.Endpoint()}, ecnt.dial()...))
	require.NoError(t, err)
	t.Cleanup(func() { es.Close() })
	em := concurrency.NewMutex(es, theirs)
	ectx, ecancel := context.WithCancel(ctx)
	defer ecancel()
	egot := async(func() error { return em.Lock(ectx) })
	within(t, ecnt.created, testTimeout, "etcd's waiter's watch")
	ep.Blackhole(true)
	defer ep.Blackhole(false)
	ecancel()
	notYet(t, egot, 2*time.Second, "etcd's cancelled Lock with etcd unreachable (#18082: it withdraws under client.Ctx())")
	ep.Blackhole(false)
	require.ErrorIs(t, resultWithin(t, egot, testTimeout, "etcd's cancelled Lock once etcd answers"), context.Canceled)
	require.NoError(t, eholder.Unlock(ctx))
}
