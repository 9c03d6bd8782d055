package tests

// Leadership: ResumeElection shares a leadership (and nothing else) of the
// session; lock-delay keeps the next holder out after a holder lost
// contact, and not after a clean end.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
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

// A holder cut off from etcd is told at its local deadline (the TTL); the
// next holder gets the lock no sooner than the slack and the delay after
// that, and within TTL + slack + delay and some.
func TestLockDelayAfterLostContact(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	ctx := ctxT(t)
	const ttl, delay = 2 * time.Second, 3 * time.Second
	acli, p := faults.Proxied(t, c)
	as := session(t, acli, etcdsync.WithTTL(ttl), etcdsync.WithLockDelay(delay))
	require.Equal(t, ttl, as.TTL())
	ttlResp, err := acli.TimeToLive(ctx, as.Lease())
	require.NoError(t, err)
	require.Equal(t, int64((ttl+as.Slack()+delay)/time.Second), ttlResp.GrantedTTL, "the lease carries the slack and the delay")
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
	require.NoError(t, resultWithin(t, bHolds, ttl+as.Slack()+delay+testTimeout, "the next holder gets the lock"))
	got := time.Now()
	// The server frees the key at least the slack and the delay after the
	// holder's local deadline (they add up); a second of the two covers a
	// late timer on the holder's side.
	require.GreaterOrEqual(t, got.Sub(told), as.Slack()+delay-time.Second, "the next holder got the lock %v after the loss", got.Sub(told))
	require.Less(t, got.Sub(cut), ttl+as.Slack()+delay+10*time.Second)
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

// A holder that lost contact is told at its local deadline; when contact
// comes back and the program then closes its session (as `defer s.Close()`
// does once its Run returned on the loss), the next holder still waits the
// delay from when the holder was told: the hold ended by loss, not release.
func TestLockDelayHoldsWhenLostSessionIsClosed(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	const ttl, delay = 2 * time.Second, 6 * time.Second
	acli, p := faults.Proxied(t, c)
	as, err := etcdsync.NewSession(acli, etcdsync.WithTTL(ttl), etcdsync.WithLockDelay(delay))
	require.NoError(t, err)
	a := etcdsync.NewMutex(as, "delay-close-lost")
	require.NoError(t, a.Lock(ctx))
	lost := a.Done()

	cli := c.Client(t)
	b := etcdsync.NewMutex(session(t, cli), "delay-close-lost")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, cli, "delay-close-lost/", 2)
	p.Blackhole(true)
	within(t, lost, ttl+testTimeout, "the holder is told of its loss")
	told := time.Now()
	require.ErrorIs(t, a.Err(), etcdsync.ErrSessionExpired)
	p.Blackhole(false)
	// The program, told, winds down and closes its session.
	_ = as.Close()
	require.NoError(t, resultWithin(t, bHolds, delay+testTimeout, "the next holder gets the lock"))
	got := time.Since(told)
	require.GreaterOrEqual(t, got, delay-time.Second, "the next holder got the lock %v after the holder was told of its loss (lock delay %v)", got, delay)
}

// A session with a lock delay closed as its local deadline passes, before
// its keepalive loop has ended it (a loop running late; Check answers
// ErrLostContact from the deadline on): contact was lost all the same, so
// Close does not revoke, and the hold's key stays for the delay.
func TestLockDelayHoldsWhenSessionIsClosedAsItsDeadlinePasses(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "delay-close-at-deadline"
	s, closeAtDeadline := lateLoopSession(t, c, etcdsync.WithTTL(2*time.Second), etcdsync.WithLockDelay(6*time.Second))
	require.NoError(t, etcdsync.NewMutex(s, name).Lock(ctx))
	require.NoError(t, resultWithin(t, closeAtDeadline(), testTimeout, "Close"))
	require.Len(t, keys(t, admin, name+"/"), 1, "the hold's key after Close: the lease runs out the delay")
}

// A holder whose session is revoked by someone else is told within a watch
// round trip and the next holder takes over at once (the delay lives in the
// lost holder's lease and a revoke ends it): a Run's fn sees its context end
// before the next holder's Lock returns.
func TestLockDelayRevokedElsewhereEndsRunFirst(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	as := session(t, cli, etcdsync.WithTTL(5*time.Second), etcdsync.WithLockDelay(30*time.Second))
	a := etcdsync.NewMutex(as, "delay-revoked")
	working := make(chan struct{})
	ended := make(chan struct{})
	run := async(func() error {
		return a.Run(ctx, func(ctx context.Context) error {
			close(working)
			<-ctx.Done()
			close(ended)
			return nil
		})
	})
	<-working
	b := etcdsync.NewMutex(session(t, cli), "delay-revoked")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, cli, "delay-revoked/", 2)
	_, err := c.Client(t).Revoke(ctx, as.Lease())
	require.NoError(t, err)
	require.NoError(t, resultWithin(t, bHolds, testTimeout, "the next holder gets the lock at once"))
	within(t, ended, testTimeout, "the revoked Run's fn is told")
	err = resultWithin(t, run, testTimeout, "the Run returns")
	require.True(t, errors.Is(err, etcdsync.ErrNotHeld) || errors.Is(err, etcdsync.ErrSessionExpired), "the Run's error says the hold was lost: %v", err)
	require.Error(t, a.Check())
	within(t, as.Done(), testTimeout, "the session learns its lease is gone")
	require.ErrorIs(t, as.Check(), etcdsync.ErrSessionExpired)
}

// A Run that returns on its own (a clean end) hands over at once even with a
// long delay; so does a Handover of an Election's Run.
func TestLockDelayNotAfterRunOrHandover(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const delay = time.Minute
	as := session(t, cli, etcdsync.WithTTL(2*time.Second), etcdsync.WithLockDelay(delay))

	m := etcdsync.NewMutex(as, "delay-run")
	release := make(chan struct{})
	run := async(func() error {
		return m.Run(ctx, func(context.Context) error { <-release; return nil })
	})
	waitKeys(t, cli, "delay-run/", 1)
	b := etcdsync.NewMutex(session(t, cli), "delay-run")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, cli, "delay-run/", 2)
	close(release)
	require.NoError(t, resultWithin(t, run, testTimeout, "the Run returns"))
	require.NoError(t, resultWithin(t, bHolds, testTimeout, "the next holder gets the lock at once"))

	e := etcdsync.NewElection(as, "delay-handover")
	working := make(chan struct{})
	erun := async(func() error {
		return e.Run(ctx, "a", func(ctx context.Context) error { close(working); <-ctx.Done(); return nil })
	})
	<-working
	f := etcdsync.NewElection(session(t, cli), "delay-handover")
	fLeads := async(func() error { return f.Campaign(ctx, "f") })
	waitKeys(t, cli, "delay-handover/", 2)
	require.NoError(t, e.Handover(ctx))
	require.NoError(t, resultWithin(t, erun, testTimeout, "the Run returns"))
	require.NoError(t, resultWithin(t, fLeads, testTimeout, "the next candidate leads at once"))
}

// A process that adopts a lease granted with a delay and loses contact is
// told by the adopted TTL less the delay; the next holder still waits the
// delay after that.
func TestLockDelayAdoptedLeaseAfterLostContact(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli := c.Client(t)
	const ttl, delay = 2 * time.Second, 4 * time.Second
	first := session(t, cli, etcdsync.WithTTL(ttl), etcdsync.WithLockDelay(delay))
	m := etcdsync.NewMutex(first, "delay-adopt")
	require.NoError(t, m.Lock(ctx))
	first.Orphan() // the process restarts

	acli, p := faults.Proxied(t, c)
	as, err := etcdsync.NewSession(acli, etcdsync.WithLease(first.Lease()), etcdsync.WithLockDelay(delay))
	require.NoError(t, err)
	defer as.Orphan()
	require.Equal(t, ttl, as.TTL())
	a := etcdsync.NewMutex(as, "delay-adopt")
	require.NoError(t, a.Lock(ctx), "resumes the hold")
	lost := a.Done()
	b := etcdsync.NewMutex(session(t, cli), "delay-adopt")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, cli, "delay-adopt/", 2)
	p.Blackhole(true)
	defer p.Blackhole(false)
	within(t, lost, ttl+testTimeout, "the adopter is told of its loss")
	told := time.Now()
	require.Error(t, a.Check())
	require.Error(t, as.Check())
	require.NoError(t, resultWithin(t, bHolds, delay+testTimeout, "the next holder gets the lock"))
	require.GreaterOrEqual(t, time.Since(told), delay-time.Second)
}
