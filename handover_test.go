package etcdsync_test

// Handover: a leader asked to stop ends its work, then resigns, and the next
// candidate leads at once (not after the TTL); never two leaders at work.

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
)

// termsOf collects the leaders' values an Observer's Terms reports ("" for
// no leader) until the test ends.
func termsOf(t *testing.T, o *etcdsync.Observer) <-chan string {
	ctx, cancel := context.WithCancel(context.Background())
	terms := o.Terms(ctx)
	out := make(chan string, 100)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for tm := range terms {
			if tm.Leader == nil {
				out <- ""
			} else {
				out <- string(tm.Leader.Value)
			}
		}
	}()
	t.Cleanup(func() { cancel(); within(t, done, testTimeout, "Terms' channel closes") })
	return out
}

func nextTerm(t *testing.T, terms <-chan string) string {
	t.Helper()
	select {
	case v := <-terms:
		return v
	case <-time.After(testTimeout):
		t.Fatal("no term reported")
	}
	return ""
}

// Handover with three candidates and an observer: the leader's Run work is
// cancelled (the cause wraps ErrLockReleased) and has returned before the
// next candidate leads; the observer sees each leader follow the last with no
// gap, and "no leader" only after the last one hands over with nobody queued.
// The sessions' TTL is long: a failover by expiry would not make it in time.
func TestHandoverStopsWorkThenPassesLeadership(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		cli := c.Client(t)
		ctx := ctxT(t)
		terms := termsOf(t, etcdsync.NewObserver(cli, "handover"))
		require.Equal(t, "", nextTerm(t, terms))

		a := etcdsync.NewElection(session(t, cli), "handover")
		var aReturned atomic.Bool
		working := make(chan struct{})
		var cause error
		aRun := async(func() error {
			return a.Run(ctx, "a", func(ctx context.Context) error {
				close(working)
				<-ctx.Done()
				cause = context.Cause(ctx)
				aReturned.Store(true)
				return ctx.Err()
			})
		})
		<-working
		require.Equal(t, "a", nextTerm(t, terms))
		b := etcdsync.NewElection(session(t, cli), "handover")
		cc := etcdsync.NewElection(session(t, cli), "handover")
		bLeads := async(func() error {
			err := b.Campaign(ctx, "b")
			if err == nil && !aReturned.Load() {
				err = errors.New("b leads while a's work runs")
			}
			return err
		})
		waitKeys(t, cli, "handover/", 2)
		cLeads := campaignAsync(ctx, cc, "c")
		waitKeys(t, cli, "handover/", 3)

		hctx, cancel := context.WithTimeout(ctx, 10*time.Second) // the TTL is 60 s
		defer cancel()
		require.NoError(t, a.Handover(hctx))
		require.True(t, aReturned.Load(), "Handover returned before the work did")
		require.ErrorIs(t, cause, etcdsync.ErrLockReleased)
		require.ErrorIs(t, resultWithin(t, aRun, testTimeout, "a's Run returns"), context.Canceled)
		require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
		require.Equal(t, "b", nextTerm(t, terms))
		notYet(t, cLeads, 100*time.Millisecond, "c leads while b does")

		require.NoError(t, b.Handover(hctx)) // no Run: it resigns
		require.NoError(t, resultWithin(t, cLeads, testTimeout, "c leads"))
		require.Equal(t, "c", nextTerm(t, terms))
		require.NoError(t, cc.Handover(hctx))
		require.Equal(t, "", nextTerm(t, terms), "nobody queued")
		require.NoError(t, a.Handover(hctx), "not leading: nothing to do")
	})
}

// A Handover whose ctx ends while the work ignores its cancel returns ctx's
// error with the term still on; the Run resigns once the work returns.
func TestHandoverBoundedByContext(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	e := etcdsync.NewElection(session(t, cli), "handover-slow")
	release := make(chan struct{})
	working := make(chan struct{})
	run := async(func() error {
		return e.Run(ctx, "slow", func(context.Context) error {
			close(working)
			<-release // ignores its context
			return nil
		})
	})
	<-working
	hctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, e.Handover(hctx), context.DeadlineExceeded)
	require.Len(t, keys(t, cli, "handover-slow/"), 1, "the term lasts while the work runs")
	close(release)
	require.NoError(t, resultWithin(t, run, testTimeout, "the Run returns"))
	require.Empty(t, keys(t, cli, "handover-slow/"))
}

// A Handover that loses its etcd leader on the way either fails (and a retry
// succeeds) or goes through; either way the next candidate leads, once.
func TestHandoverAcrossLostEtcdLeader(t *testing.T) {
	t.Parallel()
	c := three(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	a := etcdsync.NewElection(session(t, cli), "handover-fault")
	require.NoError(t, a.Campaign(ctx, "a"))
	b := etcdsync.NewElection(session(t, cli), "handover-fault")
	bLeads := campaignAsync(ctx, b, "b")
	waitKeys(t, cli, "handover-fault/", 2)
	leader := c.Leader()
	c.Stop(leader)
	defer func() { require.NoError(t, c.Restart(leader)) }()
	deadline := time.Now().Add(testTimeout)
	for {
		hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		err := a.Handover(hctx)
		cancel()
		if err == nil {
			break
		}
		require.True(t, time.Now().Before(deadline), "Handover kept failing: %v", err)
	}
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
	require.Equal(t, "b", leaderValue(t, b))
}
