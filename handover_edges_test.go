package etcdsync_test

// Handover at its edges: a Handover racing the start of a Run, a second Run
// on the same value, a Proclaim, a Resign, a cancel of the Run's ctx, a lost
// session, and terms shared by ResumeElection.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
)

// A Handover that lands while a Run is taking the leadership (its Campaign
// returned, its fn about to start) still waits for that fn: whenever
// Handover returns nil, no fn of a Run under the term it ended is running or
// starts afterwards.
func TestHandoverRacingRunStartWaitsForItsWork(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	const rounds = 150
	var raced int
	for i := range rounds {
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
		for {
			if e.Rev() == 0 {
				continue // not leading yet: a Handover now would be a no-op
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
			for e.Rev() == 0 {
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
