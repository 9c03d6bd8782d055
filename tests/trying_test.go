package tests

// Try forms and the cost of calls: TryRun of every primitive and TryCampaign
// never queue; when the name is taken they return ErrLocked in one RPC that
// writes nothing, leave no key and do not run fn; when it is free they hold,
// run fn and release. A call on an ended context sends nothing.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// tryCase is a primitive's try form on a name that take (on another session)
// has taken.
type tryCase struct {
	name string
	take func(ctx context.Context, s *etcdsync.Session, name string) error
	try  func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error
}

var tryCases = []tryCase{
	{"Mutex.TryRun",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewMutex(s, name).Lock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewMutex(s, name).TryRun(ctx, fn)
		}},
	{"RWMutex.TryRun under a reader",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewRWMutex(s, name).RLock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRun(ctx, fn)
		}},
	{"RWMutex.TryRRun under a writer",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewRWMutex(s, name).Lock(ctx)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRRun(ctx, fn)
		}},
	{"Semaphore.TryRun without room",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewSemaphore(s, name, 3).Acquire(ctx, 2)
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewSemaphore(s, name, 3).TryRun(ctx, 2, fn)
		}},
	{"Election.TryRun",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewElection(s, name).Campaign(ctx, "leader")
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			return etcdsync.NewElection(s, name).TryRun(ctx, "v", fn)
		}},
	{"Election.TryCampaign",
		func(ctx context.Context, s *etcdsync.Session, name string) error {
			return etcdsync.NewElection(s, name).Campaign(ctx, "leader")
		},
		func(ctx context.Context, s *etcdsync.Session, name string, fn func(context.Context) error) error {
			e := etcdsync.NewElection(s, name)
			if err := e.TryCampaign(ctx, "v"); err != nil {
				return err
			}
			fn(ctx)
			return e.Resign(ctx)
		}},
}

// On a taken name a try form costs one RPC, writes nothing, leaves no key and
// does not run fn; once the name is free it runs fn while holding, and
// releases after.
func TestTryFormsNeverQueue(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	ctx := ctxT(t)
	for _, tc := range tryCases {
		t.Run(tc.name, func(t *testing.T) {
			name := "try-" + t.Name()
			holder := session(t, cli)
			require.NoError(t, tc.take(ctx, holder, name))
			held := keys(t, cli, name+"/")
			s := session(t, cli)
			before, err := cli.Get(ctx, "x")
			require.NoError(t, err)
			cnt.take()
			ran := false
			err = tc.try(ctx, s, name, func(context.Context) error { ran = true; return nil })
			n, methods := cnt.take()
			require.ErrorIs(t, err, etcdsync.ErrLocked)
			require.False(t, ran, "fn ran on a taken name")
			require.Equal(t, int64(1), n, "RPCs: %v", methods)
			after, err := cli.Get(ctx, "x")
			require.NoError(t, err)
			require.Equal(t, before.Header.Revision, after.Header.Revision, "a try on a taken name wrote")
			require.Equal(t, held, keys(t, cli, name+"/"))

			require.NoError(t, holder.Close())
			err = tc.try(ctx, s, name, func(ctx context.Context) error {
				ran = true
				require.Len(t, keys(t, cli, name+"/"), 1, "fn runs while holding")
				return nil
			})
			require.NoError(t, err)
			require.True(t, ran)
			require.Empty(t, keys(t, cli, name+"/"), "released after fn")
		})
	}
}

// TryCampaign on a value that leads is ErrLocked and keeps the term; a TryRun
// inside a Run's context enters the hold the context carries.
func TestTryFormsOnOwnHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "try-own")
	require.NoError(t, e.Campaign(ctx, "a"))
	rev := e.Rev()
	require.ErrorIs(t, e.TryCampaign(ctx, "b"), etcdsync.ErrLocked)
	require.Equal(t, rev, e.Rev(), "the term goes on")
	require.NoError(t, e.Resign(ctx))

	m := etcdsync.NewMutex(s, "try-own-m")
	inner := false
	require.NoError(t, m.Run(ctx, func(ctx context.Context) error {
		return etcdsync.NewMutex(s, "try-own-m").TryRun(ctx, func(context.Context) error {
			inner = true
			return nil
		})
	}))
	require.True(t, inner)
	require.Empty(t, keys(t, cli, "try-own-m/"))
}

// A try whose ctx ends at any point (before, during or right after its one
// RPC) either holds (and then releases) or leaves nothing: once the session
// has settled, only the other holder's key is left, and fn never ran
// without the hold.
func TestTryFormsCancelledAtEveryStepLeaveNoKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	rng := rand.New(rand.NewPCG(3, 3))
	type try struct {
		name string
		do   func(ctx context.Context, name string, fn func(context.Context) error) error
		hold func(t *testing.T, name string) func() // another session holds name; returns its release (t: the subtest's)
	}
	other := session(t, cli)
	tries := []try{
		{"election", func(ctx context.Context, name string, fn func(context.Context) error) error {
			return etcdsync.NewElection(s, name).TryRun(ctx, "v", fn)
		}, func(t *testing.T, name string) func() {
			e := etcdsync.NewElection(other, name)
			require.NoError(t, e.Campaign(ctx, "o"))
			return func() { require.NoError(t, e.Resign(ctx)) }
		}},
		{"trycampaign", func(ctx context.Context, name string, fn func(context.Context) error) (err error) {
			e := etcdsync.NewElection(s, name)
			if err := e.TryCampaign(ctx, "v"); err != nil {
				return err
			}
			defer func() { err = errors.Join(err, e.Resign(context.Background())) }()
			return fn(ctx)
		}, func(t *testing.T, name string) func() {
			e := etcdsync.NewElection(other, name)
			require.NoError(t, e.Campaign(ctx, "o"))
			return func() { require.NoError(t, e.Resign(ctx)) }
		}},
		{"mutex", func(ctx context.Context, name string, fn func(context.Context) error) error {
			return etcdsync.NewMutex(s, name).TryRun(ctx, fn)
		}, func(t *testing.T, name string) func() {
			m := etcdsync.NewMutex(other, name)
			require.NoError(t, m.Lock(ctx))
			return func() { require.NoError(t, m.Unlock(ctx)) }
		}},
		{"rwmutex-w", func(ctx context.Context, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRun(ctx, fn)
		}, func(t *testing.T, name string) func() {
			m := etcdsync.NewRWMutex(other, name)
			require.NoError(t, m.RLock(ctx))
			return func() { require.NoError(t, m.RUnlock(ctx)) }
		}},
		{"rwmutex-r", func(ctx context.Context, name string, fn func(context.Context) error) error {
			return etcdsync.NewRWMutex(s, name).TryRRun(ctx, fn)
		}, func(t *testing.T, name string) func() {
			m := etcdsync.NewRWMutex(other, name)
			require.NoError(t, m.Lock(ctx))
			return func() { require.NoError(t, m.Unlock(ctx)) }
		}},
		{"semaphore", func(ctx context.Context, name string, fn func(context.Context) error) error {
			return etcdsync.NewSemaphore(s, name, 2).TryRun(ctx, 2, fn)
		}, func(t *testing.T, name string) func() {
			m := etcdsync.NewSemaphore(other, name, 2)
			require.NoError(t, m.Acquire(ctx, 1))
			return func() { require.NoError(t, m.Release(ctx)) }
		}},
	}
	for _, tr := range tries {
		t.Run(tr.name, func(t *testing.T) {
			won := 0
			for i := range 60 {
				name := fmt.Sprintf("trycancel-%s-%d", tr.name, i)
				held := i%3 == 0
				var release func()
				if held {
					release = tr.hold(t, name)
				}
				d := time.Duration(rng.IntN(1500)) * time.Microsecond
				tctx, cancel := context.WithTimeout(ctx, d)
				ran := false
				err := tr.do(tctx, name, func(fctx context.Context) error {
					ran = true
					if held {
						return errors.New("fn ran while another held the name")
					}
					return nil
				})
				cancel()
				if held {
					require.False(t, ran, "round %d: %v", i, err)
					require.Error(t, err)
				}
				if err == nil {
					require.True(t, ran)
				}
				if held {
					// Only the holder's key is left, once the session settles.
					waitCount(t, cli, name+"/", testTimeout, func(have int) bool { return have == 1 })
					release()
				}
				waitNoKeys(t, cli, name+"/")
				if err == nil {
					won++
				}
			}
			t.Logf("%d of 60 tries held", won)
		})
	}
}

// Check of each primitive answers an error once the hold ends by release,
// by an admin's delete of the key, and by the session's end.
func TestCheckAfterEveryEnd(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	type prim struct {
		name string
		take func(s *etcdsync.Session, name string) (check func() error, release func() error)
	}
	prims := []prim{
		{"mutex", func(s *etcdsync.Session, name string) (func() error, func() error) {
			m := etcdsync.NewMutex(s, name)
			require.NoError(t, m.Lock(ctx))
			return m.Check, func() error { return m.Unlock(ctx) }
		}},
		{"election", func(s *etcdsync.Session, name string) (func() error, func() error) {
			e := etcdsync.NewElection(s, name)
			require.NoError(t, e.Campaign(ctx, "v"))
			return e.Check, func() error { return e.Resign(ctx) }
		}},
		{"rwmutex-read", func(s *etcdsync.Session, name string) (func() error, func() error) {
			m := etcdsync.NewRWMutex(s, name)
			require.NoError(t, m.RLock(ctx))
			return m.Check, func() error { return m.RUnlock(ctx) }
		}},
		{"rwmutex-write", func(s *etcdsync.Session, name string) (func() error, func() error) {
			m := etcdsync.NewRWMutex(s, name)
			require.NoError(t, m.Lock(ctx))
			return m.Check, func() error { return m.Unlock(ctx) }
		}},
		{"semaphore", func(s *etcdsync.Session, name string) (func() error, func() error) {
			m := etcdsync.NewSemaphore(s, name, 3)
			require.NoError(t, m.Acquire(ctx, 2))
			return m.Check, func() error { return m.Release(ctx) }
		}},
	}
	for _, p := range prims {
		t.Run(p.name, func(t *testing.T) {
			for _, end := range []string{"release", "delete", "revoke", "close"} {
				name := "check-" + p.name + "-" + end
				s := session(t, cli)
				check, release := p.take(s, name)
				require.NoError(t, check())
				require.NoError(t, s.Check())
				switch end {
				case "release":
					require.NoError(t, release())
					require.Error(t, check())
				case "delete":
					_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
					require.NoError(t, err)
					deadline := time.Now().Add(testTimeout)
					for check() == nil {
						require.True(t, time.Now().Before(deadline), "Check still nil after the key was deleted")
						time.Sleep(10 * time.Millisecond)
					}
				case "revoke":
					_, err := admin.Revoke(ctx, s.Lease())
					require.NoError(t, err)
					within(t, s.Done(), testTimeout, "the session ends")
					require.Error(t, check()) // why: the key went (first seen), or the lease
					require.ErrorIs(t, s.Check(), etcdsync.ErrSessionExpired)
				case "close":
					require.NoError(t, s.Close())
					require.ErrorIs(t, check(), etcdsync.ErrSessionClosed)
					require.ErrorIs(t, s.Check(), etcdsync.ErrSessionClosed)
				}
				waitNoKeys(t, admin, name+"/")
			}
		})
	}
}

// TryCampaign on a name that someone leads and others wait on: one RPC, no
// write (the store's revision does not move), no key; on its own leading
// value: ErrLocked with no RPC at all; with only non-candidate keys under
// the name (nested, not hex) it leads.
func TestTryCampaignCostsOneRPCNoWrite(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	cnt := &counter{}
	cli := c.Client(t, cnt.dial()...)
	s := session(t, cli)
	lead := etcdsync.NewElection(session(t, admin), "try-cost")
	require.NoError(t, lead.Campaign(ctx, "l"))
	wait := etcdsync.NewElection(session(t, admin), "try-cost")
	waiting := campaignAsync(ctx, wait, "w")
	waitKeys(t, admin, "try-cost/", 2)
	before, err := admin.Get(ctx, "x")
	require.NoError(t, err)
	e := etcdsync.NewElection(s, "try-cost")
	cnt.take()
	require.ErrorIs(t, e.TryCampaign(ctx, "e"), etcdsync.ErrLocked)
	n, methods := cnt.take()
	require.Equal(t, int64(1), n, "%v", methods)
	after, err := admin.Get(ctx, "x")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "a failed TryCampaign wrote")
	require.Len(t, keys(t, admin, "try-cost/"), 2)

	require.NoError(t, lead.Resign(ctx))
	require.NoError(t, resultWithin(t, waiting, testTimeout, "the waiter leads"))
	require.NoError(t, wait.Resign(ctx))
	_, err = admin.Put(ctx, "try-cost/nested/x", "n")
	require.NoError(t, err)
	_, err = admin.Put(ctx, "try-cost/zz", "n")
	require.NoError(t, err)
	require.NoError(t, e.TryCampaign(ctx, "e"), "non-candidate keys do not lead")
	cnt.take()
	require.ErrorIs(t, e.TryCampaign(ctx, "e2"), etcdsync.ErrLocked, "its own leading value")
	n, methods = cnt.take()
	require.Zero(t, n, "%v", methods)
	require.Equal(t, "e", leaderValue(t, e))
	require.NoError(t, e.Resign(ctx))
	_, err = admin.Delete(ctx, "try-cost/", clientv3.WithPrefix())
	require.NoError(t, err)
}

// Lock, TryLock and Campaign on an ended context send nothing.
func TestEndedContextSendsNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	s := session(t, c.Client(t, cnt.dial()...))
	m := etcdsync.NewMutex(s, "ended")
	e := etcdsync.NewElection(s, "ended")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	cnt.take()
	streams := cnt.streams.Load()
	for _, ctx := range []context.Context{cancelled, expired} {
		require.ErrorIs(t, m.Lock(ctx), ctx.Err())
		require.ErrorIs(t, m.TryLock(ctx), ctx.Err())
		require.ErrorIs(t, e.Campaign(ctx, "v"), ctx.Err())
	}
	n, methods := cnt.take()
	require.Zero(t, n, "RPCs sent on an ended context: %v", methods)
	require.Equal(t, streams, cnt.streams.Load(), "streams opened on an ended context")
	require.Empty(t, keys(t, c.Client(t), "ended/"))
}

// Costs of the try calls: TryAcquire on a free name 1 RPC; with permits
// taken but enough free 2; with too few free 1 RPC and no write; TryRLock
// beside readers 1 RPC.
func TestTryCallCosts(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var cnt counter
	cli := c.Client(t, cnt.dial()...)
	sm := etcdsync.NewSemaphore(session(t, cli), "r12cost", 3)
	other := etcdsync.NewSemaphore(session(t, admin), "r12cost", 3)
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m := cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire on a free name: %v", m)
	require.NoError(t, sm.Release(ctx))
	require.NoError(t, other.Acquire(ctx, 1))
	cnt.take()
	require.NoError(t, sm.TryAcquire(ctx, 2))
	n, m = cnt.take()
	require.Equal(t, int64(2), n, "TryAcquire beside a hold: %v", m)
	require.NoError(t, sm.Release(ctx))
	cnt.take()
	rev := storeRev(t, admin)
	require.ErrorIs(t, sm.TryAcquire(ctx, 3), etcdsync.ErrLocked)
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryAcquire with too few free: %v", m)
	require.Equal(t, rev, storeRev(t, admin), "a failed TryAcquire wrote")
	require.NoError(t, other.Release(ctx))

	r1 := etcdsync.NewRWMutex(session(t, admin), "r12costrw")
	require.NoError(t, r1.RLock(ctx))
	r2 := etcdsync.NewRWMutex(session(t, cli), "r12costrw")
	cnt.take()
	require.NoError(t, r2.TryRLock(ctx))
	n, m = cnt.take()
	require.Equal(t, int64(1), n, "TryRLock beside a reader: %v", m)
	require.NoError(t, r2.RUnlock(ctx))
	require.NoError(t, r1.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12cost"))
}

// Failing try calls cost one RPC and write nothing: TryRLock with a writer
// holding or waiting, TryLock beside a reader, TryAcquire with someone
// waiting ahead; a TryRLock on a session whose read hold is being released
// sends nothing.
func TestFailingTryCallsCostOneRPC(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		admin := c.Client(t)
		ctx := ctxT(t)
		var cnt counter
		cli := c.Client(t, cnt.dial()...)
		check := func(what string, f func() error) {
			t.Helper()
			rev := storeRev(t, admin)
			cnt.take()
			require.ErrorIs(t, f(), etcdsync.ErrLocked, what)
			n, m := cnt.take()
			require.Equal(t, int64(1), n, "%s: %v", what, m)
			require.Equal(t, rev, storeRev(t, admin), "%s wrote", what)
		}
		w := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, w.Lock(ctx))
		rw := etcdsync.NewRWMutex(session(t, cli), "r12bcost")
		check("TryRLock with a writer holding", func() error { return rw.TryRLock(ctx) })
		check("TryLock with a writer holding", func() error { return rw.TryLock(ctx) })
		require.NoError(t, w.Unlock(ctx))

		r := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, r.RLock(ctx))
		w2 := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		w2got := async(func() error { return w2.Lock(ctx) })
		waitKeys(t, admin, "r12bcost/", 2)
		check("TryRLock with a writer waiting", func() error { return rw.TryRLock(ctx) })
		check("TryLock beside a reader", func() error { return rw.TryLock(ctx) })
		require.NoError(t, r.RUnlock(ctx))
		require.NoError(t, resultWithin(t, w2got, testTimeout, "w2"))
		require.NoError(t, w2.Unlock(ctx))

		h := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		require.NoError(t, h.Acquire(ctx, 3))
		q := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		qgot := async(func() error { return q.Acquire(ctx, 1) })
		waitKeys(t, admin, "r12bcostsem/", 2)
		sm := etcdsync.NewSemaphore(session(t, cli), "r12bcostsem", 3)
		check("TryAcquire with a waiter ahead", func() error { return sm.TryAcquire(ctx, 1) })
		m := etcdsync.NewMutex(session(t, cli), "r12bcostsem")
		check("Mutex TryLock on a semaphore's name", func() error { return m.TryLock(ctx) })
		require.NoError(t, h.Release(ctx))
		require.NoError(t, resultWithin(t, qgot, testTimeout, "q"))
		require.NoError(t, q.Release(ctx))
		require.Empty(t, keys(t, admin, "r12bcost"))
	})
}
