package etcdsync_test

// Observers: every leader and value in order; errors close the channel.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
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
