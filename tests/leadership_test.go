package tests

// Shared leadership: ResumeElection shares a leadership (and nothing else)
// of the session.

import (
	"context"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// ResumeElection with the key and revision the session leads with shares
// the leadership: Proclaim, Do and Resign through either handle act on the
// same term; after a Resign either may Campaign again. A wrong revision or
// another session's key does not lead.
func TestResumeElectionSharesLeadership(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	e := etcdsync.NewElection(s, "share")
	obs, _ := observe(t, e)
	require.NoError(t, e.Campaign(ctx, "v1"))
	require.Equal(t, "v1", obs.next(t))

	r := etcdsync.ResumeElection(s, "share", e.Key(), e.Rev())
	require.NoError(t, r.Err())
	require.Equal(t, e.Key(), r.Key())
	require.Equal(t, e.Rev(), r.Rev())
	require.NoError(t, r.Proclaim(ctx, "v2"))
	require.Equal(t, "v2", obs.next(t))
	_, err := r.Do(ctx, clientv3.OpPut("share-data", "x"))
	require.NoError(t, err)

	done := e.Done()
	require.NoError(t, r.Resign(ctx))
	within(t, done, testTimeout, "e.Done after a Resign through r")
	require.Empty(t, e.Key())
	require.ErrorIs(t, e.Proclaim(ctx, "x"), etcdsync.ErrElectionNotLeader)
	require.Empty(t, keys(t, cli, "share/"))

	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, r.Campaign(cctx, "v3"), "r campaigns again after the shared term ended")
	require.Equal(t, "v3", obs.next(t))

	wrong := etcdsync.ResumeElection(s, "share", r.Key(), r.Rev()+100)
	require.Empty(t, wrong.Key())
	require.ErrorIs(t, wrong.Err(), etcdsync.ErrNotHeld)
	other := etcdsync.ResumeElection(session(t, cli), "share", r.Key(), r.Rev())
	require.Empty(t, other.Key())
	require.ErrorIs(t, other.Err(), etcdsync.ErrInvalidArgument)
	require.NoError(t, r.Resign(ctx))
}

// ResumeElection shares only a leadership, never another live hold of the
// session on that key, a Mutex's included (a Mutex and an Election on one
// name write the same key NAME/<lease>). Leading on the Mutex's hold, the
// Election's Proclaim would overwrite the lock key's value and its Resign
// delete the Mutex's key, after which the Mutex would report its hold as
// released by Unlock (ErrLockReleased) although nobody unlocked it. The
// contract: "when a value of the session uses the key otherwise, the Election
// does not lead and Err says why".
func TestResumeElectionDoesNotShareMutexHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t), etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "r9-shared")
	require.NoError(t, m.Lock(ctx))
	done := m.Done()
	r := etcdsync.ResumeElection(s, "r9-shared", m.Key(), m.Rev())
	if r.Key() != "" {
		perr := r.Proclaim(ctx, "hijacked")
		rerr := r.Resign(ctx)
		select {
		case <-done:
		case <-time.After(2 * time.Second):
		}
		t.Fatalf("ResumeElection shares the Mutex's hold: Proclaim %v, Resign %v; the Mutex's hold then ended: %v (Err %v)",
			perr, rerr, isClosed(done), m.Err())
	}
	require.Error(t, r.Err())
	require.NoError(t, m.Unlock(ctx))
}

// Two handles of one shared leadership agree on its Header.
// Election.Header is "the response header of the last successful Campaign or
// Proclaim of the current term": after a Proclaim through r, e (same term)
// must not still return the Campaign's header, a revision at which the
// leader's value was the old one.
func TestSharedLeadershipHandlesAgreeOnHeader(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t), etcdsync.WithTTL(30*time.Second))
	e := etcdsync.NewElection(s, "r9-header")
	require.NoError(t, e.Campaign(ctx, "v1"))
	r := etcdsync.ResumeElection(s, "r9-header", e.Key(), e.Rev())
	require.NoError(t, r.Proclaim(ctx, "v2"))
	require.Equal(t, r.Header().Revision, e.Header().Revision, "one term, two headers")
	require.NoError(t, e.Resign(ctx))
}

// ResumeElection shares a live hold; after a Resign frees the key, the
// sharer sees the end and a new resume is not handed the old hold.
func TestResumeElectionAfterResignSharesNothing(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	e1 := etcdsync.NewElection(s, "rh-res")
	require.NoError(t, e1.Campaign(ctx, "a"))
	key, rev := e1.Key(), e1.Rev()
	e2 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.NoError(t, e2.Err())
	require.Equal(t, rev, e2.Rev())
	d2 := e2.Done()
	require.NoError(t, e2.Proclaim(ctx, "b"))
	require.Equal(t, e2.Header().Revision, e1.Header().Revision)
	require.NoError(t, e1.Resign(ctx))
	within(t, d2, 5*time.Second, "sharer's Done after Resign")
	require.ErrorIs(t, e2.Err(), etcdsync.ErrLockReleased)
	require.Equal(t, "", e2.Key())
	// new term by e2; a resume of the old rev must not share it
	require.NoError(t, e2.Campaign(ctx, "c"))
	e3 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.ErrorIs(t, e3.Err(), etcdsync.ErrNotHeld)
	e4 := etcdsync.ResumeElection(s, "rh-res", key, e2.Rev())
	require.NoError(t, e4.Err())
	// a Mutex on the name of the same session can't resume an election hold
	require.NoError(t, e4.Resign(ctx))
	require.ErrorIs(t, e2.Err(), etcdsync.ErrLockReleased)
	// resume after release: gets a fresh (stale) hold, gone at first guarded call
	e5 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.NoError(t, e5.Err())
	_, err := e5.Do(ctx)
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.NoError(t, e2.Campaign(ctx, "d"))
	require.NoError(t, e2.Resign(ctx))
}
