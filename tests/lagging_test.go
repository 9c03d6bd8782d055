package tests

// Lagging followers and late replays: a waiter served by a member behind the
// others neither holds early nor stays stuck.

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
)

// A waiter whose acquire is served by an up-to-date member but whose
// watches land on a follower lagging behind its read gets replayed deletes of
// older incarnations of the keys it watches (the same sessions unlock and
// lock again). Neither the predecessor's old delete (two holders: Invariant
// "Exclusion") nor its own key's old delete (a spurious ErrSessionExpired)
// may count.
func TestWaiterIgnoresLaggingFollowerReplays(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	viaF := etcdtest.Conn(t, f.Endpoint())
	created := make(chan struct{}, 16)
	a := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "lag")
	b := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, faults.WatchVia(viaF, created))), "lag")
	cut := func() { require.NoError(t, c.CutPeers(f)) }
	// b queues behind a while f lags; f heals and replays what it missed to
	// b's watches; b must still wait for a's real release.
	queueBehindThenHeal := func(trial int, what string) {
		require.Less(t, f.Rev(), a.Rev(), "f does not lag")
		errc := async(func() error { return b.Lock(ctx) })
		for range 2 {
			within(t, created, testTimeout, "b's watch created on f")
		}
		require.NoError(t, c.HealPeers(f))
		faults.CaughtUp(t, f, a.Rev())
		notYet(t, errc, 500*time.Millisecond, fmt.Sprintf("trial %d: b's Lock while a holds (%s counted)", trial, what))
		require.NoError(t, a.Unlock(ctx))
		require.NoError(t, resultWithin(t, errc, testTimeout, "b's Lock after a's release"))
	}
	for trial := 0; trial < 3; trial++ {
		// The predecessor's old incarnation: a unlocks and locks again
		// while f lags; b queues behind a's new key, watching through f.
		require.NoError(t, a.Lock(ctx))
		cut()
		require.NoError(t, a.Unlock(ctx))
		require.NoError(t, a.Lock(ctx))
		queueBehindThenHeal(trial, "the predecessor's old delete")

		// Its own key's old incarnation: b unlocks while a waits, and
		// locks again behind a while f lags.
		cut()
		aGot := lockAsync(t, ctx, a)
		waitKeys(t, etcdtest.NewClient(t, []string{u.Endpoint()}), "lag/", 2)
		require.NoError(t, b.Unlock(ctx))
		within(t, aGot, testTimeout, "a's Lock after b's release")
		queueBehindThenHeal(trial, "its own key's old delete")
		require.NoError(t, b.Unlock(ctx))
	}
}

// A reader whose watch stream is served by a follower cut off from its
// peers (lagging): its nearest writer withdraws, and (second case) the
// older writer releases too, while the follower lags. After the heal the
// reader must not hold while W1 holds, and must hold once W1 is gone.
func TestExactReaderWaitsThroughLaggingFollower(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("3 members")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	admin := c.Client(t)
	for _, tc := range []struct {
		name       string
		releaseW1  bool // during the cut
		unaryToAll bool // reads may go to the lagging follower too
	}{
		{"withdraw", false, false},
		{"withdraw-and-release", true, false},
		{"withdraw-reads-anywhere", false, true},
		{"both-reads-anywhere", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12blag-" + tc.name
			f := c.Follower()
			require.NotNil(t, f)
			li := slices.Index(c.Members(), c.Leader())
			require.GreaterOrEqual(t, li, 0)
			unary := li
			if tc.unaryToAll {
				unary = -1
			}
			w1, r, rgot := readerBehindWithdrawnWriter(t, ctx, c, name, f, unary, 64)
			if tc.releaseW1 {
				require.NoError(t, w1.Unlock(ctx))
			}
			time.Sleep(300 * time.Millisecond) // the fault's duration (below the election timeout)
			require.NoError(t, c.HealPeers(f))
			if tc.releaseW1 {
				require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after both writers went, follower healed"))
			} else {
				notYet(t, rgot, 700*time.Millisecond, "reader while W1 holds (after W2 withdrew behind a lagging follower)")
				require.NoError(t, w1.Unlock(ctx))
				require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1"))
			}
			require.NoError(t, r.RUnlock(ctx))
			waitCount(t, admin, name+"/", 5*time.Second, func(n int) bool { return n == 0 })
		})
	}
}

// readerBehindWithdrawnWriter sets up both lagging-follower tests: W1
// holds and W2 waits on name (their calls go to the leader, so that the cut
// follower's proposals do not block them); a reader R waits with its watch
// stream on follower f (its unary calls to member unary, or balanced with
// -1; created sizes its watch counter); then f is cut off from its peers
// and W2 gives up. It returns W1, R and R's RLock result.
func readerBehindWithdrawnWriter(t *testing.T, ctx context.Context, c *etcdtest.Cluster, name string, f *etcdtest.Member, unary, created int) (w1, r *etcdsync.RWMutex, rgot <-chan error) {
	t.Helper()
	fi := slices.Index(c.Members(), f)
	li := slices.Index(c.Members(), c.Leader())
	require.GreaterOrEqual(t, li, 0)
	cnt := counter{created: make(chan struct{}, created)}
	cli := faults.RoutedClient(t, c, fi, unary, cnt.dial()...)
	wcli := etcdtest.NewClient(t, []string{c.Member(li).Endpoint()})
	w2ctx, w2cancel := context.WithCancel(ctx)
	defer w2cancel()
	w1, _, w2got := writerAndWaiter(t, ctx, w2ctx, wcli, name)
	r = etcdsync.NewRWMutex(session(t, cli, etcdsync.WithTTL(10*time.Second)), name)
	rgot = async(func() error { return r.RLock(ctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "reader's watches on the follower")
	require.NoError(t, c.CutPeers(f))
	w2cancel()
	require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2 cancelled"), context.Canceled)
	return w1, r, rgot
}

// Same, with a cut longer than the election timeout: the follower loses
// its leader, the reader's stream (WithRequireLeader) breaks again and
// again, and the reader must neither hold early nor stay stuck.
func TestExactReaderWaitsThroughLeaderlessFollower(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("3 members")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx := ctxT(t)
	name := "r12blost"
	f := c.Follower()
	require.NotNil(t, f)
	li := slices.Index(c.Members(), c.Leader())
	w1, r, rgot := readerBehindWithdrawnWriter(t, ctx, c, name, f, li, 256)
	notYet(t, rgot, 2*time.Second, "reader while W1 holds (follower cut)")
	require.NoError(t, c.HealPeers(f))
	notYet(t, rgot, time.Second, "reader while W1 holds (healed)")
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1"))
	require.NoError(t, r.RUnlock(ctx))
}
