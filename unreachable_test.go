package etcdsync_test

// Calls while etcd is unreachable: how long they keep their caller, and a
// Lock that waits through a long partition.

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/faults"
	"github.com/stretchr/testify/require"
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
