package tests

// Health: Check answers, without an RPC, whether a session lives and whether
// a value's hold is current, for a service's own health endpoint.

import (
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
)

// Check is ErrNotHeld before a hold, nil while it lasts, and turns to the
// cause as soon as the hold is lost, also when nobody called Done: the key
// deleted by someone, or the session closed.
func TestCheckFollowsTheHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	checks := map[string]func() error{}
	m := etcdsync.NewMutex(s, "health-m")
	e := etcdsync.NewElection(s, "health-e")
	rw := etcdsync.NewRWMutex(s, "health-rw")
	sem := etcdsync.NewSemaphore(s, "health-sem", 2)
	checks["Mutex"], checks["Election"], checks["RWMutex"], checks["Semaphore"] = m.Check, e.Check, rw.Check, sem.Check
	for kind, check := range checks {
		require.ErrorIs(t, check(), etcdsync.ErrNotHeld, kind)
	}
	require.NoError(t, s.Check())
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, e.Campaign(ctx, "v"))
	require.NoError(t, rw.RLock(ctx))
	require.NoError(t, sem.Acquire(ctx, 1))
	for kind, check := range checks {
		require.NoError(t, check(), kind)
	}

	// Someone deletes the Mutex's key: its Check (which started the loss
	// watch) turns, the others stay.
	_, err := cli.Delete(ctx, m.Key())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return m.Check() != nil }, testTimeout, 10*time.Millisecond)
	require.ErrorIs(t, m.Check(), etcdsync.ErrNotHeld)
	require.NoError(t, e.Check())

	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Check(), etcdsync.ErrSessionClosed)
	for kind, check := range checks {
		require.Error(t, check(), kind)
	}
}

// Session.Check is ErrSessionExpired once the session is cut off past its
// local deadline, no later than Done closes.
func TestSessionCheckOnLostContact(t *testing.T) {
	t.Parallel()
	c := single(t)
	acli, p := faults.Proxied(t, c)
	s := session(t, acli, etcdsync.WithTTL(2*time.Second))
	e := etcdsync.NewElection(s, "health-lost")
	require.NoError(t, e.Campaign(ctxT(t), "v"))
	require.NoError(t, e.Check())
	p.Blackhole(true)
	defer p.Blackhole(false)
	require.Eventually(t, func() bool { return s.Check() != nil }, testTimeout, 10*time.Millisecond)
	require.ErrorIs(t, s.Check(), etcdsync.ErrSessionExpired)
	require.ErrorIs(t, s.Check(), etcdsync.ErrLostContact)
	require.False(t, time.Now().Before(s.Deadline()), "Check turned before the deadline")
	require.ErrorIs(t, e.Check(), etcdsync.ErrSessionExpired)
}
