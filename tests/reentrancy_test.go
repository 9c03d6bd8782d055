package tests

// Reentrancy and nesting of Runs: which nested Runs enter, take their own
// holds or are refused, panics, and HoldFrom.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A reentrant (inner) Run whose hold ends while its fn runs returns fn's
// error joined with the cause, as every Run does.
func TestReentrantRunErrorCarriesCause(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	m := etcdsync.NewMutex(s, "r13recause")
	var inner error
	err := m.Run(ctx, func(fctx context.Context) error {
		inner = m.Run(fctx, func(ictx context.Context) error {
			_, err := admin.Delete(ctx, "r13recause/", clientv3.WithPrefix())
			require.NoError(t, err)
			within(t, ictx.Done(), 5*time.Second, "inner fn's context")
			return ictx.Err()
		})
		return nil
	})
	require.ErrorIs(t, err, etcdsync.ErrNotHeld, "outer Run")
	require.ErrorIs(t, inner, context.Canceled)
	require.ErrorIs(t, inner, etcdsync.ErrNotHeld, "inner (reentrant) Run's error %v lacks the loss cause", inner)
}

// A Mutex (or Election, Semaphore) and an RWMutex of one name use different
// keys (NAME/<lease> vs NAME/read|write/<lease>) and never block each other:
// nested in one another's Run they take their own holds, not an
// ErrInvalidArgument.
func TestMutexAndRWMutexOfOneNameNest(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	rw := etcdsync.NewRWMutex(s, "r13mix")
	m := etcdsync.NewMutex(s, "r13mix")
	// Outside Run the two are independent.
	require.NoError(t, rw.Lock(ctx))
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, m.Unlock(ctx))
	require.NoError(t, rw.Unlock(ctx))

	inner := func(ictx context.Context) error {
		key, _, ok := etcdsync.HoldFrom(ictx)
		if !ok || key != m.Key() {
			return fmt.Errorf("HoldFrom %q, the Mutex holds %q", key, m.Key())
		}
		return nil
	}
	err := rw.Run(ctx, func(fctx context.Context) error { return m.Run(fctx, inner) })
	require.NoError(t, err, "Mutex.Run inside RWMutex.Run of the same name")
	err = rw.RRun(ctx, func(fctx context.Context) error { return m.Run(fctx, inner) })
	require.NoError(t, err, "Mutex.Run inside RWMutex.RRun of the same name")
	err = m.Run(ctx, func(fctx context.Context) error {
		return rw.Run(fctx, func(context.Context) error { return nil })
	})
	require.NoError(t, err, "RWMutex.Run inside Mutex.Run of the same name")
	sm := etcdsync.NewSemaphore(s, "r13mix", 2)
	err = rw.RRun(ctx, func(fctx context.Context) error {
		return sm.Run(fctx, 1, func(context.Context) error { return nil })
	})
	require.NoError(t, err, "Semaphore.Run inside RWMutex.RRun of the same name")
	require.Empty(t, keys(t, admin, "r13mix/"))
}

// A Mutex on NAME/write uses the very key of NAME's RWMutex writer (the
// documented exception): nested in rw.Run it could never be granted, so it
// must be an error wrapping ErrInvalidArgument, not a wait until ctx ends.
func TestMutexOnWriteDirInsideRWMutexIsInvalid(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	rw := etcdsync.NewRWMutex(s, "r13dir")
	m := etcdsync.NewMutex(s, "r13dir/write")
	err := rw.Run(ctx, func(fctx context.Context) error {
		ictx, cancel := context.WithTimeout(fctx, 3*time.Second)
		defer cancel()
		return m.Run(ictx, func(context.Context) error { return nil })
	})
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.NotErrorIs(t, err, context.DeadlineExceeded, "a self-deadlock until ctx ended")
}

// Election inside Election of the same value with another val: the nested
// Run either proclaims its val (as Campaign on a leading value does) or is
// refused; it must not run fn "leading with v2" while v1 is proclaimed.
func TestNestedElectionOfOtherValueNeverLeadsUnproclaimed(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	e := etcdsync.NewElection(session(t, admin), "r13ev")
	obs := etcdsync.NewObserver(admin, "r13ev")
	var innerErr error
	err := e.Run(ctx, "v1", func(fctx context.Context) error {
		innerErr = e.Run(fctx, "v2", func(ictx context.Context) error {
			resp, err := obs.Leader(ictx)
			if err != nil {
				return err
			}
			if v := string(resp.Kvs[0].Value); v != "v2" {
				return fmt.Errorf("nested Election.Run with v2 runs fn while the leader's value is %q", v)
			}
			return nil
		})
		return nil
	})
	require.NoError(t, err)
	if !errors.Is(innerErr, etcdsync.ErrInvalidArgument) {
		require.NoError(t, innerErr)
	}
}

// A Run inside a Run whose hold already ended must not run fn; a ctx from
// fn used after the outer Run returned cannot re-enter the dead hold (an
// uncancelled copy of it takes a new hold, with a new fencing token).
func TestRunInsideEndedHoldNeverRuns(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	m := etcdsync.NewMutex(s, "r13ended")
	ran := false
	err := m.Run(ctx, func(fctx context.Context) error {
		_, err := admin.Delete(ctx, "r13ended/", clientv3.WithPrefix())
		require.NoError(t, err)
		within(t, fctx.Done(), 5*time.Second, "outer fn's context")
		ierr := m.Run(fctx, func(context.Context) error { ran = true; return nil })
		require.Error(t, ierr)
		require.Empty(t, keys(t, admin, "r13ended/"))
		return nil
	})
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.False(t, ran, "fn ran inside an ended hold")

	var saved context.Context
	var oldRev int64
	require.NoError(t, m.Run(ctx, func(fctx context.Context) error {
		saved = context.WithValue(fctx, nestedCtxKey{}, 1) // derived from fn's context
		_, oldRev, _ = etcdsync.HoldFrom(fctx)
		return nil
	}))
	done := async(func() error {
		return m.Run(saved, func(context.Context) error { ran = true; return nil })
	})
	require.ErrorIs(t, resultWithin(t, done, 5*time.Second, "Run on a ctx of a returned Run"), context.Canceled)
	require.False(t, ran)
	wctx, cancel := context.WithTimeout(context.WithoutCancel(saved), 5*time.Second)
	defer cancel()
	require.NoError(t, m.Run(wctx, func(ictx context.Context) error {
		_, rev, ok := etcdsync.HoldFrom(ictx)
		require.True(t, ok)
		require.Greater(t, rev, oldRev, "a new hold, not the dead one")
		require.Len(t, keys(t, admin, "r13ended/"), 1)
		return nil
	}))
	require.Empty(t, keys(t, admin, "r13ended/"))
}

type nestedCtxKey struct{}

// Nested RRun/Run of RWMutex values of one session: different names take
// their own holds (HoldFrom is the innermost), same name enters (a read in a
// write; a write in a read is ErrInvalidArgument, also further out).
func TestNestedRWMutexValues(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	a, b := etcdsync.NewRWMutex(s, "r13a"), etcdsync.NewRWMutex(s, "r13b")
	a2 := etcdsync.NewRWMutex(s, "r13a")
	var writeInRead, readInWrite error
	err := a.RRun(ctx, func(actx context.Context) error {
		akey, _, _ := etcdsync.HoldFrom(actx)
		require.True(t, strings.HasPrefix(akey, "r13a/read/"), akey)
		return b.Run(actx, func(bctx context.Context) error {
			bkey, _, _ := etcdsync.HoldFrom(bctx)
			require.True(t, strings.HasPrefix(bkey, "r13b/write/"), bkey)
			require.Len(t, keys(t, admin, "r13b/"), 1)
			writeInRead = a2.Run(bctx, func(context.Context) error { return nil })
			require.NoError(t, a2.RRun(bctx, func(ictx context.Context) error {
				k, _, _ := etcdsync.HoldFrom(ictx)
				require.Equal(t, bkey, k, "reentrant: innermost stays b's")
				return nil
			}))
			require.NoError(t, b.RRun(bctx, func(context.Context) error { return nil }))
			return nil
		})
	})
	require.NoError(t, err)
	require.ErrorIs(t, writeInRead, etcdsync.ErrInvalidArgument)
	readInWrite = a.Run(ctx, func(actx context.Context) error {
		return a2.RRun(actx, func(ictx context.Context) error {
			require.Len(t, keys(t, admin, "r13a/"), 1, "no read key of its own")
			return nil
		})
	})
	require.NoError(t, readInWrite)
	require.Empty(t, keys(t, admin, "r13a/"))
	require.Empty(t, keys(t, admin, "r13b/"))
}

// Semaphore nested: fewer or as many permits enter (any value of the
// session and name), more is ErrInvalidArgument; HoldFrom is the outer's.
func TestNestedSemaphore(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	sm, sm2 := etcdsync.NewSemaphore(s, "r13sem", 3), etcdsync.NewSemaphore(s, "r13sem", 3)
	err := sm.Run(ctx, 2, func(fctx context.Context) error {
		_, rev, _ := etcdsync.HoldFrom(fctx)
		require.NoError(t, sm.Run(fctx, 2, func(ictx context.Context) error {
			_, r, _ := etcdsync.HoldFrom(ictx)
			require.Equal(t, rev, r)
			return sm2.Run(ictx, 1, func(context.Context) error { return nil })
		}))
		require.ErrorIs(t, sm2.Run(fctx, 3, func(context.Context) error { return nil }), etcdsync.ErrInvalidArgument)
		require.Len(t, keys(t, admin, "r13sem/"), 1)
		return nil
	})
	require.NoError(t, err)
	require.Empty(t, keys(t, admin, "r13sem/"))
}

// A Semaphore value of another capacity on the same name nested in a
// Semaphore Run: a participant with another capacity is an error wrapping
// ErrInvalidArgument (the design's rule), also when it would re-enter.
func TestNestedSemaphoreOfOtherCapacityIsInvalid(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	sm, other := etcdsync.NewSemaphore(s, "r13semcap", 3), etcdsync.NewSemaphore(s, "r13semcap", 5)
	var inner error
	require.NoError(t, sm.Run(ctx, 2, func(fctx context.Context) error {
		inner = other.Run(fctx, 1, func(context.Context) error { return nil })
		return nil
	}))
	require.ErrorIs(t, inner, etcdsync.ErrInvalidArgument)
}

// Panics: in a reentrant Run, in a nested Run of another name, after the
// hold was lost, and runtime.Goexit: every hold is released, the panic value
// goes on unchanged.
func TestRunPanicsReleaseEveryHold(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	m, n := etcdsync.NewMutex(s, "r13pa"), etcdsync.NewMutex(s, "r13pb")
	boom := errors.New("boom")
	require.PanicsWithError(t, "boom", func() {
		m.Run(ctx, func(fctx context.Context) error {
			return m.Run(fctx, func(context.Context) error { panic(boom) })
		})
	})
	require.Empty(t, keys(t, admin, "r13pa/"))
	require.PanicsWithValue(t, "inner", func() {
		m.Run(ctx, func(fctx context.Context) error {
			return n.Run(fctx, func(context.Context) error {
				require.Len(t, keys(t, admin, "r13p"), 2)
				panic("inner")
			})
		})
	})
	require.Empty(t, keys(t, admin, "r13p"))
	require.PanicsWithValue(t, "after loss", func() {
		m.Run(ctx, func(fctx context.Context) error {
			_, err := admin.Delete(ctx, "r13pa/", clientv3.WithPrefix())
			require.NoError(t, err)
			within(t, fctx.Done(), 5*time.Second, "fn's context")
			panic("after loss")
		})
	})
	require.Empty(t, keys(t, admin, "r13p"))
	// panic(nil) is a *runtime.PanicNilError since Go 1.21: still released.
	func() {
		defer func() {
			var pe *runtime.PanicNilError
			err, _ := recover().(error)
			require.ErrorAs(t, err, &pe)
		}()
		m.Run(ctx, func(context.Context) error { panic(nil) })
	}()
	require.Empty(t, keys(t, admin, "r13p"))
	done := make(chan struct{})
	go func() {
		defer close(done)
		m.Run(ctx, func(context.Context) error { runtime.Goexit(); return nil })
	}()
	within(t, done, 10*time.Second, "Goexit in fn")
	require.Empty(t, keys(t, admin, "r13p"))
	require.NoError(t, m.Run(ctx, func(context.Context) error { return nil }), "usable after the panics")
}

// HoldFrom: none outside any Run, the innermost inside nested Runs, the
// outer's again once the inner Run returned; in a read entered inside a
// write, the write's.
func TestHoldFromIsInnermostRun(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	_, _, ok := etcdsync.HoldFrom(ctx)
	require.False(t, ok)
	_, _, ok = etcdsync.HoldFrom(context.Background())
	require.False(t, ok)
	m, n := etcdsync.NewMutex(s, "r13hfa"), etcdsync.NewMutex(s, "r13hfb")
	rw := etcdsync.NewRWMutex(s, "r13hfrw")
	require.NoError(t, m.Run(ctx, func(actx context.Context) error {
		ak, ar, ok := etcdsync.HoldFrom(actx)
		require.True(t, ok)
		require.Equal(t, m.Key(), ak)
		require.Equal(t, m.Rev(), ar)
		require.NoError(t, n.Run(actx, func(bctx context.Context) error {
			bk, br, _ := etcdsync.HoldFrom(bctx)
			require.Equal(t, n.Key(), bk)
			require.Equal(t, n.Rev(), br)
			return rw.Run(bctx, func(wctx context.Context) error {
				wk, _, _ := etcdsync.HoldFrom(wctx)
				return rw.RRun(wctx, func(rctx context.Context) error {
					rk, _, _ := etcdsync.HoldFrom(rctx)
					require.Equal(t, wk, rk)
					require.True(t, strings.HasPrefix(rk, "r13hfrw/write/"))
					return nil
				})
			})
		}))
		k, r, _ := etcdsync.HoldFrom(actx)
		require.Equal(t, ak, k)
		require.Equal(t, ar, r)
		return nil
	}))
}
