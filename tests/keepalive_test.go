package tests

// Keepalive: a lease adopted late is kept, a stream that cannot open costs
// no CPU, a slow link is not a lost one.

import (
	"fmt"
	"syscall"
	"testing"
	"time"

	"context"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A process that adopts its lease with less than a third of the TTL left
// keeps it, and the holds it resumes: the first keepalive goes out at once.
func TestLateAdoptionKeepsLease(t *testing.T) {
	slow(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	_, cli, ctx := singleClient(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(3*time.Second))
	require.NoError(t, err)
	m1 := etcdsync.NewMutex(s1, "late-adopt")
	require.NoError(t, m1.Lock(ctx))
	rev := m1.Rev()
	s1.Orphan()
	for { // the restart is slow: wait until at most a second of the TTL is left, beyond the slack
		ttl, err := cli.TimeToLive(ctx, s1.Lease())
		require.NoError(t, err)
		require.Greater(t, ttl.TTL, int64(0), "the lease expired before the restart")
		if ttl.TTL <= 1+int64(s1.Slack()/time.Second) {
			break
		}
		time.Sleep(100 * time.Millisecond) // polling the server's TTL
	}
	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	m2 := etcdsync.NewMutex(s2, "late-adopt")
	require.NoError(t, m2.Lock(ctx))
	require.Equal(t, rev, m2.Rev())
	notWithin(t, s2.Done(), 3*s2.TTL(), "the adopted session ended")
	ttl, err := cli.TimeToLive(ctx, s2.Lease())
	require.NoError(t, err)
	require.Greater(t, ttl.TTL, int64(0))
	require.NoError(t, m2.Unlock(ctx))
}

// A slow link is not a lost link: with every reply delayed by TTL/4 or TTL/2
// (the server acknowledging each keepalive in time) no session ends and every
// hold stays, for 3 TTLs; cut off, the same session's Done still closes
// before the server deletes its key, and within TTL + 1 s of the cut. On a
// 3-member cluster the session reaches only the slow member.
func TestSlowLinkIsNotLost(t *testing.T) {
	slow(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		cli, p := faults.Proxied(t, c)
		s := session(t, cli, etcdsync.WithTTL(2*time.Second))
		m := etcdsync.NewMutex(s, "slow")
		require.NoError(t, m.Lock(ctx))
		held := m.Done()
		for _, latency := range []time.Duration{s.TTL() / 4, s.TTL() / 2} {
			p.SetLatency(latency)
			notWithin(t, s.Done(), 3*s.TTL(), fmt.Sprintf("the session ended with reply latency %v", latency))
			require.NoError(t, m.Err())
			require.Len(t, keys(t, admin, "slow/"), 1)
		}

		wch := admin.Watch(ctx, m.Key(), clientv3.WithRev(m.Rev()+1))
		cut := time.Now()
		p.Blackhole(true)
		defer p.Blackhole(false)
		deleted := awaitDelete(t, wch)
		require.True(t, isClosed(held), "the server deleted the key before the hold's Done closed")
		require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
		require.False(t, s.Deadline().After(cut.Add(s.TTL())), "local deadline later than the cut plus the TTL")
		t.Logf("Done's lead over the server's delete: %v", deleted.Sub(s.Deadline()))
	})
}

// cpuTime returns the CPU time (user + system) this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// The keepalive loop must not busy-loop while it cannot open its stream.
// After a stream fails, the next open is due at `next`, which is already in
// the past when the failed stream had sent no beat (it failed while opening);
// the loop must still pause between opens. Two faces:
//
//   - open-fails: the open fails at once (no endpoint is up: a one-member
//     cluster restarting, all members down; with auth, a token fetch that
//     fails, e.g. after a password change). Reopening at once, again and
//     again, would be thousands of streams a second and two cores here (with
//     auth, one bcrypt Authenticate on the server after another), for up to
//     a TTL (60 s by default), per session.
//   - open-blocks: the open blocks (no endpoint ready and one connecting:
//     e.g. a restarting member, whose client listener is bound before it
//     replays its WAL, accepts TCP and answers only when ready; a proxy or
//     load balancer in front of a dead member). The beat is due; a timer
//     armed in the past would fire at once and send the loop round again:
//     one core, until the stream opens or the deadline passes.
//
// The session (TTL 6 s) rightly lives on meanwhile; the process must not burn.
// It measures the process's CPU time, so it does not run in parallel.
func TestKeepaliveIdlesWhileStreamCannotOpen(t *testing.T) {
	slow(t)
	for _, tc := range []struct {
		name  string
		fault func(p *etcdtest.Proxy)
	}{
		{"open-fails", func(p *etcdtest.Proxy) { p.Close() }},
		{"open-blocks", func(p *etcdtest.Proxy) { p.Blackhole(true); p.DropConnections() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := single(t)
			cnt := counter{}
			cli, p := faults.Proxied(t, c, cnt.dial()...)
			s := session(t, cli, etcdsync.WithTTL(6*time.Second))
			defer s.Orphan()                    // no revoke through a dead link: the lease expires by itself
			time.Sleep(2500 * time.Millisecond) // the first beat went, on an open stream

			tc.fault(p)
			defer p.Blackhole(false)
			time.Sleep(700 * time.Millisecond) // the stream failed; its next open is due
			c0, w0, st0 := cpuTime(t), time.Now(), cnt.streams.Load()
			time.Sleep(1500 * time.Millisecond)
			used, wall, opened := cpuTime(t)-c0, time.Since(w0), cnt.streams.Load()-st0
			require.NoError(t, s.Err(), "the session is still within its TTL")
			t.Logf("while the keepalive stream cannot open: CPU %v over %v, %d streams opened", used, wall, opened)
			require.Less(t, opened, int64(10), "stream opens without a pause")
			require.Less(t, used, wall/4, "the process spins while its keepalive stream cannot open")
		})
	}
}

// Deadline never passes the server's expiry: TTL remaining on the server,
// read after the local deadline is read, is never shorter than the local
// deadline (minus a second: TimeToLive rounds down to whole seconds).
func deadlineWithinServer(t *testing.T, admin *clientv3.Client, s *etcdsync.Session) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	local := s.Deadline()
	resp, err := admin.TimeToLive(ctx, s.Lease())
	if err != nil {
		return // no leader now: nothing to compare
	}
	server := time.Now().Add(time.Duration(resp.TTL+1) * time.Second)
	require.False(t, local.After(server), "local deadline %v past the server's expiry (TTL %d s left at %v)", local, resp.TTL, time.Now())
}

// Quorum lost for 4 s (two of three members stopped, then restarted) under
// a session whose client reaches only the surviving member: its keepalive
// beats fail at once (no leader) and are retried every retryPause, not in a
// loop; the session (TTL 10 s) survives; its local deadline never passes the
// server's expiry. A waiter on that client, whose watches the member ends
// (no leader for three election timeouts, WithRequireLeader), waits on and
// gets the lock once the holder releases it after the failover
// (etcd-io/etcd#8618: an error answer to a keepalive halted etcd's client's
// keepalive loop for good, and every session on that client with it).
func TestQuorumLossShorterThanTTLKeepsSessionAndWaiter(t *testing.T) {
	t.Parallel()
	c := three(t)
	ctx := ctxT(t)
	f := c.Follower()
	require.NotNil(t, f)
	cnt := &counter{}
	cli := etcdtest.NewClient(t, []string{f.Endpoint()}, cnt.dial()...)
	admin := c.Client(t)
	const ttl = 10 * time.Second
	s := session(t, cli, etcdsync.WithTTL(ttl))
	hs := session(t, admin, etcdsync.WithTTL(ttl))
	const name = "ka-quorum"
	holder, waiter := etcdsync.NewMutex(hs, name), etcdsync.NewMutex(s, name)
	require.NoError(t, holder.Lock(ctx))
	w := async(func() error { return waiter.Lock(ctx) })
	waitKeys(t, admin, name+"/", 2)
	time.Sleep(300 * time.Millisecond)
	deadlineWithinServer(t, admin, s)

	var stopped []*etcdtest.Member
	for _, m := range c.Members() {
		if m != f {
			c.Stop(m)
			stopped = append(stopped, m)
		}
	}
	k0 := cnt.keepalives.Load()
	time.Sleep(4 * time.Second)
	during := cnt.keepalives.Load() - k0
	for _, m := range stopped {
		require.NoError(t, c.Restart(m))
	}
	t.Logf("keepalive requests during the 4 s without quorum: %d", during)
	require.Less(t, during, int64(16), "keepalive beats retried without a pause")
	require.NoError(t, s.Err(), "the session, within its TTL")
	notYet(t, w, 100*time.Millisecond, "the waiter, while the holder holds")
	// Wait for the cluster to take a keepalive again, then compare deadlines.
	dl := s.Deadline()
	for end := time.Now().Add(testTimeout); !s.Deadline().After(dl); {
		require.True(t, time.Now().Before(end), "no keepalive acknowledged after the failover")
		require.NoError(t, s.Err())
		time.Sleep(50 * time.Millisecond)
	}
	deadlineWithinServer(t, admin, s)
	require.NoError(t, hs.Err())
	require.False(t, isClosed(holder.Done()), "the holder's Done")
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, w, testTimeout, "the waiter after the failover"))
	require.NoError(t, waiter.Unlock(ctx))
	waitNoKeys(t, admin, name+"/")
}

// A leader change during a cut (etcd's lessor promotes leases on the new
// leader) never makes the server free a cut-off holder's key sooner than
// the slack after the holder was told.
func TestLeaderChangeDuringCutKeepsSlack(t *testing.T) {
	t.Parallel()
	slow(t)
	c := three(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(2*time.Second))
	m := etcdsync.NewMutex(s, "leaderchange")
	require.NoError(t, m.Lock(ctx))
	b := etcdsync.NewMutex(session(t, admin), "leaderchange")
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, admin, "leaderchange/", 2)
	p.Blackhole(true)
	require.NoError(t, c.TransferLeader(ctx))
	within(t, m.Done(), s.TTL()+testTimeout, "the holder is told")
	told := time.Now()
	require.NoError(t, c.TransferLeader(ctx)) // and once more, within the slack
	require.NoError(t, resultWithin(t, bHolds, testTimeout, "the contender gets the lock"))
	got := time.Now()
	t.Logf("the contender got the lock %v after the holder was told", got.Sub(told))
	require.GreaterOrEqual(t, got.Sub(told), s.Slack()-200*time.Millisecond)
}

// Through etcd's gRPC proxy with a slow link (replies 1.5 s late), a holder
// cut off is told at least the slack before the next holder gets the lock,
// and the next holder gets it within the failover the docs state for the
// proxy: twice the lease (TTL plus slack) after the last acknowledged
// keepalive, as the proxy renews a lease itself for its granted TTL after
// the last request it answered (and the server's expiry check, half a
// second, and a second for a late test).
func TestGRPCProxyCutFailsOverWithinTwiceTheLease(t *testing.T) {
	t.Parallel()
	slow(t)
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	gp := etcdtest.StartGRPCProxy(t, c.Endpoints())
	p := etcdtest.NewProxy(t, gp)
	t.Cleanup(p.Close)
	cli := etcdtest.NewClient(t, []string{p.Endpoint()})
	s := session(t, cli, etcdsync.WithTTL(3*time.Second))
	p.SetLatency(1500 * time.Millisecond)
	told, got, lastAck := cutHolder(t, ctx, s, p, admin, "viaproxy")
	t.Logf("told %v after the last acknowledged keepalive's send; the contender got the lock %v after the holder was told, %v after that send (TTL %v, slack %v)",
		told.Sub(lastAck), got.Sub(told), got.Sub(lastAck), s.TTL(), s.Slack())
	require.GreaterOrEqual(t, got.Sub(told), s.Slack()-200*time.Millisecond)
	require.Less(t, got.Sub(lastAck), 2*(s.TTL()+s.Slack())+1500*time.Millisecond, "failover through the proxy took longer than the docs say")
}
