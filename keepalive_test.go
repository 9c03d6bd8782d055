package etcdsync_test

// Keepalive: a lease adopted late is kept, a stream that cannot open costs
// no CPU, a slow link is not a lost one.

import (
	"fmt"
	"net/url"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A process that adopts its lease with less than a third of the TTL left
// keeps it, and the holds it resumes: the first keepalive goes out at once.
func TestLateAdoptionKeepsLease(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(3*time.Second))
	require.NoError(t, err)
	m1 := etcdsync.NewMutex(s1, "late-adopt")
	require.NoError(t, m1.Lock(ctx))
	rev := m1.Rev()
	s1.Orphan()
	for { // the restart is slow: wait until at most a second is left
		ttl, err := cli.TimeToLive(ctx, s1.Lease())
		require.NoError(t, err)
		require.Greater(t, ttl.TTL, int64(0), "the lease expired before the restart")
		if ttl.TTL <= 1 {
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
	t.Parallel() // slow and independent (own etcd): see TestFaults
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		u, err := url.Parse(c.Members()[0].Endpoint())
		require.NoError(t, err)
		p := etcdtest.NewProxy(t, u.Host)
		s := session(t, etcdtest.NewClient(t, []string{p.Endpoint()}), etcdsync.WithTTL(2*time.Second))
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
		var deleted time.Time
		for deleted.IsZero() {
			wr, ok := <-wch
			require.True(t, ok, "admin watch ended")
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete {
					deleted = time.Now()
				}
			}
		}
		select {
		case <-held:
		default:
			t.Fatal("the server deleted the key before the hold's Done closed")
		}
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
	for _, tc := range []struct {
		name  string
		fault func(p *etcdtest.Proxy)
	}{
		{"open-fails", func(p *etcdtest.Proxy) { p.Close() }},
		{"open-blocks", func(p *etcdtest.Proxy) { p.Blackhole(true); p.DropConnections() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := single(t)
			u, err := url.Parse(c.Members()[0].Endpoint())
			require.NoError(t, err)
			p := etcdtest.NewProxy(t, u.Host)
			cnt := counter{}
			s := session(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...), etcdsync.WithTTL(6*time.Second))
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
