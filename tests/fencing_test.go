package tests

// Fencing: guards and headers of holds, and a guarded Do that a lagging
// member cannot answer stale.

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// The guard of a value with an invalid name or no session is a
// comparison etcd accepts and that is always false.
func TestGuardOfBadValueIsAlwaysFalse(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	guards := map[string]clientv3.Cmp{
		"mutex empty name":       etcdsync.NewMutex(s, "").IsOwner(),
		"mutex NUL name":         etcdsync.NewMutex(s, "a\x00b").IsOwner(),
		"mutex nil session":      etcdsync.NewMutex(nil, "x").IsOwner(),
		"election empty name":    etcdsync.NewElection(s, "").IsLeader(),
		"election nil session":   etcdsync.NewElection(nil, "x").IsLeader(),
		"mutex valid, not held":  etcdsync.NewMutex(s, "x").IsOwner(),
		"election valid, no win": etcdsync.NewElection(s, "x").IsLeader(),
	}
	for what, g := range guards {
		resp, err := cli.Txn(ctx).If(g).Then(clientv3.OpPut("guarded", what)).Commit()
		require.NoError(t, err, what)
		require.False(t, resp.Succeeded, what)
	}
	require.Empty(t, keys(t, cli, "guarded"))
}

// Header returns a fresh copy; callers mutating it do not change the hold.
func TestHeaderIsACopy(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "rh-hdr")
	require.NoError(t, m.Lock(ctx))
	h1 := m.Header()
	require.NotNil(t, h1)
	require.GreaterOrEqual(t, h1.Revision, m.Rev())
	require.NotZero(t, h1.ClusterId)
	require.NotZero(t, h1.MemberId)
	require.NotZero(t, h1.RaftTerm)
	r := h1.Revision
	h1.Revision = 1
	require.Equal(t, r, m.Header().Revision)
	require.NoError(t, m.Unlock(ctx))
	require.Nil(t, m.Header())
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
