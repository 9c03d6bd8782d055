package etcdsync_test

// Tests for the Session and Election cracks of issue 9: late adoption,
// Orphan then Close, ResumeElection on the leading session, Observe that
// delivers every value, observers without a lease, a closed client, and
// error texts.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A process that adopts its lease with less than a third of the TTL left
// keeps it, and the holds it resumes: the first keepalive goes out at once.
func TestAdoptLateKeepsLease(t *testing.T) {
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

// Close after Orphan changes nothing in etcd: the lease and its keys stay
// for the process that adopts them.
func TestOrphanThenCloseKeepsLease(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m := etcdsync.NewMutex(s, "orphan-close")
	require.NoError(t, m.Lock(ctx))
	s.Orphan()
	require.NoError(t, s.Close())
	ttl, err := cli.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.Greater(t, ttl.TTL, int64(0), "Close after Orphan revoked the lease")
	require.Len(t, keys(t, cli, "orphan-close/"), 1)
	_, err = cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
}

// ResumeElection with the key and revision the session leads with shares
// the leadership: Proclaim, Do and Resign through either handle act on the
// same term; after a Resign either may Campaign again. A wrong revision or
// another session's key does not lead.
func TestResumeElectionSharesLeadership(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
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

// An observer started before any candidate gets every leader and every
// value, in order (as etcdctl elect -l does).
func TestObserveEveryValue(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		cnt := counter{created: make(chan struct{}, 100)}
		o := etcdsync.NewObserver(c.Client(t, cnt.dial()...), "every")
		octx, cancel := context.WithCancel(ctx)
		defer cancel()
		ch := o.Observe(octx)
		within(t, cnt.created, testTimeout, "the observer's watch created")

		cli := c.Client(t)
		alpha := etcdsync.NewElection(session(t, cli), "every")
		beta := etcdsync.NewElection(session(t, cli), "every")
		require.NoError(t, alpha.Campaign(ctx, "alpha is leading"))
		betaLeads := campaignAsync(ctx, beta, "beta is leading")
		for i := 1; i <= 3; i++ {
			require.NoError(t, alpha.Proclaim(ctx, fmt.Sprintf("alpha: report %d", i)))
		}
		require.NoError(t, alpha.Resign(ctx))
		require.NoError(t, <-betaLeads)
		require.NoError(t, beta.Proclaim(ctx, "beta: report 1"))
		want := []string{"alpha is leading", "alpha: report 1", "alpha: report 2", "alpha: report 3", "beta is leading", "beta: report 1"}
		var got []string
		var last int64
		for len(got) < len(want) {
			select {
			case resp, ok := <-ch:
				require.True(t, ok, "Observe's channel closed (%v) after %q", o.Err(), got)
				got = append(got, string(resp.Kvs[0].Value))
				require.Greater(t, resp.Header.Revision, last, "revision order")
				last = resp.Header.Revision
			case <-time.After(testTimeout):
				t.Fatalf("got %q, want %q", got, want)
			}
		}
		require.Equal(t, want, got)
		require.NoError(t, beta.Resign(ctx))
		require.NoError(t, o.Err())
	})
}

// Observers need no session; a bad name or client closes the channel at
// once and Err says why; so does a client that closes.
func TestObserverErrors(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	for _, tc := range []struct {
		o    *etcdsync.Observer
		want error
	}{
		{etcdsync.NewObserver(c.Client(t), ""), etcdsync.ErrInvalidName},
		{etcdsync.NewObserver(c.Client(t), "a\x00b"), etcdsync.ErrInvalidName},
		{etcdsync.NewObserver(nil, "x"), etcdsync.ErrInvalidArgument},
	} {
		_, ok := <-tc.o.Observe(ctx)
		require.False(t, ok, "Observe's channel closes at once")
		require.ErrorIs(t, tc.o.Err(), tc.want)
		_, err := tc.o.Leader(ctx)
		require.ErrorIs(t, err, tc.want)
	}

	cli := etcdtest.NewClient(t, c.Endpoints())
	o := etcdsync.NewObserver(cli, "closing")
	_, err := o.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrElectionNoLeader)
	ch := o.Observe(ctx)
	require.NoError(t, cli.Close())
	select {
	case _, ok := <-ch:
		require.False(t, ok)
	case <-time.After(testTimeout):
		t.Fatal("Observe's channel did not close after the client closed")
	}
	require.ErrorContains(t, o.Err(), "client closed")
}

// After the client closes, the session and its holds end with a cause that
// says so, and Close returns at once.
func TestClosedClient(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli := etcdtest.NewClient(t, c.Endpoints())
	s, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	m := etcdsync.NewMutex(s, "closed-client")
	require.NoError(t, m.Lock(ctx))
	done := m.Done()
	require.NoError(t, cli.Close())
	within(t, s.Done(), testTimeout, "session end after the client closed")
	within(t, done, testTimeout, "hold end after the client closed")
	require.ErrorIs(t, s.Err(), etcdsync.ErrSessionClosed)
	require.ErrorContains(t, s.Err(), "client closed")
	require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)
	start := time.Now()
	require.ErrorContains(t, s.Close(), "client closed")
	require.Less(t, time.Since(start), 500*time.Millisecond, "Close with a closed client")
	require.ErrorIs(t, m.Lock(ctx), etcdsync.ErrSessionExpired)
}

// NewSession against an endpoint nobody listens on names the endpoint and
// the dial error.
func TestNewSessionNamesUnreachableEndpoint(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	addr := ln.Addr().String()
	require.NoError(t, ln.Close()) // nobody listens there now
	cli := etcdtest.NewClient(t, []string{"http://" + addr})
	_, err = etcdsync.NewSession(cli, etcdsync.WithTTL(time.Second))
	require.Error(t, err)
	require.ErrorContains(t, err, addr)
	require.ErrorContains(t, err, "connection refused")
}

// Error texts say what failed, on which name, and why, each once.
func TestErrorTexts(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "texts")
	require.NoError(t, m.Lock(ctx))
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	closed, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	require.NoError(t, closed.Close())
	_, missing := etcdsync.NewSession(cli, etcdsync.WithLease(12345))

	own := m.TryLock(ctx)
	other := etcdsync.NewMutex(session(t, cli), "texts").TryLock(ctx)
	for _, tc := range []struct {
		err      error
		is       error
		contains []string
	}{
		{own, etcdsync.ErrLocked, []string{"held, or waited for, by this session"}},
		{other, etcdsync.ErrLocked, []string{m.Key(), fmt.Sprintf("create revision %d", m.Rev())}},
		{etcdsync.NewMutex(s, "texts2").Lock(cancelled), context.Canceled, []string{"acquire texts2:"}},
		{etcdsync.NewMutex(closed, "texts").Lock(ctx), etcdsync.ErrSessionExpired, []string{"session closed"}},
		{missing, etcdsync.ErrSessionExpired, []string{"lease 0x3039", "not found"}},
	} {
		require.ErrorIs(t, tc.err, tc.is)
		for _, want := range tc.contains {
			require.ErrorContains(t, tc.err, want)
		}
		require.Equal(t, 1, strings.Count(tc.err.Error(), "etcdsync:"), "prefix repeated: %v", tc.err)
		require.NotContains(t, tc.err.Error(), "texts/:", "a name shown with its slash")
		require.False(t, errors.Is(tc.err, etcdsync.ErrLocked) && strings.Contains(tc.err.Error(), "another holder") && tc.err == own)
	}
	require.NoError(t, m.Unlock(ctx))
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
