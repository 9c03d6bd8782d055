package tests

// Handover: a leader asked to stop ends its work, then resigns, and the next
// candidate leads at once (not after the TTL); never two leaders at work.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
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

// A Handover waits for the Run's resign as well as for its fn: while that
// resign is held back on its way to etcd, Handover has not returned and has
// sent no resign of its own; once it goes through, both return nil and the
// term is over.
func TestHandoverWaitsForTheRunsResign(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	gate := faults.NewDeleteGate()
	cli := c.Client(t, gate.Dial())
	e := etcdsync.NewElection(session(t, cli), "handover-resign")
	working := make(chan struct{})
	run := async(func() error {
		return e.Run(ctx, "a", func(ctx context.Context) error {
			close(working)
			<-ctx.Done()
			return nil
		})
	})
	within(t, working, testTimeout, "the Run's fn starts")
	gate.Hold()
	handed := async(func() error { return e.Handover(ctx) })
	within(t, gate.Held, testTimeout, "the Run's resign, once its fn returned")
	notYet(t, handed, 300*time.Millisecond, "Handover while the Run's resign is held back")
	require.Len(t, gate.Held, 0, "a second resign while the Run's is held back")
	require.Len(t, keys(t, c.Client(t), "handover-resign/"), 1, "the term lasts until the Run's resign")
	gate.Release()
	require.NoError(t, resultWithin(t, handed, testTimeout, "Handover once the Run resigned"))
	require.NoError(t, resultWithin(t, run, testTimeout, "the Run returns"))
	require.Empty(t, keys(t, c.Client(t), "handover-resign/"))
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

// A Handover that lands while a Run is taking the leadership (its Campaign
// returned, its fn about to start) still waits for that fn: whenever
// Handover returns nil, no fn of a Run under the term it ended is running or
// starts afterwards.
func TestHandoverRacingRunStartWaitsForItsWork(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	s := session(t, cli)
	const rounds = 150
	var raced int
	for i := range rounds {
		ctx, cancel := context.WithTimeout(context.Background(), testTimeout) // each round's own bound
		defer cancel()
		name := fmt.Sprintf("handover-race-%d", i)
		e := etcdsync.NewElection(s, name)
		var workEnd atomic.Int64 // unix nanos when fn returned; 0: not yet or never ran
		ran := make(chan struct{})
		run := async(func() error {
			return e.Run(ctx, "a", func(ctx context.Context) error {
				close(ran)
				<-ctx.Done()
				time.Sleep(30 * time.Millisecond) // winding down, as real work does
				workEnd.Store(time.Now().UnixNano())
				return nil
			})
		})
		var handedAt int64
		deadline := time.Now().Add(testTimeout)
		for {
			if e.Rev() == 0 { // not leading yet: a Handover now would be a no-op
				select {
				case err := <-run:
					t.Fatalf("round %d: the Run returned before it led: %v", i, err)
				default:
				}
				if time.Now().After(deadline) {
					t.Fatalf("round %d: the Run did not lead within %v", i, testTimeout)
				}
				runtime.Gosched() // spin for the earliest moment, but let the Run's goroutines run
				continue
			}
			require.NoError(t, e.Handover(ctx))
			handedAt = time.Now().UnixNano()
			break
		}
		err := resultWithin(t, run, testTimeout, "the Run returns")
		select {
		case <-ran:
		default:
			continue // the Handover ended the term before fn was called: nothing ran
		}
		raced++
		require.NoError(t, err)
		end := workEnd.Load()
		require.LessOrEqual(t, end, handedAt, "round %d: Handover returned %v before the Run's fn did", i, time.Duration(end-handedAt))
	}
	t.Logf("%d of %d rounds ran fn", raced, rounds)
}

// A successor queued in another session never leads while the Run it takes
// over from still works, when the Handover is sent just as that Run begins
// to lead (its predecessor resigned): the Run's fn returns before the
// successor's Campaign does.
func TestHandoverRacingRunStartNoTwoLeaders(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	ps, s, bs := session(t, cli), session(t, cli), session(t, cli)
	const rounds = 60
	var ran int
	for i := range rounds {
		name := fmt.Sprintf("handover-race2-%d", i)
		p := etcdsync.NewElection(ps, name)
		require.NoError(t, p.Campaign(ctx, "p"))
		e := etcdsync.NewElection(s, name)
		var workEnd atomic.Int64
		fnRan := make(chan struct{})
		run := async(func() error {
			return e.Run(ctx, "a", func(ctx context.Context) error {
				close(fnRan)
				<-ctx.Done()
				time.Sleep(30 * time.Millisecond)
				workEnd.Store(time.Now().UnixNano())
				return nil
			})
		})
		waitKeys(t, cli, name+"/", 2)
		b := etcdsync.NewElection(bs, name)
		var bLeadAt atomic.Int64
		bLeads := async(func() error {
			err := b.Campaign(ctx, "b")
			bLeadAt.Store(time.Now().UnixNano())
			return err
		})
		waitKeys(t, cli, name+"/", 3)
		handed := async(func() error {
			for e.Rev() == 0 { // the earliest moment it leads
				runtime.Gosched()
			}
			return e.Handover(ctx)
		})
		require.NoError(t, p.Resign(ctx))
		require.NoError(t, resultWithin(t, handed, testTimeout, "the Handover"))
		require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"), "round %d", i)
		runErr := resultWithin(t, run, testTimeout, "a's Run returns")
		select {
		case <-fnRan:
			ran++
			require.NoError(t, runErr)
			require.Less(t, workEnd.Load(), bLeadAt.Load(), "round %d: b leads %v before a's Run fn returned", i, time.Duration(workEnd.Load()-bLeadAt.Load()))
		default: // handed over before fn began: fn never runs, and Run says so
			require.ErrorIs(t, runErr, etcdsync.ErrLockReleased)
		}
		require.NoError(t, b.Resign(ctx))
	}
	t.Logf("fn ran in %d of %d rounds", ran, rounds)
}

// A Run started on the leading value during a Handover (a loop that
// campaigns again) waits: the queued candidate of another session leads
// first, and the second Run's fn does not run while it does.
func TestHandoverRunOnSameValueQueuesBehindSuccessor(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "handover-again")
	stopping := make(chan struct{})
	var aWorking atomic.Int32
	first := async(func() error {
		return e.Run(ctx, "a", func(ctx context.Context) error {
			aWorking.Add(1)
			defer aWorking.Add(-1)
			close(stopping)
			<-ctx.Done()
			time.Sleep(50 * time.Millisecond)
			return nil
		})
	})
	<-stopping
	b := etcdsync.NewElection(session(t, cli), "handover-again")
	var bLeading atomic.Bool
	bLeads := async(func() error {
		if err := b.Campaign(ctx, "b"); err != nil {
			return err
		}
		bLeading.Store(true)
		if aWorking.Load() != 0 {
			return errors.New("b leads while a's Run works")
		}
		return nil
	})
	waitKeys(t, cli, "handover-again/", 2)
	secondRan := make(chan struct{})
	second := async(func() error {
		return e.Run(ctx, "a", func(ctx context.Context) error {
			aWorking.Add(1)
			defer aWorking.Add(-1)
			if bLeading.Load() {
				return errors.New("a's second Run works while b leads")
			}
			close(secondRan)
			<-ctx.Done()
			return nil
		})
	})
	notYet(t, second, 100*time.Millisecond, "a second Run on a leading value")
	require.NoError(t, e.Handover(ctx))
	require.NoError(t, resultWithin(t, first, testTimeout, "the first Run returns"))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
	notYet(t, second, 200*time.Millisecond, "the second Run while b leads")
	bLeading.Store(false)
	require.NoError(t, b.Resign(ctx))
	within(t, secondRan, testTimeout, "the second Run leads after b")
	require.NoError(t, e.Handover(ctx))
	require.NoError(t, resultWithin(t, second, testTimeout, "the second Run returns"))
	require.Empty(t, keys(t, cli, "handover-again/"))
}

// Handover racing a Proclaim, a Resign and a cancel of the Run's ctx, from
// several goroutines at once: each returns cleanly, the term ends once, the
// queued successor leads only after the Run's fn returned, nothing is left.
func TestHandoverRacingProclaimResignAndCancel(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	for i := range 10 {
		name := fmt.Sprintf("handover-mix-%d", i)
		e := etcdsync.NewElection(session(t, cli), name)
		rctx, rcancel := context.WithCancel(ctx)
		var working atomic.Bool
		started := make(chan struct{})
		run := async(func() error {
			return e.Run(rctx, "a", func(ctx context.Context) error {
				working.Store(true)
				defer working.Store(false)
				close(started)
				<-ctx.Done()
				time.Sleep(20 * time.Millisecond)
				return nil
			})
		})
		<-started
		b := etcdsync.NewElection(session(t, cli), name)
		bLeads := async(func() error {
			if err := b.Campaign(ctx, "b"); err != nil {
				return err
			}
			if working.Load() && i%3 != 0 { // a Resign ends the term at once, by design
				return errors.New("b leads while a's Run works")
			}
			return nil
		})
		waitKeys(t, cli, name+"/", 2)
		var wg sync.WaitGroup
		errs := make(chan error, 8)
		wg.Go(func() { errs <- e.Handover(ctx) })
		wg.Go(func() { errs <- e.Handover(ctx) })
		wg.Go(func() {
			if err := e.Proclaim(ctx, "a2"); err != nil && !errors.Is(err, etcdsync.ErrElectionNotLeader) {
				errs <- err
			}
		})
		wg.Go(func() {
			if i%2 == 0 {
				rcancel()
			}
		})
		if i%3 == 0 {
			wg.Go(func() { errs <- e.Resign(ctx) })
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			require.NoError(t, err, "round %d", i)
		}
		require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"), "round %d", i)
		err := resultWithin(t, run, testTimeout, "a's Run returns")
		require.True(t, err == nil || errors.Is(err, context.Canceled), "round %d: %v", i, err)
		require.Equal(t, "b", leaderValue(t, b))
		require.NoError(t, b.Resign(ctx))
		rcancel()
		require.Empty(t, keys(t, cli, name+"/"))
	}
}

// Terms shared by ResumeElection: a Handover through either handle stops
// the Runs under both and the successor leads only after both returned.
func TestHandoverOnSharedTermStopsRunsOfBothHandles(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e1 := etcdsync.NewElection(s, "handover-shared")
	var working atomic.Int32
	started := make(chan struct{})
	r1 := async(func() error {
		return e1.Run(ctx, "a", func(ctx context.Context) error {
			working.Add(1)
			defer working.Add(-1)
			close(started)
			<-ctx.Done()
			time.Sleep(50 * time.Millisecond)
			return nil
		})
	})
	<-started
	e2 := etcdsync.ResumeElection(s, "handover-shared", e1.Key(), e1.Rev())
	require.NoError(t, e2.Err())
	require.NoError(t, e2.Proclaim(ctx, "a2"), "the handles share the term")
	b := etcdsync.NewElection(session(t, cli), "handover-shared")
	bLeads := async(func() error {
		if err := b.Campaign(ctx, "b"); err != nil {
			return err
		}
		if n := working.Load(); n != 0 {
			return fmt.Errorf("b leads while %d Runs of a work", n)
		}
		return nil
	})
	waitKeys(t, cli, "handover-shared/", 2)
	require.NoError(t, e2.Handover(ctx), "a Handover through the other handle")
	require.Zero(t, working.Load(), "Handover returned while a Run works")
	require.NoError(t, resultWithin(t, r1, testTimeout, "the Run returns"))
	require.NoError(t, resultWithin(t, bLeads, testTimeout, "b leads"))
	require.NoError(t, b.Resign(ctx))
}

// A Handover after the session was lost (lease revoked by someone else)
// returns nil: the term has ended.
func TestHandoverAfterSessionLoss(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "handover-loss")
	release := make(chan struct{})
	started := make(chan struct{})
	run := async(func() error {
		return e.Run(ctx, "a", func(ctx context.Context) error {
			close(started)
			<-release
			return nil
		})
	})
	<-started
	_, err := cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	within(t, s.Done(), testTimeout, "the session ends")
	require.NoError(t, e.Handover(ctx), "the term has ended")
	close(release)
	require.Error(t, resultWithin(t, run, testTimeout, "the Run returns"))
	require.NoError(t, e.Handover(ctx))
}
