package tests

// Run: the hold while fn runs, fn's context ended with the cause the moment
// the hold ends (every way it can end, also cut off), the release after fn,
// and reentrancy (a Run inside fn enters the hold already there).

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
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
				require.Len(t, keys(t, cli, r.prefix), r.keys, "the hold's keys while fn runs")
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
			require.Equal(t, context.Canceled.Error(), err.Error(), "fn's error only")
			require.Empty(t, keys(t, cli, r.prefix))

			// A panic releases and goes on.
			require.PanicsWithValue(t, "boom", func() {
				r.run(ctx, func(context.Context) error {
					require.Len(t, keys(t, cli, r.prefix), r.keys, "the hold's keys while fn runs")
					panic("boom")
				})
			})
			require.Empty(t, keys(t, cli, r.prefix))
			require.NoError(t, r.run(ctx, func(context.Context) error { return nil }), "usable after")
			require.Empty(t, keys(t, cli, r.prefix))
		})
	}
}

// A session that lost contact while a Run's fn runs, closed once the link
// is back (as a program that replaces an ended session does, from another
// goroutine): fn was told at the local deadline, and the revoke, which
// frees the hold's keys, waits until fn returned, within the slack, so
// that a fn slow to stop never runs beside the next holder. (A live
// session's Close ends its Runs as the keys go: TestRunLossCarriesCauseEveryWay.)
func TestSessionClosedAfterLostContactWaitsForRunsBeforeRevoking(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	eachKindOnALink(t, "close-run", func(t *testing.T, ctx context.Context, admin *clientv3.Client, s *etcdsync.Session, link *etcdtest.Proxy, r runKind) {
		told, stop, ran := runSlowToStop(t, func(fn func(context.Context) error) error { return r.run(ctx, fn) })
		link.Blackhole(true)
		within(t, told, testTimeout, "fn told of the lost contact")
		require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
		link.Blackhole(false)
		closed := async(s.Close)
		notYet(t, closed, time.Second, "Close while fn runs, within the slack (5 s)") // a bounded look for a return that must not come
		require.Len(t, keys(t, admin, r.prefix), r.keys, "the hold's keys while fn runs")
		stop()
		require.NoError(t, resultWithin(t, closed, testTimeout, "Close"))
		require.ErrorIs(t, resultWithin(t, ran, testTimeout, "Run"), etcdsync.ErrLostContact)
		require.Empty(t, keys(t, admin, r.prefix), "the revoke after fn returned")
	})
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
	etcdtest.SkipSlowInShort(t)
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

// runKind is one primitive's Run, the prefix its keys live under (keys of
// them while it holds), the release fn may call itself, and a contender of
// another session that gets the hold once ours ends.
type runKind struct {
	kind   string
	prefix string
	keys   int
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
	ml := etcdsync.NewMultiLock(s, name+"-multilock/a", name+"-multilock/b")
	return []runKind{
		{"mutex", name + "-mutex/", 1, m.Run, m.Unlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewMutex(s, name+"-mutex")
			return n.Lock, n.Unlock
		}},
		{"election", name + "-election/", 1, func(ctx context.Context, fn func(context.Context) error) error { return e.Run(ctx, "v", fn) }, e.Resign,
			func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
				n := etcdsync.NewElection(s, name+"-election")
				return func(ctx context.Context) error { return n.Campaign(ctx, "next") }, n.Resign
			}},
		{"rwmutex", name + "-rwmutex/", 1, rw.Run, rw.Unlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewRWMutex(s, name+"-rwmutex")
			return n.RLock, n.RUnlock
		}},
		{"rrun", name + "-rrun/", 1, rr.RRun, rr.RUnlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewRWMutex(s, name+"-rrun")
			return n.Lock, n.Unlock
		}},
		{"semaphore", name + "-semaphore/", 1, func(ctx context.Context, fn func(context.Context) error) error { return sm.Run(ctx, 2, fn) }, sm.Release,
			func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
				n := etcdsync.NewSemaphore(s, name+"-semaphore", 2)
				return func(ctx context.Context) error { return n.Acquire(ctx, 1) }, n.Release
			}},
		{"multilock", name + "-multilock/", 2, ml.Run, ml.Unlock, func(s *etcdsync.Session) (func(context.Context) error, func(context.Context) error) {
			n := etcdsync.NewMutex(s, name+"-multilock/b") // a Mutex on one of the names excludes it
			return n.Lock, n.Unlock
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
							if err != nil || resp.Count != int64(k.keys) || fctx.Err() != nil {
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

// Cut off past the TTL while fn runs, for every kind: fn's context ends
// (ErrLostContact) before a contender of another session gets the hold, and
// Run's error carries the cause.
func TestRunCutOffEndsFnFirstEveryKind(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	for _, k := range runKinds(nil, "x") {
		t.Run(k.kind, func(t *testing.T) {
			ctx := ctxT(t)
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(2*time.Second))
			k := runKindOf(s, "r13bh", k.kind)
			take, release := k.next(session(t, admin))
			err, cause := fnEndsFirst(t, ctx, admin, k.prefix, 10*time.Second, k.run, take, func() func() {
				p.Blackhole(true)
				return func() { p.Blackhole(false) }
			})
			require.ErrorIs(t, cause, etcdsync.ErrLostContact)
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
			require.ErrorIs(t, err, etcdsync.ErrLostContact)
			require.NoError(t, release(ctx))
		})
	}
}

// fnEndsFirst runs run (a Run of a hold on prefix) with an fn that starts
// take (a contender of another session), waits until the contender's key
// is queued under prefix (as admin sees it), cuts the hold off with cut
// (and heals with what cut returns as fn returns), and waits at most d for
// fn's context to end. The contender must then hold, within d and not
// before fn's context ended. It returns Run's error and the cause fn's
// context ended with.
func fnEndsFirst(t *testing.T, ctx context.Context, admin *clientv3.Client, prefix string, d time.Duration,
	run func(ctx context.Context, fn func(context.Context) error) error, take func(ctx context.Context) error, cut func() (heal func())) (err, cause error) {
	t.Helper()
	gotAt := make(chan time.Time, 1)
	var cancelledAt time.Time
	err = run(ctx, func(fctx context.Context) error {
		held := len(keys(t, admin, prefix))
		go func() {
			if take(ctx) == nil {
				gotAt <- time.Now()
			}
		}()
		waitKeys(t, admin, prefix, held+1)
		heal := cut()
		defer heal()
		select {
		case <-fctx.Done():
			cancelledAt = time.Now()
		case <-time.After(d):
			t.Fatal("fn's context did not end")
		}
		cause = context.Cause(fctx)
		return nil
	})
	select {
	case got := <-gotAt:
		require.True(t, cancelledAt.Before(got), "fn's context ended %v, the contender held at %v", cancelledAt, got)
	case <-time.After(d):
		t.Fatal("the contender did not get the hold once the lease expired")
	}
	return err, cause
}

// Lease revoked, key deleted, Session Close and Orphan while fn runs, for
// every kind: fn's context ends with the cause, Run's error carries that
// very cause, and no key is left (but for Orphan, which leaves its keys to
// the lease).
func TestRunLossCarriesCauseEveryWay(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ways := []struct {
		name string
		end  func(t *testing.T, s *etcdsync.Session, prefix string)
		want error
	}{
		{"revoke", func(t *testing.T, s *etcdsync.Session, _ string) {
			_, err := admin.Revoke(ctxT(t), s.Lease())
			require.NoError(t, err)
		}, nil},
		{"delete", func(t *testing.T, _ *etcdsync.Session, prefix string) {
			_, err := admin.Delete(ctxT(t), prefix, clientv3.WithPrefix())
			require.NoError(t, err)
		}, etcdsync.ErrNotHeld},
		{"close", func(t *testing.T, s *etcdsync.Session, _ string) { require.NoError(t, s.Close()) }, etcdsync.ErrSessionClosed},
		{"orphan", func(t *testing.T, s *etcdsync.Session, _ string) { s.Orphan() }, etcdsync.ErrSessionClosed},
	}
	for _, w := range ways {
		for _, k0 := range runKinds(nil, "x") {
			t.Run(w.name+"/"+k0.kind, func(t *testing.T) {
				ctx := ctxT(t)
				s := session(t, admin)
				k := runKindOf(s, "r13loss-"+w.name, k0.kind)
				var cause error
				err := k.run(ctx, func(fctx context.Context) error {
					w.end(t, s, k.prefix)
					within(t, fctx.Done(), 5*time.Second, "fn's context after "+w.name)
					cause = context.Cause(fctx)
					return nil
				})
				if w.want != nil {
					require.ErrorIs(t, cause, w.want)
				} else if !errors.Is(cause, etcdsync.ErrNotHeld) && !errors.Is(cause, etcdsync.ErrSessionExpired) {
					t.Fatalf("cause after revoke: %v", cause)
				}
				require.Error(t, err)
				require.True(t, errors.Is(err, cause), "Run's error %v does not carry fn's cause %v", err, cause)
				require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
				if w.name == "orphan" {
					require.Len(t, keys(t, admin, k.prefix), k.keys, "Orphan leaves the keys to the lease")
					_, err := admin.Revoke(ctx, s.Lease())
					require.NoError(t, err)
				}
				require.Empty(t, keys(t, admin, k.prefix))
			})
		}
	}
}

// The release after fn: with ctx already ended and a slow link (replies
// delayed TTL/2), it still happens, within the TTL, leaving no key, and Run
// returns only fn's error.
func TestRunReleasesOverSlowLink(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	const ttl = 3 * time.Second
	for _, k0 := range runKinds(nil, "x") {
		t.Run(k0.kind, func(t *testing.T) {
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(ttl))
			k := runKindOf(s, "r13slow", k0.kind)
			ctx, cancel := context.WithCancel(ctxT(t))
			var returned time.Time
			err := k.run(ctx, func(fctx context.Context) error {
				p.SetLatency(ttl / 2)
				cancel()
				returned = time.Now()
				return fctx.Err()
			})
			took := time.Since(returned)
			p.SetLatency(0)
			require.ErrorIs(t, err, context.Canceled)
			require.Equal(t, context.Canceled.Error(), err.Error(), "only fn's error")
			require.Less(t, took, ttl, "release bounded by the TTL")
			require.Empty(t, keys(t, admin, k.prefix))
			require.NoError(t, s.Err(), "a slow link is not a lost one")
		})
	}
}

// The release after fn with the link blackholed as fn returns (ctx ended
// too): Run returns within about the TTL (not hanging on the release), says
// the hold is lost, and the key goes when the lease expires.
func TestRunReturnsWhenReleaseCutOff(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	const ttl = 2 * time.Second
	for _, kind := range []string{"mutex", "rrun", "semaphore"} {
		t.Run(kind, func(t *testing.T) {
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(ttl))
			k := runKindOf(s, "r13bhrel", kind)
			ctx, cancel := context.WithCancel(ctxT(t))
			var returned time.Time
			err := k.run(ctx, func(fctx context.Context) error {
				p.Blackhole(true)
				cancel()
				returned = time.Now()
				return nil
			})
			took := time.Since(returned)
			p.Blackhole(false)
			require.Less(t, took, ttl+time.Second, "Run bounded by the TTL")
			require.Error(t, err, "the release could not have happened")
			waitCount(t, admin, k.prefix, 3*ttl, func(have int) bool { return have == 0 })
		})
	}
}

// ownGoroutines lists the goroutines running the package's own code: the
// root package's, or internal/queue's (a hold's watch, a session's
// keepalive).
func ownGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		own := strings.Contains(g, "etcdsync/etcdsync.") || strings.Contains(g, "etcdsync/etcdsync/internal/queue.")
		// Tests paused in t.Parallel wait for this one (it runs alone).
		if own && !strings.Contains(g, "testing.(*T).Parallel") {
			out = append(out, g)
		}
	}
	return out
}

func noGoroutinesLeft(t *testing.T, what string, match string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for _, g := range ownGoroutines() {
			if strings.Contains(g, match) {
				left = append(left, g)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: goroutines left:\n%s", what, strings.Join(left, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond) // goroutine exit is not an event to wait on
	}
}

// No goroutine of a Run (its Done watch) outlives Run, after a release,
// after a loss, and none of the session after Close ends a Run's hold.
//
// It counts the process's goroutines, so it does not run in parallel.
func TestRunLeavesNoGoroutines(t *testing.T) {
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	for _, k := range runKinds(s, "r13leak") {
		require.NoError(t, k.run(ctx, func(context.Context) error { return nil }))
		require.Error(t, k.run(ctx, func(fctx context.Context) error {
			_, err := admin.Delete(ctx, k.prefix, clientv3.WithPrefix())
			require.NoError(t, err)
			<-fctx.Done()
			return nil
		}))
	}
	noGoroutinesLeft(t, "after Runs", "(*Hold).watchKey")

	s2, err := etcdsync.NewSession(admin)
	require.NoError(t, err)
	var wg sync.WaitGroup
	kinds := runKinds(s2, "r13leak2")
	in := make(chan struct{}, len(kinds))
	for _, k := range kinds {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.ErrorIs(t, k.run(ctx, func(fctx context.Context) error {
				in <- struct{}{}
				<-fctx.Done()
				return nil
			}), etcdsync.ErrSessionClosed)
		}()
	}
	for range kinds {
		within(t, in, 10*time.Second, "Runs starting")
	}
	require.NoError(t, s2.Close())
	wg.Wait()
	require.Empty(t, keys(t, admin, "r13leak2"))
	require.NoError(t, s.Close())
	noGoroutinesLeft(t, "after Close", "etcdsync/etcdsync")
}

// 3 members, Options.PeerProxies. The leader stopped while fn runs is no
// loss (fn's context stays, Run releases, no key left); the client's member
// cut off from its peers past the TTL is: fn's context ends before a
// contender on the majority gets the lock.
func TestRunLossOnThreeMembers(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	etcdtest.SkipClusterInShort(t, 3)
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	t.Run("leader stopped", func(t *testing.T) {
		ctx := ctxT(t)
		cli := c.Client(t)
		m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(5*time.Second)), "r13lead")
		err := m.Run(ctx, func(fctx context.Context) error {
			leader := c.Leader()
			require.NotNil(t, leader)
			c.Stop(leader)
			defer func() { require.NoError(t, c.Restart(leader)) }()
			for c.Leader() == nil { // no event to wait for: bounded by fctx
				if fctx.Err() != nil {
					return context.Cause(fctx)
				}
				time.Sleep(50 * time.Millisecond)
			}
			var err error
			for i := 0; i < 50; i++ {
				if _, err = m.Do(fctx, clientv3.OpPut("r13lead-data", "x")); err == nil {
					break
				}
				if errors.Is(err, etcdsync.ErrNotHeld) || fctx.Err() != nil {
					return err
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				return err
			}
			if fctx.Err() != nil {
				return fmt.Errorf("fn's context ended: %w", context.Cause(fctx))
			}
			return nil
		})
		require.NoError(t, err)
		require.Empty(t, keys(t, cli, "r13lead/"))
	})
	t.Run("member cut off", func(t *testing.T) {
		ctx := ctxT(t)
		var f *etcdtest.Member
		for _, m := range c.Members() {
			if m.Running() && !m.IsLeader() {
				f = m
			}
		}
		require.NotNil(t, f)
		var others []string
		for _, m := range c.Members() {
			if m != f {
				others = append(others, m.Endpoint())
			}
		}
		cli := etcdtest.NewClient(t, []string{f.Endpoint()})
		admin := etcdtest.NewClient(t, others)
		m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(3*time.Second)), "r13cut")
		next := etcdsync.NewMutex(session(t, admin, etcdsync.WithTTL(10*time.Second)), "r13cut")
		err, cause := fnEndsFirst(t, ctx, admin, "r13cut/", 15*time.Second, m.Run, next.Lock, func() func() {
			require.NoError(t, c.CutPeers(f))
			return func() { require.NoError(t, c.HealPeers(f)) }
		})
		require.ErrorIs(t, cause, etcdsync.ErrSessionExpired)
		require.True(t, errors.Is(err, cause), "Run's error %v lacks the cause %v", err, cause)
		require.NoError(t, next.Unlock(ctx))
	})
}

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

// A session closed as its local deadline passes, before its keepalive loop
// has ended it (Check answers ErrLostContact from the deadline on, and a
// program that acts on it closes the session; a loop running late): the
// session ends by the Close, not by lost contact, yet a Run's fn is told
// only then, past the deadline, and the revoke still waits for it, within
// the slack, as after lost contact.
func TestSessionClosedAsItsDeadlinePassesWaitsForRuns(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c, admin, ctx := singleClient(t)
	s, closeAtDeadline := lateLoopSession(t, c, etcdsync.WithTTL(2*time.Second), etcdsync.WithSlack(5*time.Second))
	const name = "close-at-deadline"
	m := etcdsync.NewMutex(s, name)
	told, stop, ran := runSlowToStop(t, func(fn func(context.Context) error) error { return m.Run(ctx, fn) })
	closed := closeAtDeadline()
	within(t, told, testTimeout, "fn told of the Close")
	notYet(t, closed, time.Second, "Close while fn runs, within the slack") // a bounded look for a return that must not come
	require.Len(t, keys(t, admin, name+"/"), 1, "the hold's key while fn runs")
	stop()
	require.NoError(t, resultWithin(t, closed, testTimeout, "Close"))
	require.Error(t, resultWithin(t, ran, testTimeout, "Run"))
	require.Empty(t, keys(t, admin, name+"/"), "the revoke after fn returned")
}

// lateLoopSession is a session on a client of c whose keepalives fail at
// once when closeAtDeadline is called, which then keeps the keepalive loop
// late (its logger stalls on a keepalive failure within 900 ms of the
// local deadline), calls Close in a goroutine once the deadline passed
// and Check says so, and returns Close's result once Close has ended the
// session (with ErrSessionClosed: before the loop could) and the loop
// runs again.
func lateLoopSession(t *testing.T, c *etcdtest.Cluster, opts ...etcdsync.SessionOption) (*etcdsync.Session, func() <-chan error) {
	t.Helper()
	var cut atomic.Bool
	cli := c.Client(t, grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if cut.Load() && strings.HasSuffix(method, "/LeaseKeepAlive") {
			return nil, status.Error(codes.Unknown, "test: keepalive cut")
		}
		return streamer(ctx, desc, cc, method, opts...)
	}))
	log := &lateLoopLog{stalled: make(chan struct{}), open: make(chan struct{})}
	s := session(t, cli, append(opts, etcdsync.WithLogger(slog.New(log)))...)
	log.s.Store(s)
	var once sync.Once
	open := func() { once.Do(func() { close(log.open) }) }
	t.Cleanup(open) // before the session's Close in the cleanup
	return s, func() <-chan error {
		t.Helper()
		cut.Store(true)
		within(t, log.stalled, testTimeout, "the keepalive loop stalled in its logger before the deadline")
		<-time.After(time.Until(s.Deadline())) // a clock event: the deadline itself
		require.ErrorIs(t, s.Check(), etcdsync.ErrLostContact, "Check past the deadline")
		require.NoError(t, s.Err(), "the loop, stalled, has not ended the session")
		closed := async(s.Close)
		within(t, s.Done(), testTimeout, "the session's end by Close")
		require.ErrorIs(t, s.Err(), etcdsync.ErrSessionClosed, "Close ended the session before the loop")
		cut.Store(false)
		open()
		return closed
	}
}

// lateLoopLog is a slog handler that stalls the session's keepalive loop
// on its first keepalive failure within 900 ms of the session's local
// deadline, until open closes: a loop running late (keepalive failures
// come every 500 ms while the keepalives fail at once).
type lateLoopLog struct {
	s       atomic.Pointer[etcdsync.Session]
	once    sync.Once
	stalled chan struct{}
	open    chan struct{}
}

func (h *lateLoopLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *lateLoopLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *lateLoopLog) WithGroup(string) slog.Handler            { return h }
func (h *lateLoopLog) Handle(_ context.Context, r slog.Record) error {
	s := h.s.Load()
	if s == nil || !strings.Contains(r.Message, "keepalive stream failed") || time.Until(s.Deadline()) > 900*time.Millisecond {
		return nil
	}
	stall := false
	h.once.Do(func() { stall = true; close(h.stalled) })
	if stall {
		<-h.open
	}
	return nil
}

// runSlowToStop starts run with a fn that, once its context ends (told
// closes), returns only when stop is called (t's cleanup calls it too):
// a fn slow to stop. It returns once fn has started, with run's result
// to come on ran.
func runSlowToStop(t *testing.T, run func(fn func(context.Context) error) error) (told <-chan struct{}, stop func(), ran <-chan error) {
	t.Helper()
	started, toldc, proceed := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	stop = func() { once.Do(func() { close(proceed) }) }
	t.Cleanup(stop)
	ran = async(func() error {
		return run(func(fctx context.Context) error {
			close(started)
			<-fctx.Done()
			close(toldc)
			<-proceed
			return context.Cause(fctx)
		})
	})
	within(t, started, testTimeout, "fn's start")
	return toldc, stop, ran
}

// eachKindOnALink runs f for each kind of runKinds on name, in parallel,
// each on a session of its own (TTL 2 s, slack 5 s) of a single member
// reached through link, which f may cut; admin reads the keys.
func eachKindOnALink(t *testing.T, name string, f func(t *testing.T, ctx context.Context, admin *clientv3.Client, s *etcdsync.Session, link *etcdtest.Proxy, r runKind)) {
	t.Helper()
	c, admin, _ := singleClient(t)
	for _, kind := range runKinds(session(t, admin), name) {
		t.Run(kind.kind, func(t *testing.T) {
			t.Parallel()
			s, link := proxiedSession(t, c, 0, etcdsync.WithTTL(2*time.Second), etcdsync.WithSlack(5*time.Second))
			f(t, ctxT(t), admin, s, link, runKindOf(s, name, kind.kind))
		})
	}
}

// Runs that returned before the session lost contact (also by a panic, a
// Run inside fn entering the hold, a Run refused after the session's end)
// are not waited for: Close after lost contact revokes at once, not at the
// end of the slack (none stays counted).
func TestSessionClosedAfterLostContactWaitsForNoReturnedRun(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	eachKindOnALink(t, "close-none", func(t *testing.T, ctx context.Context, admin *clientv3.Client, s *etcdsync.Session, link *etcdtest.Proxy, r runKind) {
		require.NoError(t, r.run(ctx, func(fctx context.Context) error {
			return r.run(fctx, func(context.Context) error { return nil }) // enters the hold
		}))
		require.Panics(t, func() { _ = r.run(ctx, func(context.Context) error { panic("fn") }) })
		require.Error(t, r.run(ctx, func(context.Context) error { return errors.New("fn") }))
		link.Blackhole(true)
		within(t, s.Done(), testTimeout, "the session's end by lost contact")
		require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
		require.Error(t, r.run(ctx, func(context.Context) error { t.Error("fn ran on an ended session"); return nil }))
		link.Blackhole(false)
		start := time.Now()
		require.NoError(t, s.Close())
		require.Less(t, time.Since(start), 2*time.Second, "Close waited for Runs that had returned (slack 5 s)")
		require.Empty(t, keys(t, admin, r.prefix))
	})
}

// Close called inside a Run's fn after lost contact waits for that fn,
// its own caller, no longer than the slack's rest (until the server could
// expire the lease anyway), then revokes: no deadlock.
func TestSessionClosedInsideFnAfterLostContactWaitsTheSlackAtMost(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c, admin, ctx := singleClient(t)
	const slack = 3 * time.Second
	s, link := proxiedSession(t, c, 0, etcdsync.WithTTL(2*time.Second), etcdsync.WithSlack(slack))
	const name = "close-inside-lost"
	var closedAt, end time.Time
	err := etcdsync.NewMutex(s, name).Run(ctx, func(fctx context.Context) error {
		link.Blackhole(true)
		within(t, fctx.Done(), testTimeout, "fn told of the lost contact")
		require.ErrorIs(t, context.Cause(fctx), etcdsync.ErrLostContact)
		link.Blackhole(false)
		end = s.Deadline().Add(slack)
		require.NoError(t, resultWithin(t, async(s.Close), slack+testTimeout, "Close inside fn"))
		closedAt = time.Now()
		return nil
	})
	require.ErrorIs(t, err, etcdsync.ErrLostContact)
	require.False(t, closedAt.Before(end), "Close inside fn returned before the slack's end: it did not wait for fn")
	require.Less(t, closedAt.Sub(end), 2*time.Second, "Close inside fn waited past the slack's end")
	require.Empty(t, keys(t, admin, name+"/"))
}
