package tests

// Exclusion and fencing: a turn is granted only once every key ahead is
// gone, however the deletes arrive (together, before the watches exist, on a
// broken stream) — Invariant "Exclusion"; guards and headers of holds, and a
// guarded Do that a lagging member cannot answer stale.

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// contender is a Mutex or an Election, seen as "acquire, release, hold".
type contender struct {
	kind    string
	acquire func(context.Context) error
	release func(context.Context) error
	done    func() <-chan struct{}
	err     func() error
}

func contenders(s *etcdsync.Session, name string) []contender {
	m := etcdsync.NewMutex(s, name)
	e := etcdsync.NewElection(s, name)
	return []contender{
		{kind: "mutex", acquire: m.Lock, release: m.Unlock, done: m.Done, err: m.Err},
		{kind: "election", acquire: func(ctx context.Context) error { return e.Campaign(ctx, "v") }, release: e.Resign, done: e.Done, err: e.Err},
	}
}

// When the holder's and a waiter's keys go in one revision (a prefix
// delete), the server may send the holder's delete to the waiter first. The
// waiter must see that its own key went too and never acquire
// (etcd-io/etcd#11456: a lock was reported held without a check that the
// waiter's own key and lease still lived). Invariants "Exclusion" and
// "Own loss".
func TestPrefixDeleteGrantsNobody(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		const trials = 20
		for i := 0; i < trials; i++ {
			for k := range 2 {
				name := fmt.Sprintf("pfx-%d-%d", i, k)
				holder := contenders(session(t, admin), name)[k]
				require.NoError(t, holder.acquire(ctx))
				cnt := counter{created: make(chan struct{}, 2)}
				w := contenders(session(t, c.Client(t, cnt.dial()...)), name)[k]
				errc := async(func() error { return w.acquire(ctx) })
				// The waiter watches the prefix: the holder's key is all it waits for.
				within(t, cnt.created, testTimeout, "waiter's watch created")
				_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
				require.NoError(t, err)
				err = resultWithin(t, errc, 5*time.Second, fmt.Sprintf("trial %d %s: waiter after its key was deleted", i, w.kind))
				require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "trial %d %s: the waiter acquired although its key was deleted", i, w.kind)
				require.Empty(t, keys(t, admin, name+"/"))
			}
		}
	})
}

// Predecessor and second-nearest deleted in one Txn: the third waiter gets
// two deletes at one revision; whichever arrives first takes the no-read
// branch, the second confirms. It must hold (the RPCs it made are logged;
// TestNoRPCOnTheCriticalPath asserts none).
func TestTurnWhenPredecessorAndSecondGoTogether(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for round := range 8 {
		t.Run(fmt.Sprint(round), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("r11same%d", round)
			held := make(chan struct{}, 2)
			var holding, atHold atomic.Int64
			holder, qs := enqueueBehind(t, ctx, c, admin, name, 2, func(q *queued) error {
				if holding.Add(1) != 1 {
					t.Errorf("waiter %d holds with another", q.i)
				}
				held <- struct{}{}
				if q.i == 1 {
					atHold.Store(q.cnt.unary.Load())
				}
				holding.Add(-1)
				return q.m.Unlock(ctx)
			})
			before := qs[1].cnt.unary.Load()
			_, err := admin.Txn(ctx).Then(clientv3.OpDelete(holder.Key()), clientv3.OpDelete(keyOf(name, qs[0].s))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, resultWithin(t, qs[0].err, testTimeout, "deleted waiter 0"), etcdsync.ErrSessionExpired)
			require.NoError(t, resultWithin(t, qs[1].err, testTimeout, "third waiter (waiter 1)"))
			t.Logf("waiter 1: %d unary RPCs between the delete and its hold", atHold.Load()-before)
			require.Empty(t, keys(t, admin, name+"/"))
		})
	}
}

// Keys ahead deleted between the waiter's read and the creation of their
// watches: the creation response is past the read, so it must read again.
// (a) both keys ahead go: it must hold. (b) only the second-nearest goes:
// it must wait for its predecessor, then hold.
func TestTurnWhenAheadGoBeforeWatchesCreated(t *testing.T) {
	t.Parallel()
	for _, both := range []bool{true, false} {
		t.Run(fmt.Sprintf("both=%v", both), func(t *testing.T) {
			c, admin, ctx := singleClient(t)
			name := "r11gate"
			holder := heldMutex(t, ctx, admin, name)
			ps := session(t, admin)
			pred := etcdsync.NewMutex(ps, name)
			predErr := async(func() error { return pred.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2)
			g := faults.NewGatedClient()
			ws := session(t, c.Client(t, g.Dial()))
			g.Own.Store(keyOf(name, ws))
			g.Armed.Store(true)
			w := etcdsync.NewMutex(ws, name)
			werr := async(func() error { return w.Lock(ctx) })
			within(t, g.Held, testTimeout, "a watch create of a key ahead held back")
			if both {
				_, err := admin.Txn(ctx).Then(clientv3.OpDelete(holder.Key()), clientv3.OpDelete(keyOf(name, ps))).Commit()
				require.NoError(t, err)
			} else {
				require.NoError(t, holder.Unlock(ctx))
				require.NoError(t, resultWithin(t, predErr, testTimeout, "pred's Lock"))
			}
			g.Armed.Store(false)
			close(g.Open)
			if !both {
				notYet(t, werr, 2*time.Second, "waiter while its predecessor holds")
				require.NoError(t, pred.Unlock(ctx))
			} else {
				require.ErrorIs(t, resultWithin(t, predErr, testTimeout, "pred"), etcdsync.ErrSessionExpired)
			}
			require.NoError(t, resultWithin(t, werr, testTimeout, "waiter while nothing blocks it"))
			require.NoError(t, w.Unlock(ctx))
		})
	}
}

// Invariant "Nested names" (a holder of NAME/x never blocks NAME) against the recipe
// layout: a Mutex on "NAME/write" holds the key NAME/write/<hex>, which is a
// writer of the RWMutex NAME; the documented exception. A Mutex on NAME/x
// for another x does not block it.
func TestNestedNamesExceptRWMutexWriteDir(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	m := heldMutex(t, ctx, c.Client(t), "r12nest/write")
	rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "r12nest")
	require.ErrorIs(t, rw.TryRLock(ctx), etcdsync.ErrLocked, "a Mutex on r12nest/write is a writer of r12nest")
	require.NoError(t, m.Unlock(ctx))
	other := heldMutex(t, ctx, c.Client(t), "r12nest/other")
	require.NoError(t, rw.TryLock(ctx), "a Mutex on r12nest/other does not block r12nest")
	require.NoError(t, rw.Unlock(ctx))
	require.NoError(t, other.Unlock(ctx))
}

// Keys ahead deleted (in one revision) after a waiter's enqueue was applied
// but before its reply arrived and its watches exist: the waiter holds.
func TestTurnWhenAheadGoBeforeEnqueueReply(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	c, admin, ctx := singleClient(t)
	t.Run("semaphore", func(t *testing.T) {
		a := etcdsync.NewSemaphore(session(t, admin), "r12early", 3)
		require.NoError(t, a.Acquire(ctx, 2))
		b := etcdsync.NewSemaphore(session(t, admin), "r12early", 3)
		require.NoError(t, b.Acquire(ctx, 1))
		cli, p := faults.Proxied(t, c)
		sm := etcdsync.NewSemaphore(session(t, cli), "r12early", 3)
		p.SetLatency(time.Second)
		defer p.SetLatency(0)
		got := async(func() error { return sm.Acquire(ctx, 3) })
		waitKeys(t, admin, "r12early/", 3)
		_, err := admin.Txn(ctx).Then(clientv3.OpDelete(a.Key()), clientv3.OpDelete(b.Key())).Commit()
		require.NoError(t, err)
		require.NoError(t, resultWithin(t, got, testTimeout, "waiter whose keys ahead went before its watches"))
		p.SetLatency(0)
		require.NoError(t, sm.Release(ctx))
	})
	t.Run("reader", func(t *testing.T) {
		_, _, w2got := writerAndWaiter(t, ctx, ctx, admin, "r12earlyrw")
		cli, p := faults.Proxied(t, c)
		rw := etcdsync.NewRWMutex(session(t, cli), "r12earlyrw")
		p.SetLatency(time.Second)
		defer p.SetLatency(0)
		got := async(func() error { return rw.RLock(ctx) })
		waitKeys(t, admin, "r12earlyrw/", 3)
		_, err := admin.Delete(ctx, "r12earlyrw/write/", clientv3.WithPrefix())
		require.NoError(t, err)
		require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "deleted writer"), etcdsync.ErrSessionExpired)
		require.NoError(t, resultWithin(t, got, testTimeout, "reader whose writers ahead went before its watches"))
		p.SetLatency(0)
		require.NoError(t, rw.RUnlock(ctx))
	})
}

// A turn is granted only when its revision shows our own key, also when the
// watch stream breaks right after the predecessor's delete: a stream that
// breaks sends wait() round its retry (sleep, settle), and the turn must
// not then be granted with no read, at the header of the last read (a
// revision at which the predecessor still held). With the holder's and the
// waiter's keys deleted in one revision (a prefix delete:
// TestPrefixDeleteGrantsNobody), Lock must not return nil with no key (the
// third contender then holds too). Here the stream breaks right after the
// response with the deletes and the re-reads fail (both injected, each a
// single fault: a member restart makes both); a waiter that watched its own
// key and the holder's on watches of their own (watch 1 its own) could get
// the holder's delete first. Invariant "Exclusion".
func TestBrokenConfirmGrantsNoTurn(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	for trial := 0; trial < 10; trial++ {
		name := fmt.Sprintf("r9-confirm-%d", trial)
		heldMutex(t, ctx, admin, name)
		b := faults.NewStreamBreaker()
		var inj faults.Injector
		w := etcdsync.NewMutex(session(t, c.Client(t, b.Dial(), inj.Dial())), name)
		errc := async(func() error { return w.Lock(ctx) })
		within(t, b.Created, testTimeout, "waiter's watch of the prefix created")
		b.Armed.Store(true)
		inj.Arm(faults.RangeMethod, 3) // the re-reads fail, then one gets through
		_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
		require.NoError(t, err)
		first := <-b.First
		lerr := resultWithin(t, errc, testTimeout, fmt.Sprintf("trial %d: the waiter", trial))
		inj.Arm("", 0)
		if first == 1 { // its own key's delete came first: not this case
			require.ErrorIs(t, lerr, etcdsync.ErrSessionExpired)
			continue
		}
		if lerr == nil {
			third := etcdsync.NewMutex(session(t, admin), name)
			terr := third.TryLock(ctx)
			t.Fatalf("trial %d: Lock returned nil with its key gone (keys %v, Header rev %d, the holder's delete came first); a third TryLock: %v",
				trial, keys(t, admin, name+"/"), w.Header().Revision, terr)
		}
		require.ErrorIs(t, lerr, etcdsync.ErrSessionExpired)
		return
	}
	t.Skip("the holder's delete never came first in 10 trials")
}

// The guard of a value with an invalid name or no session is a
// comparison etcd accepts and that is always false.
func TestGuardOfBadValueIsAlwaysFalse(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	guards := map[string]clientv3.Cmp{
		"mutex empty name":       etcdsync.NewMutex(s, "").IsOwner(),
		"mutex NUL name":         etcdsync.NewMutex(s, "a\x00b").IsOwner(),
		"mutex nil session":      etcdsync.NewMutex(nil, "x").IsOwner(),
		"election empty name":    etcdsync.NewElection(s, "").IsLeader(),
		"election nil session":   etcdsync.NewElection(nil, "x").IsLeader(),
		"mutex valid, not held":  etcdsync.NewMutex(s, "x").IsOwner(),
		"election valid, no win": etcdsync.NewElection(s, "x").IsLeader(),
	}
	for what, g := range guards {
		resp, err := cli.Txn(ctx).If(g).Then(clientv3.OpPut("guarded", what)).Commit()
		require.NoError(t, err, what)
		require.False(t, resp.Succeeded, what)
	}
	require.Empty(t, keys(t, cli, "guarded"))
}

// Header returns a fresh copy; callers mutating it do not change the hold.
func TestHeaderIsACopy(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "rh-hdr")
	require.NoError(t, m.Lock(ctx))
	h1 := m.Header()
	require.NotNil(t, h1)
	require.GreaterOrEqual(t, h1.Revision, m.Rev())
	require.NotZero(t, h1.ClusterId)
	require.NotZero(t, h1.MemberId)
	require.NotZero(t, h1.RaftTerm)
	r := h1.Revision
	h1.Revision = 1
	require.Equal(t, r, m.Header().Revision)
	require.NoError(t, m.Unlock(ctx))
	require.Nil(t, m.Header())
}

// A Mutex's Do with no ops (a guarded transaction of compares alone) is
// served by etcd as a serializable read: through a follower cut off from
// its peers it answers that the hold is current after its key was deleted.
// It must not succeed (ErrNotHeld, or an error while the member cannot
// confirm). MultiLock.Do is pinned beside it: its Else gets make it
// linearizable.
func TestGuardedDoWithoutOpsNotAnsweredByLaggingFollower(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	fi := slices.Index(c.Members(), f)
	cli := faults.RoutedClient(t, c, fi, fi) // every call through f
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})

	m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(10*time.Second)), "do28c")
	require.NoError(t, m.Lock(ctx))
	ml := etcdsync.NewMultiLock(session(t, cli, etcdsync.WithTTL(10*time.Second)), "do28c-x", "do28c-y")
	require.NoError(t, ml.Lock(ctx))
	faults.CaughtUp(t, f, ml.Header().Revision)

	require.NoError(t, c.CutPeers(f))
	defer func() { require.NoError(t, c.HealPeers(f)) }()
	_, err := admin.Delete(ctx, m.Key())
	require.NoError(t, err)
	_, err = admin.Delete(ctx, ml.Key("do28c-x"))
	require.NoError(t, err)

	doWithin := func(do func(context.Context) error) error { // the cut stays below the election timeout
		short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		return do(short)
	}
	mErr := doWithin(func(ctx context.Context) error { _, err := m.Do(ctx); return err })
	mlErr := doWithin(func(ctx context.Context) error { _, err := ml.Do(ctx); return err })
	require.Error(t, mlErr, "MultiLock.Do() through a lagging follower after a key was deleted")
	require.Error(t, mErr, "Mutex.Do() through a lagging follower after its key was deleted: a stale serializable answer")
}

// The holder holds X and Y with one MultiLock (one lease); single waiters
// wait on X, on Y, and a MultiLock on both; the holder's lease is revoked
// (all its keys go at one revision). Each waiter holds in turn, never two
// on one name, nothing is left behind.
func TestLeaseRevokeDeletingSeveralKeysAtOnceExcludes(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	hs := session(t, admin)
	h := etcdsync.NewMultiLock(hs, "rvx", "rvy")
	require.NoError(t, h.Lock(ctx))
	var inX, inY atomic.Int32
	enter := func(xy ...*atomic.Int32) {
		for _, c := range xy {
			if c.Add(1) != 1 {
				t.Errorf("two holders on one name")
			}
		}
		time.Sleep(20 * time.Millisecond)
		for _, c := range xy {
			c.Add(-1)
		}
	}
	mx := etcdsync.NewMutex(session(t, admin), "rvx")
	my := etcdsync.NewMutex(session(t, admin), "rvy")
	ml := etcdsync.NewMultiLock(session(t, admin), "rvx", "rvy")
	gx := doneAsync(t, "x", func() error {
		if err := mx.Lock(ctx); err != nil {
			return err
		}
		enter(&inX)
		return mx.Unlock(ctx)
	})
	waitKeys(t, admin, "rvx/", 2)
	gml := doneAsync(t, "ml", func() error {
		if err := ml.Lock(ctx); err != nil {
			return err
		}
		enter(&inX, &inY)
		return ml.Unlock(ctx)
	})
	waitKeys(t, admin, "rvx/", 3)
	gy := doneAsync(t, "y", func() error {
		if err := my.Lock(ctx); err != nil {
			return err
		}
		enter(&inY)
		return my.Unlock(ctx)
	})
	waitKeys(t, admin, "rvy/", 3)
	time.Sleep(200 * time.Millisecond)
	hs.Orphan()
	_, err := admin.Revoke(ctx, hs.Lease())
	require.NoError(t, err)
	within(t, gx, testTimeout, "x")
	within(t, gml, testTimeout, "ml")
	within(t, gy, testTimeout, "y")
	waitNoKeys(t, admin, "rvx/")
	waitNoKeys(t, admin, "rvy/")
}
