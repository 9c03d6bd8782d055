package etcdsync_test

// Lock-delay (WithLockDelay): after a holder loses its hold by losing
// contact, nobody else holds the name until the delay has passed since the
// holder was told; a clean end (Unlock, Close) hands over at once.

import (
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/faults"
	"github.com/stretchr/testify/require"
)

// A holder cut off from etcd is told at its local deadline (the TTL); the
// next holder gets the lock no sooner than the delay after that, and within
// TTL + delay + slack.
func TestLockDelayAfterLostContact(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	const ttl, delay = 2 * time.Second, 3 * time.Second
	acli, p := faults.Proxied(t, c)
	as := session(t, acli, etcdsync.WithTTL(ttl), etcdsync.WithLockDelay(delay))
	require.Equal(t, ttl, as.TTL())
	ttlResp, err := acli.TimeToLive(ctx, as.Lease())
	require.NoError(t, err)
	require.Equal(t, int64((ttl+delay)/time.Second), ttlResp.GrantedTTL, "the lease carries the delay")
	a := etcdsync.NewMutex(as, "delay")
	require.NoError(t, a.Lock(ctx))
	lost := a.Done()

	cli := c.Client(t)
	b := etcdsync.NewMutex(session(t, cli), "delay")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, cli, "delay/", 2)
	cut := time.Now()
	p.Blackhole(true)
	defer p.Blackhole(false)
	within(t, lost, ttl+testTimeout, "the holder is told of its loss")
	told := time.Now()
	require.ErrorIs(t, a.Check(), etcdsync.ErrSessionExpired)
	require.NoError(t, resultWithin(t, bHolds, ttl+delay+testTimeout, "the next holder gets the lock"))
	got := time.Now()
	// The server frees the key at least delay after the holder's local
	// deadline; the second of slack covers a late timer on the holder's side.
	require.GreaterOrEqual(t, got.Sub(told), delay-time.Second, "the next holder got the lock %v after the loss", got.Sub(told))
	require.Less(t, got.Sub(cut), ttl+delay+10*time.Second)
}

// With a delay set, Unlock and Close hand over at once: the next holder does
// not wait out the (long) delay.
func TestLockDelayNotAfterCleanEnd(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const delay = time.Minute
	for _, end := range []string{"Unlock", "Close"} {
		t.Run(end, func(t *testing.T) {
			name := "delay-clean-" + end
			as := session(t, cli, etcdsync.WithTTL(2*time.Second), etcdsync.WithLockDelay(delay))
			a := etcdsync.NewMutex(as, name)
			require.NoError(t, a.Lock(ctx))
			b := etcdsync.NewMutex(session(t, cli), name)
			bHolds := async(func() error { return b.Lock(ctx) })
			waitKeys(t, cli, name+"/", 2)
			if end == "Unlock" {
				require.NoError(t, a.Unlock(ctx))
			} else {
				require.NoError(t, as.Close())
			}
			require.NoError(t, resultWithin(t, bHolds, testTimeout, "the next holder gets the lock at once"))
		})
	}
}

// A negative delay is an error; WithLease takes the delay out of the adopted
// lease's TTL.
func TestLockDelayOptions(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	_, err := etcdsync.NewSession(cli, etcdsync.WithLockDelay(-time.Second))
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)

	s := session(t, cli, etcdsync.WithTTL(5*time.Second), etcdsync.WithLockDelay(3*time.Second))
	adopted := session(t, cli, etcdsync.WithLease(s.Lease()), etcdsync.WithLockDelay(3*time.Second))
	require.Equal(t, 5*time.Second, adopted.TTL())
	require.True(t, adopted.Deadline().Before(time.Now().Add(5*time.Second)), "the adopted deadline leaves the delay out")
	s.Orphan()
	adopted.Orphan()
	_, err = etcdsync.NewSession(cli, etcdsync.WithLease(s.Lease()), etcdsync.WithLockDelay(10*time.Second))
	require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "a lease with less TTL left than the delay")
}
