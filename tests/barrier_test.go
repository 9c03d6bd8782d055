package tests

// Barrier: Wait blocks while the barrier is held and returns once it is
// released, by us, by etcd's recipe, or by the end of a HoldFor session;
// Wait reads linearizably and keeps its place across a broken, compacted
// watch.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	recipe "go.etcd.io/etcd/client/v3/experimental/recipes"
)

// Wait passes an open barrier at once, blocks while it is held, and every
// waiter returns on Release. Hold on a held barrier is ErrLocked, also to
// the value that holds it; Release with nothing to release is
// ErrLockReleased; a Release of a value that held a barrier never opens a
// newer one; bad arguments are errors, not panics.
func TestBarrierWaitBlocksUntilRelease(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "/phase/barrier"
	b := etcdsync.NewBarrier(cli, name)
	require.NoError(t, b.Wait(ctx), "an open barrier")

	require.NoError(t, b.Hold(ctx))
	require.Equal(t, []string{name}, keys(t, cli, name), "the key is the name itself, as etcd's recipe")
	require.ErrorIs(t, b.Hold(ctx), etcdsync.ErrLocked, "the holder's own Hold")
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).Hold(ctx), etcdsync.ErrLocked)
	w1 := async(func() error { return etcdsync.NewBarrier(cli, name).Wait(ctx) })
	w2 := async(func() error { return etcdsync.NewBarrier(cli, name).Wait(ctx) })
	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).Wait(short), context.DeadlineExceeded, "a held barrier")
	notYet(t, w1, 50*time.Millisecond, "Wait while held")
	require.NoError(t, b.Release(ctx))
	require.NoError(t, resultWithin(t, w1, testTimeout, "the first waiter"))
	require.NoError(t, resultWithin(t, w2, testTimeout, "the second waiter"))
	require.Empty(t, keys(t, cli, name))
	require.ErrorIs(t, b.Release(ctx), etcdsync.ErrLockReleased, "a second Release")
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).Release(ctx), etcdsync.ErrLockReleased, "nothing to release")

	// Fenced: a's barrier is opened by someone else and b closes a new one;
	// a's late Release must leave b's barrier closed.
	a := etcdsync.NewBarrier(cli, name)
	require.NoError(t, a.Hold(ctx))
	_, err := cli.Delete(ctx, name)
	require.NoError(t, err)
	require.NoError(t, b.Hold(ctx))
	require.ErrorIs(t, a.Release(ctx), etcdsync.ErrLockReleased)
	require.Equal(t, []string{name}, keys(t, cli, name), "b's barrier")
	require.NoError(t, b.Release(ctx))

	// Bad arguments.
	for _, bad := range []*etcdsync.Barrier{etcdsync.NewBarrier(nil, name), etcdsync.NewBarrier(cli, ""), etcdsync.NewBarrier(cli, "a\x00b")} {
		for _, err := range []error{bad.Hold(ctx), bad.Release(ctx), bad.Wait(ctx), bad.HoldFor(ctx, session(t, cli))} {
			require.True(t, errors.Is(err, etcdsync.ErrInvalidArgument) || errors.Is(err, etcdsync.ErrInvalidName), "%v", err)
		}
	}
	require.ErrorIs(t, b.HoldFor(ctx, nil), etcdsync.ErrInvalidArgument)
	require.Empty(t, keys(t, cli, ""), "no key left by anything above")
}

// A Hold whose context ends at any point of its create (before, during,
// after) either holds or leaves the barrier open: no barrier is left
// closed behind a failed Hold.
func TestBarrierCancelledHoldLeavesNoBarrier(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "cancelled-hold"
	failed := 0
	for i := range 24 {
		hctx, cancel := context.WithTimeout(ctx, time.Duration(i%8)*250*time.Microsecond)
		b := etcdsync.NewBarrier(cli, name)
		err := b.Hold(hctx)
		cancel()
		if err == nil {
			require.NoError(t, b.Release(ctx), "trial %d", i)
			continue
		}
		failed++
		require.ErrorIs(t, err, context.DeadlineExceeded, "trial %d", i)
		require.Empty(t, keys(t, cli, name), "trial %d: a failed Hold left the barrier closed", i)
	}
	require.Positive(t, failed, "no Hold was cut short")
}

// Our barrier and etcd's recipe Barrier share the key: each releases the
// other's waiters, and each refuses to close a barrier the other holds.
func TestBarrierInteroperatesWithEtcdRecipe(t *testing.T) {
	t.Parallel()
	c, cli, ctx := singleClient(t)
	const name = "interop-barrier"
	cnt := counter{created: make(chan struct{}, 16)}
	waiter := etcdtest.NewClient(t, c.Endpoints(), cnt.dial()...)
	waitBoth := func() (ours, theirs <-chan error) {
		t.Helper()
		ours = async(func() error { return etcdsync.NewBarrier(waiter, name).Wait(ctx) })
		theirs = async(func() error { return recipe.NewBarrier(waiter, name).Wait() })
		awaitCreated(t, cnt.created, 2, testTimeout, "the waiters' watches")
		notYet(t, ours, 100*time.Millisecond, "our Wait on a held barrier")
		notYet(t, theirs, 0, "etcd's Wait on a held barrier")
		return ours, theirs
	}

	// Ours held, etcd's releases; waiters of both kinds go.
	require.NoError(t, etcdsync.NewBarrier(cli, name).Hold(ctx))
	require.ErrorIs(t, recipe.NewBarrier(cli, name).Hold(), recipe.ErrKeyExists)
	ours, theirs := waitBoth()
	require.NoError(t, recipe.NewBarrier(cli, name).Release())
	require.NoError(t, resultWithin(t, ours, testTimeout, "our Wait after etcd's Release"))
	require.NoError(t, resultWithin(t, theirs, testTimeout, "etcd's Wait after etcd's Release"))

	// etcd's held, ours releases (a value that never held it).
	require.NoError(t, recipe.NewBarrier(cli, name).Hold())
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).Hold(ctx), etcdsync.ErrLocked)
	ours, theirs = waitBoth()
	require.NoError(t, etcdsync.NewBarrier(cli, name).Release(ctx))
	require.NoError(t, resultWithin(t, ours, testTimeout, "our Wait after our Release"))
	require.NoError(t, resultWithin(t, theirs, testTimeout, "etcd's Wait after our Release"))
	require.Empty(t, keys(t, cli, name))
}

// A barrier closed with HoldFor opens when the holder's session ends (its
// lease revoked, as a crashed holder's expires): the waiters return nil,
// as after a Release, and the holder's Release then finds nothing. HoldFor
// on a barrier of its own session's lease is this value's (a retry).
func TestBarrierHoldForOpensWhenHolderSessionEnds(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "leased-barrier"
	s := session(t, cli)
	b := etcdsync.NewBarrier(cli, name)
	require.NoError(t, b.HoldFor(ctx, s))
	require.NoError(t, etcdsync.NewBarrier(cli, name).HoldFor(ctx, s), "the session's own barrier")
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).HoldFor(ctx, session(t, cli)), etcdsync.ErrLocked, "another session")
	resp, err := cli.Get(ctx, name)
	require.NoError(t, err)
	require.Equal(t, int64(s.Lease()), resp.Kvs[0].Lease)

	w := async(func() error { return etcdsync.NewBarrier(cli, name).Wait(ctx) })
	notYet(t, w, 200*time.Millisecond, "Wait while the holder lives")
	_, err = cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	require.NoError(t, resultWithin(t, w, testTimeout, "Wait after the holder's lease ended"))
	require.ErrorIs(t, b.Release(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, etcdsync.NewBarrier(cli, name).HoldFor(ctx, s), etcdsync.ErrSessionExpired, "HoldFor with a revoked lease")
	require.Empty(t, keys(t, cli, name))
}

// A holder that crashes (its session orphaned: no Release, no revoke)
// holds the waiters only until its lease expires on the server.
func TestBarrierHoldForOpensWhenHolderLeaseExpires(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	_, cli, ctx := singleClient(t)
	const name = "expired-barrier"
	s := session(t, cli, etcdsync.WithTTL(2*time.Second))
	require.NoError(t, etcdsync.NewBarrier(cli, name).HoldFor(ctx, s))
	w := async(func() error { return etcdsync.NewBarrier(cli, name).Wait(ctx) })
	s.Orphan() // the process is gone: nobody keeps the lease alive, nobody revokes it
	notYet(t, w, time.Second, "Wait before the lease can expire")
	require.NoError(t, resultWithin(t, w, 10*time.Second, "Wait after the holder's lease expired"))
	require.Empty(t, keys(t, cli, name))
}

// A waiter keeps its place when its watch stream breaks and the revisions
// it watched from have been compacted meanwhile: it reads again and waits
// on, and returns on the Release. etcd's recipe Wait, in the same
// sequence, returns nil while the barrier is still held.
func TestBarrierWaitSurvivesCompaction(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "compacted-barrier"
	require.NoError(t, etcdsync.NewBarrier(admin, name).Hold(ctx))
	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 16)}
	waiter := etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...)
	ours := async(func() error { return etcdsync.NewBarrier(waiter, name).Wait(ctx) })
	theirs := async(func() error { return recipe.NewBarrier(waiter, name).Wait() })
	awaitCreated(t, cnt.created, 2, testTimeout, "the two waiters' watches")
	var last int64
	for range 2 { // past the revision the watches start from
		resp, err := admin.Put(ctx, "compaction-filler", "x")
		require.NoError(t, err)
		last = resp.Header.Revision
	}
	_, err := admin.Compact(ctx, last)
	require.NoError(t, err)
	p.DropConnections()
	require.NoError(t, resultWithin(t, theirs, testTimeout, "etcd's Wait after the compaction"), "etcd's Wait passes a held barrier")
	// Both watches resume on a new connection (and are compacted); ours
	// then reads and watches again.
	awaitCreated(t, cnt.created, 3, testTimeout, "the resumed watches, and our waiter's new one")
	notYet(t, ours, 300*time.Millisecond, "our Wait while the barrier is held")
	require.Equal(t, []string{name}, keys(t, admin, name), "the barrier is still held")
	require.NoError(t, etcdsync.NewBarrier(admin, name).Release(ctx))
	require.NoError(t, resultWithin(t, ours, testTimeout, "our Wait after the Release"))
}

// Wait reads linearizably: a waiter whose requests are all served by a
// follower cut off from its peers (behind the barrier's Hold) never passes
// the held barrier; after the heal it still waits, and returns on the
// Release.
func TestBarrierWaitThroughLaggingFollower(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	const name = "lagging-barrier"
	require.NoError(t, c.CutPeers(f))
	require.NoError(t, etcdsync.NewBarrier(admin, name).Hold(ctx))
	viaF := etcdsync.NewBarrier(etcdtest.NewClient(t, []string{f.Endpoint()}), name)
	w := async(func() error { return viaF.Wait(ctx) })
	notYet(t, w, time.Second, "Wait through the lagging follower")
	require.NoError(t, c.HealPeers(f))
	notYet(t, w, 500*time.Millisecond, "Wait through the follower, healed")
	require.NoError(t, etcdsync.NewBarrier(admin, name).Release(ctx))
	require.NoError(t, resultWithin(t, w, testTimeout, "Wait after the Release"))
}
