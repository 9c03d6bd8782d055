package tests

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3election/v3electionpb"
)

// campaignAsync campaigns in a goroutine; the channel gets Campaign's result.
func campaignAsync(ctx context.Context, e *etcdsync.Election, val string) <-chan error {
	errc := async(func() error { return e.Campaign(ctx, val) })
	return errc
}

// leaderValue returns the current leader's value, or "" with no leader.
func leaderValue(t *testing.T, e *etcdsync.Election) string {
	t.Helper()
	resp, err := e.Leader(ctxT(t))
	if err != nil {
		require.ErrorIs(t, err, etcdsync.ErrElectionNoLeader)
		return ""
	}
	return string(resp.Kvs[0].Value)
}

// Campaign blocks until this candidate's key is the oldest direct child;
// Leader reports the leader; Rev increases from term to term; Done closes on
// Resign.
func TestCampaignAndLeader(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		cli := c.Client(t)
		ctx := ctxT(t)
		a := etcdsync.NewElection(session(t, cli), "elect")
		b := etcdsync.NewElection(session(t, cli), "elect")
		require.Equal(t, "", leaderValue(t, a))
		require.NoError(t, a.Campaign(ctx, "a"))
		require.Equal(t, "a", leaderValue(t, b))
		done := a.Done()

		errc := campaignAsync(ctx, b, "b")
		waitKeys(t, cli, "elect/", 2)
		notYet(t, errc, 300*time.Millisecond, "second candidate while the first leads")
		term := a.Rev()
		require.NoError(t, a.Resign(ctx))
		within(t, done, 5*time.Second, "Done after Resign")
		require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
		require.NoError(t, <-errc)
		require.Greater(t, b.Rev(), term)
		require.Equal(t, "b", leaderValue(t, a))
		require.NoError(t, a.Resign(ctx), "Resign when not leading is nil")
		require.NoError(t, b.Resign(ctx))
		require.Empty(t, keys(t, cli, "elect/"))
	})
}

// A cancelled or failed Campaign leaves no candidate key (etcd-io/etcd#21128);
// a candidate whose key vanishes returns ErrSessionExpired at once (#19597).
func TestCampaignCancelAndOwnLoss(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		cli := c.Client(t)
		ctx := ctxT(t)
		leader := etcdsync.NewElection(session(t, cli), "cancel")
		require.NoError(t, leader.Campaign(ctx, "l"))

		s := session(t, cli)
		e := etcdsync.NewElection(s, "cancel")
		cctx, cancel := context.WithCancel(ctx)
		errc := campaignAsync(cctx, e, "c")
		waitKeys(t, cli, "cancel/", 2)
		cancel()
		require.ErrorIs(t, <-errc, context.Canceled)
		require.Equal(t, []string{leader.Key()}, keys(t, cli, "cancel/"))

		// The cancel races the create.
		cancelsLeaveOnly(t, ctx, cli, "cancel/", leader.Key(), 40, 10, func(rctx context.Context, _ int) error { return e.Campaign(rctx, "c") })

		errc = campaignAsync(ctx, e, "c")
		waitKeys(t, cli, "cancel/", 2)
		_, err := cli.Delete(ctx, fmt.Sprintf("cancel/%x", int64(s.Lease())))
		require.NoError(t, err)
		require.ErrorIs(t, resultWithin(t, errc, time.Second, "candidate noticing its own loss"), etcdsync.ErrSessionExpired)
		require.NoError(t, leader.Resign(ctx))
	})
}

// Proclaim changes the value only while leading; a second Campaign on the
// leading value proclaims and returns at once.
func TestProclaim(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	e := etcdsync.NewElection(session(t, cli), "proclaim")
	require.ErrorIs(t, e.Proclaim(ctx, "x"), etcdsync.ErrElectionNotLeader)

	require.NoError(t, e.Campaign(ctx, "v1"))
	term := e.Rev()
	require.NoError(t, e.Proclaim(ctx, "v2"))
	require.Equal(t, "v2", leaderValue(t, e))
	require.Greater(t, e.Header().Revision, term)
	require.NoError(t, e.Campaign(ctx, "v3"))
	require.Equal(t, "v3", leaderValue(t, e))
	require.Equal(t, term, e.Rev(), "same term")

	_, err := cli.Delete(ctx, e.Key()) // leadership lost behind the value's back
	require.NoError(t, err)
	before, err := cli.Get(ctx, "x")
	require.NoError(t, err)
	require.ErrorIs(t, e.Proclaim(ctx, "v4"), etcdsync.ErrElectionNotLeader)
	after, err := cli.Get(ctx, "x")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "a failed Proclaim wrote")
	require.Equal(t, "", e.Key(), "state reset")
	require.Empty(t, keys(t, cli, "proclaim/"))
}

// Resign deletes only the key at the held revision; a failed Resign keeps the
// leadership and can be retried (etcd-io/etcd#22123).
func TestResignFencedAndRetryable(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "resign")
	require.NoError(t, e.Campaign(ctx, "v"))

	dead, cancel := context.WithCancel(ctx)
	cancel()
	require.Error(t, e.Resign(dead))
	require.NotEqual(t, "", e.Key(), "a failed Resign keeps the leadership")
	require.NoError(t, e.Resign(ctx))
	require.Empty(t, keys(t, cli, "resign/"))

	// A stale term's Resign never deletes a newer term on the same key.
	require.NoError(t, e.Campaign(ctx, "v"))
	_, err := cli.Delete(ctx, e.Key())
	require.NoError(t, err)
	newer := etcdsync.NewElection(session(t, cli, etcdsync.WithLease(s.Lease())), "resign")
	require.NoError(t, newer.Campaign(ctx, "w"))
	require.Equal(t, e.Key(), newer.Key())
	require.NoError(t, e.Resign(ctx))
	require.Equal(t, "w", leaderValue(t, newer))
	require.NoError(t, newer.Resign(ctx))
}

// Two Election values on one Session exclude each other.
func TestSameSessionElectionsExclude(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	s := session(t, c.Client(t))
	ctx := ctxT(t)
	a, b := etcdsync.NewElection(s, "same-e"), etcdsync.NewElection(s, "same-e")
	require.NoError(t, a.Campaign(ctx, "a"))
	errc := campaignAsync(ctx, b, "b")
	notYet(t, errc, 300*time.Millisecond, "second Election on the same session while the first leads")
	require.NoError(t, a.Resign(ctx))
	require.NoError(t, <-errc)
	require.Equal(t, "b", leaderValue(t, a))
	require.NoError(t, b.Resign(ctx))
}

// observed collects what Observe delivers until stop is called.
type observed struct {
	mu   sync.Mutex
	got  []*clientv3.GetResponse
	more chan struct{} // one send per delivery
	done chan struct{}
}

func observe(t *testing.T, e *etcdsync.Election) (*observed, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	o := &observed{more: make(chan struct{}, 1000), done: make(chan struct{})}
	ch := e.Observe(ctx)
	go func() {
		defer close(o.done)
		for resp := range ch {
			o.mu.Lock()
			o.got = append(o.got, resp)
			o.mu.Unlock()
			o.more <- struct{}{}
		}
	}()
	stop := func() {
		cancel()
		within(t, o.done, testTimeout, "Observe's channel closes when ctx ends")
	}
	t.Cleanup(stop)
	return o, stop
}

// next waits for the next delivery and returns its value.
func (o *observed) next(t *testing.T) string {
	t.Helper()
	select {
	case <-o.more:
	case <-time.After(testTimeout):
		t.Fatal("Observe delivered nothing")
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	return string(o.got[len(o.got)-1].Kvs[0].Value)
}

// Observe delivers leaders and proclamations in revision order, never a
// candidate that is not the leader (etcd-io/etcd#18163), never a nested or
// outside key (#10297), across compaction and a leader's session expiry; a
// key outside the election ("obsx/1") never blocks a Campaign (#6278).
func TestObserve(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		cli := c.Client(t)
		ctx := ctxT(t)
		watcher := etcdsync.NewElection(session(t, cli), "obs")
		o, stop := observe(t, watcher)

		// Keys that are not candidates of "obs".
		_, err := cli.Put(ctx, "obs/x/1", "nested")
		require.NoError(t, err)
		_, err = cli.Put(ctx, "obsx/1", "outside")
		require.NoError(t, err)

		as := session(t, cli, etcdsync.WithTTL(2*time.Second))
		a := etcdsync.NewElection(as, "obs")
		require.NoError(t, a.Campaign(ctx, "a1"))
		require.Equal(t, "a1", o.next(t))
		require.NoError(t, a.Proclaim(ctx, "a2"))
		require.Equal(t, "a2", o.next(t))

		// A waiting candidate is never reported.
		b := etcdsync.NewElection(session(t, cli), "obs")
		errc := campaignAsync(ctx, b, "b1")
		waitKeys(t, cli, "obs/", 3) // nested key, a, b

		// Compaction: the observer re-reads and still tells the truth.
		resp, err := cli.Put(ctx, "obs-filler", "x")
		require.NoError(t, err)
		_, err = cli.Compact(ctx, resp.Header.Revision)
		require.NoError(t, err)
		require.NoError(t, a.Proclaim(ctx, "a3"))
		require.Equal(t, "a3", o.next(t))

		// The leader's session expires (orphaned, never resigned): b leads.
		as.Orphan()
		require.NoError(t, <-errc)
		require.Equal(t, "b1", o.next(t))
		require.NoError(t, b.Resign(ctx))
		stop()

		o.mu.Lock()
		defer o.mu.Unlock()
		var last int64
		for _, r := range o.got {
			k := string(r.Kvs[0].Key)
			require.Regexp(t, `^obs/[0-9a-f]+$`, k)
			require.Greater(t, r.Header.Revision, last, "revision order")
			last = r.Header.Revision
		}
		require.Equal(t, []string{"a1", "a2", "a3", "b1"}, values(o.got))
	})
}

func values(rs []*clientv3.GetResponse) []string {
	var out []string
	for _, r := range rs {
		out = append(out, string(r.Kvs[0].Value))
	}
	return out
}

// Observe on an invalid name closes at once.
func TestElectionBadInput(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	for _, name := range []string{"", "a\x00b"} {
		e := etcdsync.NewElection(s, name)
		require.ErrorIs(t, e.Campaign(ctx, "v"), etcdsync.ErrInvalidName)
		require.ErrorIs(t, e.Proclaim(ctx, "v"), etcdsync.ErrInvalidName)
		require.ErrorIs(t, e.Resign(ctx), etcdsync.ErrInvalidName)
		_, err := e.Leader(ctx)
		require.ErrorIs(t, err, etcdsync.ErrInvalidName)
		obs := e.Observe(ctx)
		closedAt := make(chan struct{})
		go func() {
			defer close(closedAt)
			for range obs {
				t.Error("Observe delivered on an invalid name")
			}
		}()
		within(t, closedAt, 5*time.Second, "Observe's channel closes at once on an invalid name")
		r := etcdsync.ResumeElection(s, name, "k", 1)
		require.ErrorIs(t, r.Campaign(ctx, "v"), etcdsync.ErrInvalidName)
	}
	require.ErrorIs(t, etcdsync.NewElection(nil, "x").Campaign(ctx, "v"), etcdsync.ErrInvalidArgument)
	resp, err := cli.Get(ctx, "", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)
}

// ResumeElection names keys as NewElection does and resumes the term.
func TestResumeElection(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	e := etcdsync.NewElection(s1, "resume")
	require.NoError(t, e.Campaign(ctx, "v"))
	key, rev := e.Key(), e.Rev()
	s1.Orphan()

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	r := etcdsync.ResumeElection(s2, "resume", key, rev)
	require.Equal(t, key, r.Key())
	require.Equal(t, rev, r.Rev())
	require.NoError(t, r.Proclaim(ctx, "w"))
	require.Equal(t, "w", leaderValue(t, r))
	require.NoError(t, r.Resign(ctx))
	require.Empty(t, keys(t, cli, "resume/"))

	bad := etcdsync.ResumeElection(s2, "resume", "resume/other", 5)
	require.Equal(t, "", bad.Key())
	require.ErrorIs(t, bad.Err(), etcdsync.ErrInvalidArgument)
}

// IsLeader and Do guard writes; both fail once leadership is gone.
func TestElectionGuards(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "guard-e")
	_, err := e.Do(ctx, clientv3.OpPut("g", "x"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.NoError(t, e.Campaign(ctx, "v"))
	resp, err := cli.Txn(ctx).If(e.IsLeader()).Then(clientv3.OpPut("g", "1")).Commit()
	require.NoError(t, err)
	require.True(t, resp.Succeeded)
	_, err = e.Do(ctx, clientv3.OpPut("g", "2"))
	require.NoError(t, err)
	cmp := e.IsLeader()
	require.NoError(t, e.Resign(ctx))
	resp, err = cli.Txn(ctx).If(cmp).Then(clientv3.OpPut("g", "3")).Commit()
	require.NoError(t, err)
	require.False(t, resp.Succeeded, "a stale IsLeader must fail")
	_, err = e.Do(ctx, clientv3.OpPut("g", "4"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)

	// A guard checks the term, not just that the key exists: a new term on
	// the same key name (the lease adopted by another session) is not ours.
	require.NoError(t, e.Campaign(ctx, "v"))
	stale := e.IsLeader()
	_, err = cli.Delete(ctx, e.Key())
	require.NoError(t, err)
	newer := etcdsync.NewElection(session(t, cli, etcdsync.WithLease(s.Lease())), "guard-e")
	require.NoError(t, newer.Campaign(ctx, "w"))
	resp, err = cli.Txn(ctx).If(stale).Then(clientv3.OpPut("g", "5")).Commit()
	require.NoError(t, err)
	require.False(t, resp.Succeeded, "the old term's IsLeader passed on the new term")
	_, err = e.Do(ctx, clientv3.OpPut("g", "6"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.NoError(t, newer.Resign(ctx))
}

// Interop: etcd's concurrency.Election sees our leader and we see theirs.
func TestElectionInterop(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	es := theirSession(t, cli, concurrency.WithTTL(30))
	theirs := concurrency.NewElection(es, "interop-e")
	ours := etcdsync.NewElection(session(t, cli), "interop-e")

	require.NoError(t, ours.Campaign(ctx, "ours"))
	resp, err := theirs.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "ours", string(resp.Kvs[0].Value))

	errc := async(func() error { return theirs.Campaign(ctx, "theirs") })
	waitKeys(t, cli, "interop-e/", 2)
	require.NoError(t, ours.Resign(ctx))
	require.NoError(t, <-errc)
	require.Equal(t, "theirs", leaderValue(t, ours))
	require.NoError(t, theirs.Resign(ctx))
}

// Failover on 3 members: a leader that dies without resigning is replaced
// within TTL + slack + 1s; after a Resign, within a round trip.
func TestFailover(t *testing.T) {
	t.Parallel()
	c := kitThree(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const ttl = 2 * time.Second
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(ttl))
	require.NoError(t, err)
	defer s1.Close()
	first := etcdsync.NewElection(s1, "failover")
	require.NoError(t, first.Campaign(ctx, "1"))
	next := etcdsync.NewElection(session(t, cli, etcdsync.WithTTL(ttl)), "failover")
	errc := campaignAsync(ctx, next, "2")
	waitKeys(t, cli, "failover/", 2)

	start := time.Now()
	s1.Orphan() // the process dies
	require.NoError(t, resultWithin(t, errc, ttl+s1.Slack()+time.Second, "failover within TTL + slack + 1s"))
	t.Logf("failover after a crash: %v (TTL %v, slack %v)", time.Since(start), ttl, s1.Slack())

	third := etcdsync.NewElection(session(t, cli), "failover")
	errc = campaignAsync(ctx, third, "3")
	waitKeys(t, cli, "failover/", 2)
	start = time.Now()
	require.NoError(t, next.Resign(ctx))
	require.NoError(t, resultWithin(t, errc, time.Second, "failover within 1s of a Resign"))
	t.Logf("failover after a Resign: %v", time.Since(start))
	require.NoError(t, third.Resign(ctx))
}

// Uncontended Campaign costs one RPC.
func TestCampaignCost(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	var cnt counter
	cli := kitClient(t, c, cnt.dial()...)
	ctx := ctxT(t)
	e := etcdsync.NewElection(session(t, cli), "cost-e")
	cnt.take()
	require.NoError(t, e.Campaign(ctx, "v"))
	n, methods := cnt.take()
	require.Equal(t, int64(1), n, "Campaign RPCs: %v", methods)
	require.NoError(t, e.Resign(ctx))
	n, methods = cnt.take()
	require.Equal(t, int64(1), n, "Resign RPCs: %v", methods)
}

// Interop: the server's election API sees our leader, and we see its leader.
func TestElectionInteropServerAPI(t *testing.T) {
	t.Parallel()
	c, cli, ctx := kitSingleClient(t)
	srv := v3electionpb.NewElectionClient(etcdtest.Conn(t, c.Endpoints()[0]))
	ours := etcdsync.NewElection(session(t, cli), "srv-elect")
	require.NoError(t, ours.Campaign(ctx, "ours"))
	resp, err := srv.Leader(ctx, &v3electionpb.LeaderRequest{Name: []byte("srv-elect")})
	require.NoError(t, err)
	require.Equal(t, "ours", string(resp.Kv.Value))
	require.Equal(t, ours.Key(), string(resp.Kv.Key))
	require.NoError(t, ours.Resign(ctx))

	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	// The server's API keeps this lease alive in-process; end it.
	t.Cleanup(func() { cli.Revoke(context.Background(), lease.ID) })
	camp, err := srv.Campaign(ctx, &v3electionpb.CampaignRequest{Name: []byte("srv-elect"), Lease: int64(lease.ID), Value: []byte("theirs")})
	require.NoError(t, err)
	require.Equal(t, "theirs", leaderValue(t, ours))
	_, err = srv.Resign(ctx, &v3electionpb.ResignRequest{Leader: camp.Leader})
	require.NoError(t, err)
	require.Equal(t, "", leaderValue(t, ours))
}

// A second Campaign after the leadership was lost behind the value's back
// campaigns anew instead of failing.
func TestCampaignAfterSilentLoss(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	e := etcdsync.NewElection(session(t, cli), "silent")
	require.NoError(t, e.Campaign(ctx, "v1"))
	term := e.Rev()
	_, err := cli.Delete(ctx, e.Key())
	require.NoError(t, err)
	require.NoError(t, e.Campaign(ctx, "v2"))
	require.Greater(t, e.Rev(), term)
	require.Equal(t, "v2", leaderValue(t, e))
	require.NoError(t, e.Resign(ctx))
}

// Campaigns on one value run one at a time: a second one started while the
// first waits proclaims its value once the first leads (etcd-io/etcd#7547:
// concurrent Campaigns on one etcd Election race on its fields).
func TestConcurrentCampaignsOnOneValue(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	other := etcdsync.NewElection(session(t, cli), "conc")
	require.NoError(t, other.Campaign(ctx, "other"))
	e := etcdsync.NewElection(session(t, cli), "conc")
	first := campaignAsync(ctx, e, "first")
	waitKeys(t, cli, "conc/", 2)
	second := campaignAsync(ctx, e, "second")
	require.NoError(t, other.Resign(ctx))
	require.NoError(t, <-first)
	require.NoError(t, <-second)
	require.Equal(t, "second", leaderValue(t, e))
	require.Len(t, keys(t, cli, "conc/"), 1)
	require.NoError(t, e.Resign(ctx))
}

// Election.Done closes, with the cause in Err, when the term ends by a
// deleted key or a revoked lease (invariant "Loss signal").
func TestElectionDoneOnLoss(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	for _, how := range []string{"delete", "revoke"} {
		s := session(t, cli)
		e := etcdsync.NewElection(s, "eloss-"+how)
		require.NoError(t, e.Campaign(ctx, "v"))
		done := e.Done()
		notWithin(t, done, 50*time.Millisecond, "Done while leading")
		if how == "delete" {
			_, err := cli.Delete(ctx, e.Key())
			require.NoError(t, err)
		} else {
			_, err := cli.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		}
		within(t, done, 5*time.Second, "Done after "+how)
		require.ErrorIs(t, e.Err(), etcdsync.ErrNotHeld)
		require.Equal(t, "", e.Key())
		require.ErrorIs(t, e.Proclaim(ctx, "x"), etcdsync.ErrElectionNotLeader)
	}
}

// Observe re-reads after a compaction of the revisions it would watch from,
// and Observe outlives the observer's session.
func TestObserveAcrossCompactionAndSessionEnd(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	octx, cancel := context.WithCancel(ctx)
	obs := etcdsync.NewElection(s, "ocompact").Observe(octx)
	closed := make(chan struct{})
	t.Cleanup(func() {
		cancel()
		for range obs {
		}
		<-closed
	})
	go func() { <-octx.Done(); close(closed) }()
	require.NoError(t, s.Close()) // the observer needs no lease

	a := etcdsync.NewElection(session(t, cli), "ocompact")
	require.NoError(t, a.Campaign(ctx, "a1"))
	got := <-obs
	require.Equal(t, "a1", string(got.Kvs[0].Value))

	// While nobody reads, the leader changes (Observe blocks sending the new
	// leader), a proclamation follows and the store is compacted past both.
	b := etcdsync.NewElection(session(t, cli), "ocompact")
	errc := campaignAsync(ctx, b, "b1")
	waitKeys(t, cli, "ocompact/", 2)
	require.NoError(t, a.Resign(ctx))
	require.NoError(t, <-errc)
	require.NoError(t, b.Proclaim(ctx, "b2"))
	resp, err := cli.Put(ctx, "ocompact-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)

	var values []string
	for len(values) == 0 || values[len(values)-1] != "b2" {
		select {
		case r := <-obs:
			require.LessOrEqual(t, r.Kvs[0].ModRevision, r.Header.Revision)
			values = append(values, string(r.Kvs[0].Value))
		case <-time.After(testTimeout):
			t.Fatalf("Observe did not deliver the latest value; got %v", values)
		}
	}
	require.NotContains(t, values, "a1", "a resigned leader reported again")
	require.NoError(t, b.Resign(ctx))
}

// A candidate whose lease ends while it waits never leads: it returns
// ErrSessionExpired at once, and nobody leads once the leader ahead of it
// resigns right after (etcd-io/etcd#11456: a lock was reported held without
// a check that the waiter's lease still lived; #19597: the waiter learned
// of its own loss only when the keys ahead went). etcd's Election.Campaign
// makes no such check (its Mutex.Lock does, since #11456): in the same
// sequence it waits on after its key went, then returns nil, leading with no
// key behind it.
func TestCandidateWhoseLeaseEndedNeverLeads(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "lease-ended"
	leader := etcdsync.NewElection(session(t, cli), name)
	require.NoError(t, leader.Campaign(ctx, "l"))
	cs := session(t, cli)
	cand := etcdsync.NewElection(cs, name)
	got := async(func() error { return cand.Campaign(ctx, "c") })
	waitKeys(t, cli, name+"/", 2)
	_, err := cli.Revoke(ctx, cs.Lease()) // the candidate's lease ends (expired, or revoked)
	require.NoError(t, err)
	require.NoError(t, leader.Resign(ctx)) // and the leader goes right after
	require.ErrorIs(t, resultWithin(t, got, testTimeout, "the candidate whose lease ended"), etcdsync.ErrSessionExpired)
	require.Equal(t, "", cand.Key())
	_, err = leader.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrElectionNoLeader)

	// etcd's Election in the same sequence.
	const theirs = "lease-ended-etcd"
	ls := theirSession(t, cli)
	eleader := concurrency.NewElection(ls, theirs)
	require.NoError(t, eleader.Campaign(ctx, "l"))
	es := theirSession(t, cli)
	ecand := concurrency.NewElection(es, theirs)
	egot := async(func() error { return ecand.Campaign(ctx, "c") })
	waitKeys(t, cli, theirs+"/", 2)
	_, err = cli.Revoke(ctx, es.Lease())
	require.NoError(t, err)
	waitCount(t, cli, theirs+"/", testTimeout, func(n int) bool { return n == 1 })
	notYet(t, egot, 300*time.Millisecond, "etcd's candidate whose key went (#19597: it waits for the leader)")
	require.NoError(t, eleader.Resign(ctx))
	require.NoError(t, resultWithin(t, egot, testTimeout, "etcd's candidate"), "etcd's Campaign returns nil: it 'leads'")
	require.NotEqual(t, "", ecand.Key(), "etcd's candidate believes it leads")
	resp, err := cli.Get(ctx, ecand.Key())
	require.NoError(t, err)
	require.Empty(t, resp.Kvs, "etcd's 'leader' has no key (#11456)")
	_, err = eleader.Leader(ctx)
	require.ErrorIs(t, err, concurrency.ErrElectionNoLeader, "etcd itself reports no leader")
}

// A candidate keeps its place when its watch stream breaks and the
// revisions it watched from have been compacted meanwhile: it re-reads,
// waits on and leads once the leader resigns, and no candidate key is left
// once it resigns (etcd-io/etcd#21128: etcd's Campaign fails there with
// ErrCompacted and leaves its key, which then heads the queue and leads for
// as long as its session lives, although its Campaign failed).
func TestCandidateKeepsPlaceAcrossCompaction(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	// compactBreak compacts past every revision so far, then breaks every
	// stream of the candidates' clients (the proxy drops its connections, as
	// a member restart does).
	compactBreak := func(p *etcdtest.Proxy) {
		t.Helper()
		resp, err := admin.Put(ctx, "compaction-filler", "x")
		require.NoError(t, err)
		_, err = admin.Compact(ctx, resp.Header.Revision)
		require.NoError(t, err)
		p.DropConnections()
	}

	const name = "compact-campaign"
	leader := etcdsync.NewElection(session(t, admin), name)
	require.NoError(t, leader.Campaign(ctx, "l"))
	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 16)}
	cand := etcdsync.NewElection(session(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...)), name)
	got := async(func() error { return cand.Campaign(ctx, "c") })
	within(t, cnt.created, testTimeout, "the candidate's watch (of the prefix: the leader is all it waits for)")
	waitKeys(t, admin, name+"/", 2)
	compactBreak(p)
	within(t, cnt.created, testTimeout, "the candidate's watch, again after the break")
	require.NoError(t, leader.Resign(ctx))
	require.NoError(t, resultWithin(t, got, testTimeout, "the candidate after the compaction"))
	resp, err := leader.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "c", string(resp.Kvs[0].Value))
	require.NoError(t, cand.Resign(ctx))
	require.Empty(t, keys(t, admin, name+"/"))

	// etcd's Election in the same sequence.
	const theirs = "compact-campaign-etcd"
	ls := theirSession(t, admin)
	eleader := concurrency.NewElection(ls, theirs)
	require.NoError(t, eleader.Campaign(ctx, "l"))
	ep := faults.Proxy(t, c)
	ecnt := counter{created: make(chan struct{}, 16)}
	es := theirSession(t, etcdtest.NewClient(t, []string{ep.Endpoint()}, ecnt.dial()...))
	ecand := concurrency.NewElection(es, theirs)
	egot := async(func() error { return ecand.Campaign(ctx, "c") })
	within(t, ecnt.created, testTimeout, "etcd's candidate's watch (from the revision of its read)")
	compactBreak(ep)
	require.ErrorIs(t, resultWithin(t, egot, testTimeout, "etcd's candidate after the compaction"), rpctypes.ErrCompacted)
	require.NoError(t, eleader.Resign(ctx))
	lead, err := eleader.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("%s/%x", theirs, int64(es.Lease())), string(lead.Kvs[0].Key),
		"the key of etcd's failed Campaign is left, and leads")
}

// A resumed election (ResumeElection, as after a process restart) knows
// only its own name's candidates, NAME/<hex>: its Leader, Observe and a
// later Campaign never take an older key that merely starts with the name
// ("NAMEx") or is nested under it (etcd-io/etcd#10297: etcd's ResumeElection
// drops the "/" of the prefix, so its Leader reports that older key as the
// leader; #6278 was the same mistake in etcd's Campaign, which then waited
// forever behind it).
func TestResumedElectionSeesOnlyItsCandidates(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "resumed-pfx"
	_, err := cli.Put(ctx, name+"x", "outside") // older than every candidate
	require.NoError(t, err)
	_, err = cli.Put(ctx, name+"/x/1", "nested")
	require.NoError(t, err)

	s1 := session(t, cli, etcdsync.WithTTL(30*time.Second))
	e := etcdsync.NewElection(s1, name)
	require.NoError(t, e.Campaign(ctx, "v1"))
	key, rev := e.Key(), e.Rev()
	s1.Orphan() // the process restarts
	r := etcdsync.ResumeElection(session(t, cli, etcdsync.WithLease(s1.Lease())), name, key, rev)
	resp, err := r.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, key, string(resp.Kvs[0].Key))
	octx, cancel := context.WithCancel(ctx)
	obs := r.Observe(octx)
	t.Cleanup(func() {
		cancel()
		for range obs {
		}
	})
	next := func() *clientv3.GetResponse {
		t.Helper()
		select {
		case resp, ok := <-obs:
			require.True(t, ok, "Observe's channel closed")
			return resp
		case <-time.After(testTimeout):
			t.Fatal("Observe delivered nothing")
			return nil
		}
	}
	got := next()
	require.Equal(t, key, string(got.Kvs[0].Key))
	require.Equal(t, "v1", string(got.Kvs[0].Value))
	require.NoError(t, r.Proclaim(ctx, "v2"))
	got = next()
	require.Equal(t, key, string(got.Kvs[0].Key))
	require.Equal(t, "v2", string(got.Kvs[0].Value))
	require.NoError(t, r.Resign(ctx))
	_, err = r.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrElectionNoLeader, "neither the outside nor the nested key leads")
	cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
	defer ccancel()
	require.NoError(t, r.Campaign(cctx, "v3"), "a Campaign behind keys that are not candidates")
	require.Regexp(t, `^resumed-pfx/[0-9a-f]+$`, r.Key())
	require.NoError(t, r.Resign(ctx))

	// etcd's ResumeElection with the same keys.
	const theirs = "resumed-pfx-etcd"
	_, err = cli.Put(ctx, theirs+"x", "outside")
	require.NoError(t, err)
	es := theirSession(t, cli)
	ee := concurrency.NewElection(es, theirs)
	require.NoError(t, ee.Campaign(ctx, "v1"))
	er := concurrency.ResumeElection(es, theirs, ee.Key(), ee.Rev())
	lead, err := er.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, theirs+"x", string(lead.Kvs[0].Key), "etcd's resumed election reports a key outside the election as the leader")
	require.NoError(t, er.Resign(ctx))
}
