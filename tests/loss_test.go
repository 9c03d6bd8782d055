package tests

// Holders and waiters learning of loss: the cause a hold reports, Unlock
// bounded by a loss seen meanwhile, the session's end, a closed client.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Predecessor, second-nearest and our own key deleted in one Txn: the
// waiter must return ErrSessionExpired and never hold.
func TestWaiterSeesOwnKeyDeletedWithThoseAhead(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("r11own%d", round)
			holder, qs := enqueueBehind(t, ctx, c, admin, name, 2, func(q *queued) error {
				t.Errorf("waiter %d held although its key went with the keys ahead", q.i)
				return q.m.Unlock(ctx)
			})
			ops := []clientv3.Op{clientv3.OpDelete(holder.Key()), clientv3.OpDelete(keyOf(name, qs[0].s)), clientv3.OpDelete(keyOf(name, qs[1].s))}
			if round%2 == 1 {
				slices.Reverse(ops)
			}
			_, err := admin.Txn(ctx).Then(ops...).Commit()
			require.NoError(t, err)
			for _, q := range qs {
				require.ErrorIs(t, resultWithin(t, q.err, testTimeout, fmt.Sprintf("deleted waiter %d", q.i)), etcdsync.ErrSessionExpired)
			}
		})
	}
}

// Concurrent Unlocks of one value must not make its own release read as a
// loss. Unlock B's delete commits; before its reply is read, Unlock A on the
// same value fails with an RPC error; a guarded Do (or the Done watch) that
// then sees the key gone must not record a loss by someone else (ErrNotHeld):
// the value's own Unlock B released it and returns nil.
func TestConcurrentUnlocksOfOneValueReportNoLoss(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	var sc faults.Script
	m := etcdsync.NewMutex(session(t, c.Client(t, sc.Dial())), "r8-cause")
	require.NoError(t, m.Lock(ctx))
	committed, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	defer free() // never leave Unlock B parked
	sc.Arm(faults.TxnMethod,
		func(c faults.Call) error { err := c.Invoke(); close(committed); <-release; return err }, // Unlock B
		faults.Fail, // Unlock A
	)
	b := async(func() error { return m.Unlock(ctx) })
	within(t, committed, testTimeout, "Unlock B's delete")
	require.Error(t, m.Unlock(ctx), "Unlock A fails")
	_, err := m.Do(ctx)
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	free()
	require.NoError(t, <-b, "Unlock B released the lock")
	require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased, "the lock was released by this value's own Unlock")
}

// Two Unlocks of one value in flight, each way round: while one is held back,
// the other commits; the one held back then returns at once, the value no
// longer holds (ErrLockReleased) and the key is gone.
func TestConcurrentUnlocksOneCommitsTheOtherReturns(t *testing.T) {
	t.Parallel()
	for _, firstHeld := range []bool{true, false} {
		t.Run(fmt.Sprintf("first held %t", firstHeld), func(t *testing.T) {
			t.Parallel()
			c := single(t)
			ctx := ctxT(t)
			g := faults.NewDeleteGate()
			var sc faults.Script
			m := etcdsync.NewMutex(session(t, c.Client(t, sc.Dial(), g.Dial())), "two-unlocks")
			require.NoError(t, m.Lock(ctx))
			key := m.Key()
			t.Cleanup(g.Release)
			inFirst, goFirst := make(chan struct{}), make(chan struct{})
			if firstHeld { // the first (bounded by the hold's end directly) waits at the gate; the second commits
				sc.Arm(faults.TxnMethod,
					func(c faults.Call) error { g.Hold(); close(inFirst); return c.Invoke() },
					func(c faults.Call) error { g.Pass(); return c.Invoke() },
				)
			} else { // the second (bounded by the hold's context) waits at the gate; the first commits
				sc.Arm(faults.TxnMethod,
					func(c faults.Call) error {
						close(inFirst)
						select { // the test's end lets it go too, should the test fail first
						case <-goFirst:
						case <-ctx.Done():
						}
						g.Pass()
						return c.Invoke()
					},
					func(c faults.Call) error { g.Hold(); return c.Invoke() },
				)
			}
			first := async(func() error { return m.Unlock(ctx) })
			within(t, inFirst, testTimeout, "the first Unlock's transaction")
			if firstHeld {
				within(t, g.Held, testTimeout, "the first Unlock held")
				require.NoError(t, m.Unlock(ctx), "the second Unlock commits")
				t.Logf("first: %v", resultWithin(t, first, 3*time.Second, "the first Unlock returns once the second committed"))
			} else {
				second := async(func() error { return m.Unlock(ctx) })
				within(t, g.Held, testTimeout, "the second Unlock held")
				close(goFirst)
				require.NoError(t, resultWithin(t, first, 3*time.Second, "the first Unlock"), "the first Unlock commits")
				t.Logf("second: %v", resultWithin(t, second, 3*time.Second, "the second Unlock returns once the first committed"))
			}
			require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
			require.Empty(t, keys(t, c.Client(t), key))
		})
	}
}

// After an Unlock that failed with an RPC error (and did not commit), a loss
// by someone else's delete reads as ErrNotHeld. Invariant "Loss signal".
func TestLossAfterFailedUnlockIsErrNotHeld(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var inj faults.Injector
	m := etcdsync.NewMutex(session(t, c.Client(t, inj.Dial())), "cause")
	require.NoError(t, m.Lock(ctx))
	done := m.Done()
	inj.Arm(faults.TxnMethod, 1)
	err := m.Unlock(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
	require.NoError(t, m.Err(), "a failed Unlock keeps the hold")
	_, err = admin.Delete(ctx, m.Key())
	require.NoError(t, err)
	within(t, done, testTimeout, "Done after the key was deleted")
	require.ErrorIs(t, m.Err(), etcdsync.ErrNotHeld)
	require.NotErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
}

// A Lock that completes as its session ends never hands back a hold that is
// already over without saying so: it returns an error, or a hold whose Err
// says why it ended; and no key stays once the session is closed.
func TestLockAtSessionEndNeverHidesTheEnd(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	holder := etcdsync.NewMutex(session(t, cli), "end")
	for i := 0; i < 30; i++ {
		require.NoError(t, holder.Lock(ctx))
		s, err := etcdsync.NewSession(cli)
		require.NoError(t, err)
		m := etcdsync.NewMutex(s, "end")
		errc := async(func() error { return m.Lock(ctx) })
		waitKeys(t, cli, "end/", 2)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); s.Close() }()
		require.NoError(t, holder.Unlock(ctx))
		wg.Wait()
		err = <-errc
		if err != nil {
			require.True(t, errors.Is(err, etcdsync.ErrSessionClosed) || errors.Is(err, context.Canceled), "trial %d: %v", i, err)
		} else {
			within(t, m.Done(), testTimeout, "Done of a hold whose session closed")
			require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed, "trial %d", i)
		}
		require.Empty(t, keys(t, cli, "end/"), "trial %d", i)
	}
}

// unlockHeldBack locks name on a client whose delete transactions a gate holds
// back (until the test ends), and starts an Unlock under each of ctxs, held
// in flight one after the other (the hold's end cancels the first directly;
// the others, which find that place taken, through the hold's context). It
// returns an admin client, the session, the Mutex, its key and the Unlocks'
// results, in the order they return.
func unlockHeldBack(t *testing.T, name string, ctxs ...context.Context) (*clientv3.Client, *etcdsync.Session, *etcdsync.Mutex, string, <-chan error) {
	c := kitSingle(t)
	g := faults.NewDeleteGate()
	s := session(t, kitClient(t, c, g.Dial()))
	m := etcdsync.NewMutex(s, name)
	require.NoError(t, m.Lock(ctxT(t)))
	key := m.Key()
	g.Hold()
	t.Cleanup(g.Release)
	errc := make(chan error, len(ctxs))
	for _, ctx := range ctxs {
		go func() { errc <- m.Unlock(ctx) }()
		within(t, g.Held, testTimeout, "unlock txn held")
	}
	return c.Client(t), s, m, key, errc
}

// An Unlock in flight must return at once when the hold ends meanwhile
// because Done's watch saw the key deleted (Done first called during Unlock).
func TestUnlockReturnsOnceDoneSeesLoss(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	admin, _, m, key, errc := unlockHeldBack(t, "rh-bound-done", ctx, ctx)
	done := m.Done() // first call, after the unhold took its bound
	_, err := admin.Delete(ctx, key)
	require.NoError(t, err)
	within(t, done, 5*time.Second, "Done after delete")
	for range 2 {
		err = resultWithin(t, errc, 3*time.Second, "Unlock returns once the hold ended")
		t.Logf("Unlock: %v; Err: %v", err, m.Err())
	}
}

// Same, the hold ended by a concurrent Do that finds the key gone.
func TestUnlockReturnsOnceDoSeesLoss(t *testing.T) {
	t.Parallel()
	ctx := ctxT(t)
	admin, _, m, key, errc := unlockHeldBack(t, "rh-bound-do", ctx, ctx)
	_, err := admin.Delete(ctx, key)
	require.NoError(t, err)
	_, err = m.Do(ctx, clientv3.OpPut("rh-bound-do-x", "1"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	for range 2 {
		err = resultWithin(t, errc, 3*time.Second, "Unlock returns once the hold ended")
		t.Logf("Unlock: %v; Err: %v", err, m.Err())
	}
}

// Of two Unlocks in flight, when the second's caller gives up first, the
// first stays bounded by the hold: it returns once the hold ends, by a delete
// that Do sees, or by the session's Close.
func TestUnlockInFlightStaysBoundedWhenAnotherGivesUp(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"delete", "close"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			second, giveUp := context.WithCancel(ctx)
			admin, s, m, key, errc := unlockHeldBack(t, "rh-give-up-"+end, ctx, second)
			giveUp()
			require.ErrorIs(t, resultWithin(t, errc, 3*time.Second, "the second Unlock returns on its ctx"), context.Canceled)
			require.NoError(t, m.Err(), "the hold stays")
			switch end {
			case "delete":
				_, err := admin.Delete(ctx, key)
				require.NoError(t, err)
				_, err = m.Do(ctx)
				require.ErrorIs(t, err, etcdsync.ErrNotHeld)
			case "close":
				closed := async(s.Close)
				defer func() { resultWithin(t, closed, testTimeout, "Close") }()
			}
			err := resultWithin(t, errc, 3*time.Second, "the first Unlock returns once the hold ended")
			t.Logf("first Unlock: %v; Err: %v", err, m.Err())
		})
	}
}

// Done and Err after the session ended (Done never called before), and with
// Done called before.
func TestHoldSeesSessionEnd(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	for _, early := range []bool{false, true} {
		s := session(t, cli)
		m := etcdsync.NewMutex(s, "rh-send")
		require.NoError(t, m.Lock(ctx))
		var d <-chan struct{}
		if early {
			d = m.Done()
		}
		require.NoError(t, s.Close())
		if early {
			within(t, d, 5*time.Second, "early Done after Close")
		}
		within(t, m.Done(), 5*time.Second, "Done after Close")
		require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)
		require.Equal(t, "", m.Key())
		require.ErrorIs(t, m.Unlock(ctx), etcdsync.ErrLockReleased)
		require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)
	}
}

// A release's cause is not overwritten by the later session end, and the
// reverse; Done first called after the hold ended is closed.
func TestHoldKeepsFirstCause(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "rh-cause")
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, m.Unlock(ctx))
	within(t, m.Done(), 5*time.Second, "Done after Unlock")
	require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, s.Close())
	require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
	require.NotErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)

	// Released with Done watched, then deleted externally: not a loss.
	s2 := session(t, cli)
	m2 := etcdsync.NewMutex(s2, "rh-cause2")
	require.NoError(t, m2.Lock(ctx))
	d := m2.Done()
	_, err := cli.Delete(ctx, m2.Key())
	require.NoError(t, err)
	within(t, d, 5*time.Second, "Done after external delete")
	require.ErrorIs(t, m2.Err(), etcdsync.ErrNotHeld)
	require.NotErrorIs(t, m2.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, s2.Close())
	require.ErrorIs(t, m2.Err(), etcdsync.ErrNotHeld)
}

// Concurrent Done/Err/Header/Key/Unlock/Close under -race.
func TestHoldAccessorsRaceFree(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	for i := 0; i < 6; i++ {
		s := session(t, cli)
		m := etcdsync.NewMutex(s, "rh-race")
		require.NoError(t, m.Lock(ctx))
		e := etcdsync.NewElection(s, "rh-race-e")
		require.NoError(t, e.Campaign(ctx, "v"))
		e2 := etcdsync.ResumeElection(s, "rh-race-e", e.Key(), e.Rev())
		var wg sync.WaitGroup
		for j := 0; j < 4; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := 0; k < 50; k++ {
					_ = m.Done()
					_ = m.Err()
					_ = m.Header()
					_ = e2.Done()
					_ = e.Err()
					_ = e2.Header()
				}
			}()
		}
		wg.Add(3)
		go func() { defer wg.Done(); _ = m.Unlock(ctx) }()
		go func() { defer wg.Done(); _ = e2.Resign(ctx) }()
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				_ = s.Close()
			}
		}()
		wg.Wait()
		require.NoError(t, s.Close())
		within(t, m.Done(), 5*time.Second, "m done")
		within(t, e.Done(), 5*time.Second, "e done")
		require.Error(t, m.Err())
		require.Error(t, e.Err())
		if err := e.Err(); !errors.Is(err, etcdsync.ErrLockReleased) && !errors.Is(err, etcdsync.ErrSessionClosed) {
			t.Fatalf("e.Err: %v", err)
		}
	}
}

// After the client closes, the session and its holds end with a cause that
// says so, and Close returns at once.
func TestClosedClientEndsSessionAndHolds(t *testing.T) {
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
	require.Less(t, time.Since(start), 10*time.Second, "Close with a closed client returns at once, not after the TTL (60 s)")
	require.ErrorIs(t, m.Lock(ctx), etcdsync.ErrSessionClosed)
}
