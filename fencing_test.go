package etcdsync_test

// Fencing: guards and headers of holds.

import (
	"testing"

	"github.com/etcdsync/etcdsync"
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
