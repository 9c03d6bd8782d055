package etcdsync_test

// Attack 28c: reads that decide who holds, served by a member that lags.
// A MultiLock's wait watches the acquire's keys on its other names from the
// serving member's current revision; a lagging member replays deletes of
// older incarnations of those keys. A guarded Do with no ops is a
// transaction of compares alone, which etcd serves as a serializable read.

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/faults"
)

// A MultiLock on a and b unlocks while follower f lags, and locks again
// behind a Mutex on b: its wait on b watches its own key on a (the same
// acquire's) through f. When f catches up it replays the delete of the
// MultiLock's previous key on a (an older incarnation, deleted before the
// new acquire's read). That delete must not count as the new key's: Lock
// must go on waiting, and hold once the Mutex is released.
func TestMultiLockWaitIgnoresReplayedDeleteOfOlderKeyOnOtherName(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	viaF := etcdtest.Conn(t, f.Endpoint())
	created := make(chan struct{}, 16)
	ml := etcdsync.NewMultiLock(session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, faults.WatchVia(viaF, created))), "a28c", "b28c")
	blocker := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "b28c")

	require.NoError(t, ml.Lock(ctx)) // no wait: no watch
	require.NoError(t, c.CutPeers(f))
	require.NoError(t, ml.Unlock(ctx)) // f does not see this delete yet
	require.NoError(t, blocker.Lock(ctx))
	errc := async(func() error { return ml.Lock(ctx) })
	for range 3 { // own key on b, the blocker's key, own key on a (also)
		within(t, created, testTimeout, "the MultiLock's watches created on f")
	}
	require.NoError(t, c.HealPeers(f))
	faults.CaughtUp(t, f, blocker.Rev())
	notYet(t, errc, 700*time.Millisecond, "MultiLock's Lock while the Mutex on b holds (a replayed old delete of its key on a counted)")
	require.NoError(t, blocker.Unlock(ctx))
	require.NoError(t, resultWithin(t, errc, testTimeout, "MultiLock's Lock after the Mutex's release"))
	require.NoError(t, ml.Unlock(ctx))
}

// A Mutex's Do with no ops (a guarded transaction of compares alone) is
// served by etcd as a serializable read: through a follower cut off from
// its peers it answers that the hold is current after its key was deleted.
// It must not succeed (ErrNotHeld, or an error while the member cannot
// confirm). MultiLock.Do is pinned beside it: its Else gets make it
// linearizable.
func TestGuardedDoWithoutOpsNotAnsweredByLaggingFollower(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	fi := slices.Index(c.Members(), f)
	cli := faults.RoutedClient(t, c, fi, fi) // every call through f
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})

	m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(10*time.Second)), "do28c")
	require.NoError(t, m.Lock(ctx))
	ml := etcdsync.NewMultiLock(session(t, cli, etcdsync.WithTTL(10*time.Second)), "do28c-x", "do28c-y")
	require.NoError(t, ml.Lock(ctx))
	faults.CaughtUp(t, f, ml.Header().Revision)

	require.NoError(t, c.CutPeers(f))
	defer func() { require.NoError(t, c.HealPeers(f)) }()
	_, err := admin.Delete(ctx, m.Key())
	require.NoError(t, err)
	_, err = admin.Delete(ctx, ml.Key("do28c-x"))
	require.NoError(t, err)

	doWithin := func(do func(context.Context) error) error { // the cut stays below the election timeout
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		return do(short)
	}
	mErr := doWithin(func(ctx context.Context) error { _, err := m.Do(ctx); return err })
	mlErr := doWithin(func(ctx context.Context) error { _, err := ml.Do(ctx); return err })
	require.Error(t, mlErr, "MultiLock.Do() through a lagging follower after a key was deleted")
	require.Error(t, mErr, "Mutex.Do() through a lagging follower after its key was deleted: a stale serializable answer")
}

// Group.Members through a follower cut off from its peers (behind a Join)
// never answers without the member that joined: its read is linearizable,
// so it waits for the member to confirm (here: past a short deadline).
func TestGroupMembersNotAnsweredStaleByLaggingFollower(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	fi := slices.Index(c.Members(), f)
	viaF := etcdsync.NewGroup(session(t, faults.RoutedClient(t, c, fi, fi), etcdsync.WithTTL(10*time.Second)), "g28c")
	require.NoError(t, c.CutPeers(f))
	defer func() { require.NoError(t, c.HealPeers(f)) }()
	joiner := etcdsync.NewGroup(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "g28c")
	require.NoError(t, joiner.Join(ctx, "x"))
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond) // below the election timeout
	defer cancel()
	ms, _, err := viaF.Members(short)
	if err == nil {
		require.True(t, slices.ContainsFunc(ms, func(e etcdsync.Entry) bool { return e.Key == joiner.Key() }), "Members through a lagging follower misses a member that joined: %v", ms)
	}
}
