package tests

// Observers: every leader and value in order; errors close the channel.

import (
	"context"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

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
func TestObserverErrorsCloseChannel(t *testing.T) {
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
	require.ErrorIs(t, o.Err(), etcdsync.ErrInvalidArgument)
	_, err = o.Leader(ctx)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument, "Leader on a closed client")
	_, ok := <-o.Observe(ctx)
	require.False(t, ok, "Observe on a closed client closes its channel at once")
	require.ErrorIs(t, o.Err(), etcdsync.ErrInvalidArgument)
}

// Terms reports "no leader" as its own state: at start with nobody
// campaigning, and each time a leader goes with no candidate behind it
// (resigned, or its lease gone), also after a compaction while nobody leads
// (etcd-io/etcd#7815). A leader followed by a queued candidate is never
// reported as a gap.
func TestTermsReportNoLeader(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	octx, cancel := context.WithCancel(ctx)
	terms := etcdsync.NewObserver(cli, "terms").Terms(octx)
	next := func() etcdsync.Term {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms' channel closed")
			return tm
		case <-time.After(testTimeout):
			t.Fatal("Terms delivered nothing")
		}
		return etcdsync.Term{}
	}
	var last int64
	want := func(value string) {
		t.Helper()
		tm := next()
		require.Greater(t, tm.Rev, last, "revision order")
		last = tm.Rev
		if value == "" {
			require.Nil(t, tm.Leader, "no leader")
			return
		}
		require.NotNil(t, tm.Leader, "a leader with %q", value)
		require.Equal(t, value, string(tm.Leader.Value))
	}
	want("") // nobody campaigns yet

	as := session(t, cli, etcdsync.WithTTL(2*time.Second))
	a := etcdsync.NewElection(as, "terms")
	require.NoError(t, a.Campaign(ctx, "a1"))
	want("a1")
	require.NoError(t, a.Proclaim(ctx, "a2"))
	want("a2")
	b := etcdsync.NewElection(session(t, cli), "terms")
	bLeads := campaignAsync(ctx, b, "b1")
	waitKeys(t, cli, "terms/", 2)
	as.Orphan() // a's lease expires with b behind it: no gap
	require.NoError(t, <-bLeads)
	want("b1")
	require.NoError(t, b.Resign(ctx))
	want("")

	// Compacted past the last delete while nobody leads.
	resp, err := cli.Put(ctx, "terms-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)
	cs := session(t, cli)
	cl := etcdsync.NewElection(cs, "terms")
	require.NoError(t, cl.Campaign(ctx, "c1"))
	want("c1")
	require.NoError(t, cs.Close())
	want("")

	cancel()
	for range terms { // closes when ctx ends
	}
	require.NoError(t, etcdsync.NewObserver(cli, "terms").Err())
}

// An observer started long after the leader campaigned and proclaimed, its
// revisions compacted since, gets the leader and its value at once, then
// each later value: Election.Observe, Observer.Observe and Observer.Terms
// alike (etcd-io/etcd#7815: etcd's Observe watched from the leader's
// ModRevision and, that revision compacted, closed its channel without
// reporting any leader).
func TestObserveLeaderOlderThanCompaction(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "obs-compacted"
	l := etcdsync.NewElection(session(t, cli), name)
	require.NoError(t, l.Campaign(ctx, "v1"))
	require.NoError(t, l.Proclaim(ctx, "v2"))
	resp, err := cli.Put(ctx, name+"-filler", "x")
	require.NoError(t, err)
	_, err = cli.Compact(ctx, resp.Header.Revision)
	require.NoError(t, err)

	octx, cancel := context.WithCancel(ctx)
	byElection := etcdsync.NewElection(session(t, cli), name).Observe(octx)
	byObserver := etcdsync.NewObserver(cli, name).Observe(octx)
	terms := etcdsync.NewObserver(cli, name).Terms(octx)
	t.Cleanup(func() {
		cancel()
		for range byElection {
		}
		for range byObserver {
		}
		for range terms {
		}
	})
	value := func(ch <-chan *clientv3.GetResponse, what string) string {
		t.Helper()
		select {
		case r, ok := <-ch:
			require.True(t, ok, "%s: channel closed", what)
			require.Equal(t, l.Key(), string(r.Kvs[0].Key), what)
			return string(r.Kvs[0].Value)
		case <-time.After(testTimeout):
			t.Fatalf("%s delivered nothing", what)
			return ""
		}
	}
	term := func() string {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms: channel closed")
			require.NotNil(t, tm.Leader, "Terms reports no leader while one leads")
			require.Equal(t, l.Key(), string(tm.Leader.Key))
			return string(tm.Leader.Value)
		case <-time.After(testTimeout):
			t.Fatal("Terms delivered nothing")
			return ""
		}
	}
	require.Equal(t, "v2", value(byElection, "Election.Observe"))
	require.Equal(t, "v2", value(byObserver, "Observer.Observe"))
	require.Equal(t, "v2", term())
	require.NoError(t, l.Proclaim(ctx, "v3"))
	require.Equal(t, "v3", value(byElection, "Election.Observe"))
	require.Equal(t, "v3", value(byObserver, "Observer.Observe"))
	require.Equal(t, "v3", term())
	require.NoError(t, l.Resign(ctx))
}

// leaderAt returns the key and value of the election's leader at rev: the
// direct child NAME/<hex> with the lowest create revision.
func leaderAt(t *testing.T, cli *clientv3.Client, name string, rev int64) (key, value string) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), name+"/", clientv3.WithPrefix(), clientv3.WithRev(rev),
		clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
	require.NoError(t, err)
	candidate := regexp.MustCompile(`^` + regexp.QuoteMeta(name) + `/[0-9a-f]+$`)
	for _, kv := range resp.Kvs {
		if candidate.Match(kv.Key) {
			return string(kv.Key), string(kv.Value)
		}
	}
	return "", ""
}

// Observe reports only leaders: each value it delivers is the leader's at
// the revision in its header, also when a stalled link hands it, at once,
// everything that happened while no leader was known (a nested key written,
// two candidates, a key outside the election, the first candidate resigned)
// (etcd-io/etcd#18163: etcd's Observe, waiting for a first leader, takes the
// first PUT under the prefix: here the nested key, which it reports as the
// leader).
func TestObserveAfterStallReportsOnlyLeaders(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "obs-stall"
	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 16)}
	ocli := etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...)
	es, err := concurrency.NewSession(ocli)
	require.NoError(t, err)
	t.Cleanup(func() { es.Close() })
	octx, cancel := context.WithCancel(ctx)
	ours := etcdsync.NewObserver(ocli, name).Observe(octx)
	theirs := concurrency.NewElection(es, name).Observe(octx)
	t.Cleanup(func() {
		cancel()
		for range ours {
		}
		for range theirs {
		}
	})
	awaitCreated(t, cnt.created, 2, testTimeout, "the observers' watches")

	p.Blackhole(true)
	_, err = admin.Put(ctx, name+"/x/1", "nested")
	require.NoError(t, err)
	a := etcdsync.NewElection(session(t, admin), name)
	require.NoError(t, a.Campaign(ctx, "a"))
	b := etcdsync.NewElection(session(t, admin), name)
	bLeads := async(func() error { return b.Campaign(ctx, "b") })
	waitKeys(t, admin, name+"/", 3)
	_, err = admin.Put(ctx, name+"x", "outside")
	require.NoError(t, err)
	require.NoError(t, a.Resign(ctx))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b's Campaign"))
	p.Blackhole(false)

	var last int64
	for v := ""; v != "b"; {
		select {
		case r, ok := <-ours:
			require.True(t, ok, "Observe's channel closed")
			rev := r.Header.Revision
			require.Greater(t, rev, last, "revision order")
			last = rev
			key, value := leaderAt(t, admin, name, rev)
			require.Equal(t, key, string(r.Kvs[0].Key), "reported as the leader at %d", rev)
			v = string(r.Kvs[0].Value)
			require.Equal(t, value, v, "the leader's value at %d", rev)
		case <-time.After(testTimeout):
			t.Fatal("Observe did not report b")
		}
	}

	select {
	case r, ok := <-theirs:
		require.True(t, ok, "etcd's Observe closed")
		require.Equal(t, name+"/x/1", string(r.Kvs[0].Key), "etcd's Observe reports the nested key as the leader")
	case <-time.After(testTimeout):
		t.Fatal("etcd's Observe delivered nothing")
	}
	require.NoError(t, b.Resign(ctx))
}
