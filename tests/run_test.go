package tests

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Run holds while fn runs and releases after it, also when ctx ended in fn
// or fn panicked; fn's error comes back.
func TestRunReleases(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	errFn := errors.New("fn failed")
	for _, r := range runKinds(session(t, cli), "run") {
		t.Run(r.prefix, func(t *testing.T) {
			err := r.run(ctx, func(fctx context.Context) error {
				require.Len(t, keys(t, cli, r.prefix), 1, "the hold's key while fn runs")
				return errFn
			})
			require.ErrorIs(t, err, errFn)
			require.Empty(t, keys(t, cli, r.prefix))

			// ctx ends while fn runs: the release still happens.
			cctx, cancel := context.WithCancel(ctx)
			err = r.run(cctx, func(fctx context.Context) error {
				cancel()
				<-fctx.Done()
				return fctx.Err()
			})
			require.ErrorIs(t, err, context.Canceled)
			require.Empty(t, keys(t, cli, r.prefix))

			// A panic releases and goes on.
			require.PanicsWithValue(t, "boom", func() {
				r.run(ctx, func(context.Context) error { panic("boom") })
			})
			require.Empty(t, keys(t, cli, r.prefix))
		})
	}
}

// When the hold ends while fn runs (its key deleted by someone), fn's
// context ends at once with the cause, and Run returns it joined with fn's
// error.
func TestRunLoss(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	for _, r := range runKinds(session(t, cli), "runloss") {
		t.Run(r.prefix, func(t *testing.T) {
			err := r.run(ctx, func(fctx context.Context) error {
				_, err := cli.Delete(ctx, r.prefix, clientv3.WithPrefix())
				require.NoError(t, err)
				within(t, fctx.Done(), 5*time.Second, "fn's context ending when the hold did")
				require.ErrorIs(t, context.Cause(fctx), etcdsync.ErrNotHeld)
				return fctx.Err()
			})
			require.ErrorIs(t, err, context.Canceled)
			require.ErrorIs(t, err, etcdsync.ErrNotHeld)
			require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
			require.Empty(t, keys(t, cli, r.prefix))
		})
	}
}

// When fn returns its context's cause (the idiom for a loop that stops on
// loss), Run returns fn's error as it is, every kind, outer and reentered:
// the cause is stated once and still matches.
func TestRunStatesTheCauseOnce(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	for _, r := range runKinds(session(t, cli), "runonce") {
		t.Run(r.prefix, func(t *testing.T) {
			var returned, inner error
			err := r.run(ctx, func(fctx context.Context) error {
				inner = r.run(fctx, func(ictx context.Context) error {
					_, err := cli.Delete(ctx, r.prefix, clientv3.WithPrefix())
					require.NoError(t, err)
					within(t, ictx.Done(), 5*time.Second, "the reentered fn's context ending when the hold did")
					return fmt.Errorf("stopped: %w", context.Cause(ictx))
				})
				within(t, fctx.Done(), 5*time.Second, "fn's context ending when the hold did")
				returned = fmt.Errorf("stopped: %w", context.Cause(fctx))
				return returned
			})
			require.ErrorIs(t, inner, etcdsync.ErrNotHeld)
			require.Equal(t, 1, strings.Count(inner.Error(), "not held"), "the reentered Run states the cause once: %v", inner)
			require.Equal(t, returned, err, "Run returns fn's error as it is")
			require.ErrorIs(t, err, etcdsync.ErrNotHeld)
			require.Equal(t, 1, strings.Count(err.Error(), "not held"), "the cause stated once: %v", err)
			require.Empty(t, keys(t, cli, r.prefix))
		})
	}
	ml := etcdsync.NewMultiLock(session(t, cli), "runonce-multi-a", "runonce-multi-b")
	var returned error
	err := ml.Run(ctx, func(fctx context.Context) error {
		_, err := cli.Delete(ctx, "runonce-multi-b/", clientv3.WithPrefix())
		require.NoError(t, err)
		within(t, fctx.Done(), 5*time.Second, "the MultiLock's fn context ending when a name was lost")
		returned = fmt.Errorf("stopped: %w", context.Cause(fctx))
		return returned
	})
	require.Equal(t, returned, err, "MultiLock.Run returns fn's error as it is")
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.Empty(t, keys(t, cli, "runonce-multi-"))
}

// An error before the hold (bad input, ctx ended) comes back without fn.
func TestRunAcquireFails(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	s := session(t, c.Client(t))
	ctx := ctxT(t)
	called := false
	fn := func(context.Context) error { called = true; return nil }
	require.ErrorIs(t, etcdsync.NewSemaphore(s, "runbad", 1).Run(ctx, 2, fn), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "").RRun(ctx, fn), etcdsync.ErrInvalidName)
	ended, cancel := context.WithCancel(ctx)
	cancel()
	require.ErrorIs(t, etcdsync.NewMutex(s, "runbad").Run(ended, fn), context.Canceled)
	require.False(t, called)
}

// A Run inside a Run of the same session and name enters the outer hold at
// once (through the context, whichever value), sees its fencing token in
// HoldFrom, and only the outermost Run releases: one delete in all.
func TestRunReentrant(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	m, other := etcdsync.NewMutex(s, "reenter"), etcdsync.NewMutex(s, "reenter")
	wch := cli.Watch(ctx, "reenter/", clientv3.WithPrefix(), clientv3.WithFilterPut())
	var outerRev int64
	inner := make(chan struct{})
	go func() {
		defer close(inner)
		err := m.Run(ctx, func(ctx context.Context) error {
			_, rev, ok := etcdsync.HoldFrom(ctx)
			require.True(t, ok)
			outerRev = rev
			return m.Run(ctx, func(ctx context.Context) error {
				return other.Run(ctx, func(ctx context.Context) error {
					key, rev, ok := etcdsync.HoldFrom(ctx)
					require.True(t, ok)
					require.Equal(t, outerRev, rev)
					require.Equal(t, []string{key}, keys(t, cli, "reenter/"))
					return nil
				})
			})
		})
		require.NoError(t, err)
	}()
	within(t, inner, 5*time.Second, "nested Runs (a deadlock would hang)")
	require.Empty(t, keys(t, cli, "reenter/"))
	_, _, ok := etcdsync.HoldFrom(ctx)
	require.False(t, ok, "HoldFrom outside a Run")
	select {
	case wr := <-wch:
		require.Len(t, wr.Events, 1, "one delete: the outermost Run's release")
	case <-time.After(5 * time.Second):
		t.Fatal("no delete seen")
	}
}

// Goroutines that share a *Mutex but not a context exclude each other.
func TestRunSharedValueExcludes(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	ctx := ctxT(t)
	m := etcdsync.NewMutex(session(t, c.Client(t)), "runshared")
	var x exclusionCheck
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := 0; j < 3; j++ {
				require.NoError(t, m.Run(ctx, func(ctx context.Context) error {
					_, rev, _ := etcdsync.HoldFrom(ctx)
					x.enter(t, rev)
					time.Sleep(time.Millisecond) // widen the window an overlap would show in
					x.leave()
					return nil
				}))
			}
		}()
	}
	wg.Wait()
	require.Equal(t, 12, x.holds)
}

// RWMutex, Semaphore and mixed kinds: a read inside a write runs, a write
// inside a read (or more permits, or another kind on the same key) is an
// error wrapping ErrInvalidArgument at once, not a deadlock.
func TestRunReentrantKinds(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t))
	rw := etcdsync.NewRWMutex(s, "rerw")
	ran := 0
	count := func(context.Context) error { ran++; return nil }
	require.NoError(t, rw.Run(ctx, func(ctx context.Context) error {
		return rw.RRun(ctx, func(ctx context.Context) error { return rw.Run(ctx, count) })
	}))
	require.NoError(t, rw.RRun(ctx, func(ctx context.Context) error { return rw.RRun(ctx, count) }))
	err := rw.RRun(ctx, func(ctx context.Context) error { return rw.Run(ctx, count) })
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.Equal(t, 2, ran)

	sm := etcdsync.NewSemaphore(s, "resem", 3)
	require.NoError(t, sm.Run(ctx, 2, func(ctx context.Context) error { return sm.Run(ctx, 1, count) }))
	require.ErrorIs(t, sm.Run(ctx, 2, func(ctx context.Context) error { return sm.Run(ctx, 3, count) }), etcdsync.ErrInvalidArgument)

	e, m := etcdsync.NewElection(s, "remixed"), etcdsync.NewMutex(s, "remixed")
	require.ErrorIs(t, e.Run(ctx, "v", func(ctx context.Context) error { return m.Run(ctx, count) }), etcdsync.ErrInvalidArgument)
	// An RWMutex and a Mutex on one name use other keys: the inner one locks.
	require.NoError(t, etcdsync.NewRWMutex(s, "remixed").Run(ctx, func(ctx context.Context) error { return m.Run(ctx, count) }))
	require.Equal(t, 4, ran)
	for _, p := range []string{"rerw/", "resem/", "remixed/"} {
		require.Empty(t, keys(t, c.Client(t), p))
	}
}

// A hold lost while fn runs: cut off from etcd past the TTL, fn's context
// ends (ErrSessionExpired, ErrLostContact) before the server can give the
// lock to the next waiter; with the lease revoked or the key deleted, it
// ends with ErrNotHeld.
func TestRunLossCancelsFirst(t *testing.T) {
	t.Parallel()
	slow(t)
	c, admin, ctx := kitSingleClient(t)
	t.Run("cut off", func(t *testing.T) {
		cli, link := c.ClientThrough(t)
		s := session(t, cli, etcdsync.WithTTL(2*time.Second))
		m := etcdsync.NewMutex(s, "runcut")
		next := etcdsync.NewMutex(session(t, admin), "runcut")
		err, cause := fnEndsFirst(t, ctx, admin, "runcut/", 10*time.Second, m.Run, next.Lock, func() func() { link.Cut(); return link.Heal })
		require.ErrorIs(t, cause, etcdsync.ErrLostContact)
		require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
		require.ErrorIs(t, err, etcdsync.ErrLostContact)
		require.NoError(t, next.Unlock(ctx))
	})
	for _, tc := range []struct {
		name string
		end  func(s *etcdsync.Session, key string)
	}{
		{"lease revoked", func(s *etcdsync.Session, _ string) {
			_, err := admin.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		}},
		{"key deleted", func(_ *etcdsync.Session, key string) {
			_, err := admin.Delete(ctx, key)
			require.NoError(t, err)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := session(t, admin)
			err := etcdsync.NewMutex(s, "runend").Run(ctx, func(fctx context.Context) error {
				key, _, _ := etcdsync.HoldFrom(fctx)
				tc.end(s, key)
				within(t, fctx.Done(), 5*time.Second, "fn's context after "+tc.name)
				require.ErrorIs(t, context.Cause(fctx), etcdsync.ErrNotHeld)
				return nil
			})
			require.ErrorIs(t, err, etcdsync.ErrNotHeld)
		})
	}
}

// runKind is one primitive's Run, the prefix its keys live under, the
// release fn may call itself, and a contender of another session that gets
// the hold once ours ends.
type runKind struct {
	kind   string
	prefix string
	run    func(ctx context.Context, fn func(context.Context) error) error
	self   func(ctx context.Context) error
	next   func(s *etcdsync.Session) (take, release func(ctx context.Context) error)
}

func runKinds(s *etcdsync.Session, name string) []runKind {
	m := etcdsync.NewMutex(s, name+"-mutex")
	e := etcdsync.NewElection(s, name+"-election")
	rw := etcdsync.NewRWMutex(s, name+"-rwmutex")
	rr := etcdsync.NewRWMutex(s, name+"-rrun")
	sm := etcdsync.NewSemaphore(s, name+"-semaphore", 2)
	return []runKind{
		{"mutex", name + "-mutex/", m.Run, m.Unlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewMutex(s, name+"-mutex")
			return n.Lock, n.Unlock
		}},
		{"election", name + "-election/", func(ctx context.Context, fn func(context.Context) error) error { return e.Run(ctx, "v", fn) }, e.Resign,
			func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
				n := etcdsync.NewElection(s, name+"-election")
				return func(ctx context.Context) error { return n.Campaign(ctx, "next") }, n.Resign
			}},
		{"rwmutex", name + "-rwmutex/", rw.Run, rw.Unlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewRWMutex(s, name+"-rwmutex")
			return n.RLock, n.RUnlock
		}},
		{"rrun", name + "-rrun/", rr.RRun, rr.RUnlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewRWMutex(s, name+"-rrun")
			return n.Lock, n.Unlock
		}},
		{"semaphore", name + "-semaphore/", func(ctx context.Context, fn func(context.Context) error) error { return sm.Run(ctx, 2, fn) }, sm.Release,
			func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
				n := etcdsync.NewSemaphore(s, name+"-semaphore", 2)
				return func(ctx context.Context) error { return n.Acquire(ctx, 1) }, n.Release
			}},
	}
}

// runKindOf is the kind named kind of runKinds(s, name).
func runKindOf(s *etcdsync.Session, name, kind string) runKind {
	for _, k := range runKinds(s, name) {
		if k.kind == kind {
			return k
		}
	}
	panic(kind)
}

// fn that releases the hold itself: Run returns fn's error only, fn's
// context ends (ErrLockReleased), no key is left, and the value can Run again.
func TestRunFnMayReleaseItsHold(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	for _, k := range runKinds(s, "r13self") {
		t.Run(k.kind, func(t *testing.T) {
			err := k.run(ctx, func(fctx context.Context) error {
				require.NoError(t, k.self(ctx))
				within(t, fctx.Done(), 5*time.Second, "fn's context after its own release")
				require.ErrorIs(t, context.Cause(fctx), etcdsync.ErrLockReleased)
				return nil
			})
			require.NoError(t, err)
			require.Empty(t, keys(t, admin, k.prefix))
			require.NoError(t, k.run(ctx, func(context.Context) error { return nil }))
			require.Empty(t, keys(t, admin, k.prefix))
		})
	}
}

// Two RRuns of one RWMutex value from two goroutines share the read hold.
// When one fn ends its own share itself (RUnlock with fn's context, as
// RRun's doc asks), its Run must not end the other's share: the other fn
// still holds (the read key is there, its context has not ended).
func TestRRunSelfUnlockKeepsOtherShare(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	rw := etcdsync.NewRWMutex(session(t, admin), "r13share")
	bIn, aDone := make(chan struct{}), make(chan struct{})
	a := async(func() error {
		defer close(aDone)
		return rw.RRun(ctx, func(fctx context.Context) error {
			<-bIn
			return rw.RUnlock(fctx) // this fn's share
		})
	})
	b := async(func() error {
		return rw.RRun(ctx, func(fctx context.Context) error {
			close(bIn)
			<-aDone
			if len(keys(t, admin, "r13share/")) != 1 || fctx.Err() != nil {
				return fmt.Errorf("B's read hold ended while B's fn runs (cause %v)", context.Cause(fctx))
			}
			return nil
		})
	})
	require.NoError(t, resultWithin(t, a, 10*time.Second, "A"))
	require.NoError(t, resultWithin(t, b, 10*time.Second, "B"))
	require.Empty(t, keys(t, admin, "r13share/"))
}

// A second Run of the same value from another goroutine with an unrelated
// ctx excludes (waits for the first), for every exclusive kind.
func TestRunsOfOneValueExcludeAcrossGoroutines(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	for _, k := range runKinds(s, "r13second") {
		if k.kind == "rrun" {
			continue // reads share
		}
		t.Run(k.kind, func(t *testing.T) {
			aIn, aGo := make(chan struct{}), make(chan struct{})
			var inside atomic.Int32
			a := async(func() error {
				return k.run(ctx, func(context.Context) error {
					inside.Add(1)
					close(aIn)
					<-aGo
					inside.Add(-1)
					return nil
				})
			})
			within(t, aIn, 5*time.Second, "first Run")
			bRan := make(chan struct{})
			b := async(func() error {
				return k.run(context.Background(), func(context.Context) error {
					if inside.Load() != 0 {
						close(bRan)
						return errors.New("second Run's fn ran while the first's runs")
					}
					close(bRan)
					return nil
				})
			})
			select {
			case <-bRan:
				t.Errorf("%s: a second Run of the same value (unrelated ctx) ran fn while the first holds", k.kind)
			case <-time.After(time.Second):
			}
			close(aGo)
			assert.NoError(t, resultWithin(t, a, 10*time.Second, "first Run"))
			assert.NoError(t, resultWithin(t, b, 10*time.Second, "second Run"))
			require.Empty(t, keys(t, admin, k.prefix))
		})
	}
}

// fn releases its hold itself, then another goroutine's Run of the same
// value (unrelated ctx) takes a new hold: the first Run's end must not
// release that new hold.
func TestRunEndKeepsNewHoldAfterSelfRelease(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	for _, k := range runKinds(s, "r13relother") {
		if k.kind == "rrun" {
			continue // reads share: see TestRRunSelfUnlockKeepsOtherShare
		}
		t.Run(k.kind, func(t *testing.T) {
			bIn, aDone := make(chan struct{}), make(chan struct{})
			var b <-chan error
			a := async(func() error {
				defer close(aDone)
				return k.run(ctx, func(context.Context) error {
					if err := k.self(ctx); err != nil {
						return err
					}
					b = async(func() error {
						return k.run(context.Background(), func(fctx context.Context) error {
							close(bIn)
							<-aDone
							// No t here: this may run on after a failed test.
							resp, err := admin.Get(ctx, k.prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
							if err != nil || resp.Count != 1 || fctx.Err() != nil {
								return fmt.Errorf("B's hold ended when A's Run returned (err %v, cause %v)", err, context.Cause(fctx))
							}
							return nil
						})
					})
					select {
					case <-bIn:
					case <-time.After(5 * time.Second):
						return errors.New("B did not get the hold")
					}
					return nil
				})
			})
			require.NoError(t, resultWithin(t, a, 10*time.Second, "A"))
			require.NotNil(t, b)
			require.NoError(t, resultWithin(t, b, 10*time.Second, "B"))
		})
	}
}
