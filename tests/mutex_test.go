package tests

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3lock/v3lockpb"
)

// exclusionCheck records holds and fails on any overlap or a fencing token
// that does not increase.
type exclusionCheck struct {
	inside  atomic.Int32
	mu      sync.Mutex
	lastRev int64
	holds   int
}

func (x *exclusionCheck) enter(t *testing.T, rev int64) {
	if n := x.inside.Add(1); n != 1 {
		t.Errorf("%d holders at once", n)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if rev <= x.lastRev {
		t.Errorf("fencing token %d after %d: not increasing", rev, x.lastRev)
	}
	x.lastRev = rev
	x.holds++
}

func (x *exclusionCheck) leave() { x.inside.Add(-1) }

// contendEveryWay runs work in 9 goroutines (id 0 to 8) and waits for them.
// Three times over: one on a value (made by value) of a session of its own
// (on a client of client), one on a value of its own of a session they all
// share, one on a value they all share.
func contendEveryWay[V any](t *testing.T, client func() *clientv3.Client, value func(s *etcdsync.Session) V, work func(v V, id int)) {
	var wg sync.WaitGroup
	run := func(v V, id int) { defer wg.Done(); work(v, id) }
	shared := session(t, client())
	sharedValue := value(shared)
	for i := 0; i < 3; i++ {
		wg.Add(3)
		go run(value(session(t, client())), 3*i) // own session
		go run(value(shared), 3*i+1)             // own value, shared session
		go run(sharedValue, 3*i+2)               // shared value
	}
	wg.Wait()
}

// Invariant "Exclusion" (and the order of "Fencing" tokens): sessions, Mutex values on one session
// and goroutines sharing one *Mutex never hold at once (etcd-io/etcd#11360:
// goroutines sharing etcd's Mutex race on it, and all "hold").
func TestMutualExclusion(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		var x exclusionCheck
		const rounds = 5
		work := func(m *etcdsync.Mutex, _ int) {
			for i := 0; i < rounds; i++ {
				if err := m.Lock(ctx); err != nil {
					t.Errorf("lock: %v", err)
					return
				}
				x.enter(t, m.Rev())
				time.Sleep(time.Millisecond) // widen the window an overlap would show in
				x.leave()
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("unlock: %v", err)
					return
				}
			}
		}
		contendEveryWay(t, func() *clientv3.Client { return c.Client(t) },
			func(s *etcdsync.Session) *etcdsync.Mutex { return etcdsync.NewMutex(s, "excl") }, work)
		require.Equal(t, 9*rounds, x.holds)
	})
}

// Invariant "Exclusion": two Mutex values on one Session exclude each other (etcd's
// client lets both hold: etcd-io/etcd#10756); the second joins the queue with
// a fresh key after the first releases.
func TestSameSessionMutexesExclude(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	s := session(t, c.Client(t))
	ctx := ctxT(t)
	m1, m2 := etcdsync.NewMutex(s, "same"), etcdsync.NewMutex(s, "same")
	require.NoError(t, m1.Lock(ctx))
	require.ErrorIs(t, m2.TryLock(ctx), etcdsync.ErrLocked)
	got := lockAsync(t, ctx, m2)
	notWithin(t, got, 300*time.Millisecond, "second Mutex on the same session locked while the first holds")
	handOver(t, ctx, m1, m2, got)
}

// Invariant "Exclusion": a new Session adopting the lease (process restart) resumes
// the hold at once, at the same revision.
func TestWithLeaseResumesHold(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m1 := etcdsync.NewMutex(s1, "restart")
	require.NoError(t, m1.Lock(ctx))
	rev := m1.Rev()
	s1.Orphan() // the process "dies" without releasing

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	require.LessOrEqual(t, s2.TTL(), 30*time.Second)
	m2 := etcdsync.NewMutex(s2, "restart")
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.NoError(t, m2.Lock(lctx))
	require.Equal(t, rev, m2.Rev())
	require.NoError(t, m2.Unlock(ctx))
	require.Empty(t, keys(t, cli, "restart/"))
}

// Invariant "Interop": our keys are etcd's; etcd's concurrency.Mutex and ours exclude
// each other on one name.
func TestInteropWithConcurrencyMutex(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	es := theirSession(t, cli, concurrency.WithTTL(30))
	theirs := concurrency.NewMutex(es, "interop")
	s := session(t, cli)
	ours := etcdsync.NewMutex(s, "interop")

	require.NoError(t, theirs.Lock(ctx))
	require.ErrorIs(t, ours.TryLock(ctx), etcdsync.ErrLocked)
	got := lockAsync(t, ctx, ours)
	notWithin(t, got, 300*time.Millisecond, "our Lock while etcd's Mutex holds")
	require.NoError(t, theirs.Unlock(ctx))
	within(t, got, testTimeout, "our Lock after etcd's Unlock")
	require.Equal(t, fmt.Sprintf("interop/%x", int64(s.Lease())), ours.Key())

	require.ErrorIs(t, theirs.TryLock(ctx), concurrency.ErrLocked)
	require.NoError(t, ours.Unlock(ctx))
	require.NoError(t, theirs.TryLock(ctx))
	require.Equal(t, fmt.Sprintf("interop/%x", int64(es.Lease())), theirs.Key())
	require.NoError(t, theirs.Unlock(ctx))
}

// Invariant "Nested names": a holder of /a/b never blocks /a (seed 002), with our Mutex or
// etcd's holding the nested name.
func TestNestedNamesIsolated(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	es := theirSession(t, cli, concurrency.WithTTL(30))
	require.NoError(t, concurrency.NewMutex(es, "/a/b").Lock(ctx))
	heldMutex(t, ctx, cli, "/a/c") // a nested name, ours

	outer := etcdsync.NewMutex(session(t, cli), "/a")
	lctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.NoError(t, outer.Lock(lctx))
	require.NoError(t, outer.Unlock(ctx))
	require.NoError(t, outer.TryLock(lctx), "TryLock falls back to a queue read when only nested keys exist")
	require.NoError(t, outer.Unlock(ctx))
}

// Invariant "FIFO": waiters are served in queue order, and each release delivers
// at most two watch events to the waiters (to the next waiter and to the one
// behind it, which watches its second-nearest key), whatever the queue
// length. Besides its Unlock, a waiter makes one read at most, when its
// second-nearest key goes (TestNoRPCOnTheCriticalPath: never on the critical
// path).
func TestFIFOAndHerdFree(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		holder := heldMutex(t, ctx, admin, "fifo")

		const n = 8
		cnt := counter{created: make(chan struct{}, 4*n), ownApart: true}
		cli := kitClient(t, c, cnt.dial()...)
		order := make(chan int, n)
		var wg sync.WaitGroup
		for i := 0; i < n; i++ {
			m := etcdsync.NewMutex(session(t, cli), "fifo")
			wg.Add(1)
			go func() {
				defer wg.Done()
				if err := m.Lock(ctx); err != nil {
					t.Errorf("waiter %d: %v", i, err)
					return
				}
				order <- i
				if err := m.Unlock(ctx); err != nil {
					t.Errorf("waiter %d unlock: %v", i, err)
				}
			}()
			// The prefix while it has at most two keys ahead; else its own
			// key and the third key ahead (nobody else writes meanwhile).
			for range waits(i+1, 1) {
				within(t, cnt.created, testTimeout, "waiter's watch created")
			}
		}
		cnt.take()
		before := cnt.events.Load()
		require.NoError(t, holder.Unlock(ctx))
		wg.Wait()
		close(order)
		var got []int
		for i := range order {
			got = append(got, i)
		}
		require.Equal(t, []int{0, 1, 2, 3, 4, 5, 6, 7}, got)
		// Each release reaches the next waiter, the one behind it (the two
		// at the front) and the one three places behind the released key,
		// which watches it (a waiter whose read already showed its turn
		// needs no event): at most 3 for each of the n releases, fewer for
		// the last three. A waiter's own key's delete, reaching it when its
		// Unlock overtook the cancel of that watch, is not counted
		// (ownApart).
		require.LessOrEqual(t, cnt.events.Load()-before, int64(3*n-3), "watch events delivered to waiters for %d releases", n)
		// The first two waiters listed only watched keys; each later one
		// listed the holder, which it does not watch, so it reads once:
		// serializable, then linearizable when the member was behind.
		rpcs, methods := cnt.take()
		require.LessOrEqual(t, rpcs, int64(n+2*(n-2)), "RPCs after the enqueues: %d Unlocks, at most %d reads of 2 Ranges: %v", n, n-2, methods)
		require.GreaterOrEqual(t, rpcs, int64(n), "RPCs after the enqueues: %d Unlocks: %v", n, methods)
	})
}

// Invariant "Nothing left": a cancelled Lock, a Lock whose cancel races the create, and a
// closed Session leave no key.
func TestNothingLeftBehind(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	holder := heldMutex(t, ctx, cli, "left")

	s := session(t, cli)
	m := etcdsync.NewMutex(s, "left")
	lctx, cancel := context.WithCancel(ctx)
	errc := async(func() error { return m.Lock(lctx) })
	waitKeys(t, cli, "left/", 2)
	cancel()
	require.ErrorIs(t, <-errc, context.Canceled)
	require.Equal(t, []string{holder.Key()}, keys(t, cli, "left/"))

	// The cancel races the create transaction.
	cancelsLeaveOnly(t, ctx, cli, "left/", holder.Key(), 100, 10, func(rctx context.Context, _ int) error { return m.Lock(rctx) })
	// The failed calls left the session's reservation of the key free.
	require.NoError(t, holder.Unlock(ctx))
	lctx2, cancel2 := context.WithTimeout(ctx, 2*time.Second)
	defer cancel2()
	require.NoError(t, m.Lock(lctx2))
	require.NoError(t, m.Unlock(ctx))

	s2, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	m2 := etcdsync.NewMutex(s2, "left2")
	require.NoError(t, m2.Lock(ctx))
	require.NoError(t, s2.Close())
	require.Empty(t, keys(t, cli, "left2/"))
	require.ErrorIs(t, s2.Close(), nil, "Close is idempotent")
}

// Invariant "Own loss": a waiter whose own key vanishes returns ErrSessionExpired at
// once, not when the holder goes (etcd-io/etcd#19597).
func TestWaiterNoticesOwnLoss(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		cli := c.Client(t)
		ctx := ctxT(t)
		holder := heldMutex(t, ctx, cli, "own")
		for _, how := range []string{"delete", "revoke"} {
			s := session(t, cli)
			m := etcdsync.NewMutex(s, "own")
			errc := async(func() error { return m.Lock(ctx) })
			waitKeys(t, cli, "own/", 2)
			if how == "delete" {
				_, err := cli.Delete(ctx, fmt.Sprintf("own/%x", int64(s.Lease())))
				require.NoError(t, err)
			} else {
				_, err := cli.Revoke(ctx, s.Lease())
				require.NoError(t, err)
			}
			require.ErrorIs(t, resultWithin(t, errc, time.Second, how+": waiter noticing its own loss"), etcdsync.ErrSessionExpired, how)
			require.Equal(t, []string{holder.Key()}, keys(t, cli, "own/"))
		}
		require.NoError(t, holder.Unlock(ctx))
	})
}

// Invariant "Fenced release": Unlock deletes only the key at the revision it holds: a stale
// Unlock after the key was re-created by a new hold on the same session
// (same key name) deletes nothing (etcd-io/etcd#22082).
func TestUnlockIsFenced(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	old := etcdsync.NewMutex(s, "fence")
	require.NoError(t, old.Lock(ctx))
	_, err := cli.Delete(ctx, old.Key()) // the hold is lost behind the value's back
	require.NoError(t, err)

	// A new hold on the same key name: a session adopting the same lease.
	newer := etcdsync.NewMutex(session(t, cli, etcdsync.WithLease(s.Lease())), "fence")
	require.NoError(t, newer.Lock(ctx))
	require.Equal(t, old.Key(), newer.Key())
	require.Greater(t, newer.Rev(), old.Rev())
	require.ErrorIs(t, old.Unlock(ctx), etcdsync.ErrLockReleased)
	require.Equal(t, []string{newer.Key()}, keys(t, cli, "fence/"))

	// A retried Unlock after one that committed returns ErrLockReleased.
	require.NoError(t, newer.Unlock(ctx))
	require.ErrorIs(t, newer.Unlock(ctx), etcdsync.ErrLockReleased)
}

// Invariant "Loss signal": Done closes when the hold ends, with the cause in Err
// (etcd-io/etcd#6127: etcd's Mutex has no such signal, and its Session's Done
// misses a key deleted behind the hold's back).
func TestHolderLearnsOfLoss(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	cases := []struct {
		name  string
		end   func(s *etcdsync.Session, m *etcdsync.Mutex)
		cause error
	}{
		{"unlock", func(_ *etcdsync.Session, m *etcdsync.Mutex) { require.NoError(t, m.Unlock(ctx)) }, etcdsync.ErrLockReleased},
		{"key deleted", func(_ *etcdsync.Session, m *etcdsync.Mutex) {
			_, err := cli.Delete(ctx, m.Key())
			require.NoError(t, err)
		}, etcdsync.ErrNotHeld},
		{"lease revoked", func(s *etcdsync.Session, _ *etcdsync.Mutex) {
			_, err := cli.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		}, etcdsync.ErrNotHeld},
		{"session closed", func(s *etcdsync.Session, _ *etcdsync.Mutex) { require.NoError(t, s.Close()) }, etcdsync.ErrSessionClosed},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := session(t, cli)
			m := etcdsync.NewMutex(s, "loss-"+tc.name)
			require.NoError(t, m.Lock(ctx))
			done := m.Done()
			require.NoError(t, m.Err())
			notWithin(t, done, 50*time.Millisecond, "Done while held")
			tc.end(s, m)
			within(t, done, 5*time.Second, "Done after "+tc.name)
			require.ErrorIs(t, m.Err(), tc.cause)
			require.Equal(t, int64(0), m.Rev())
			require.Equal(t, "", m.Key())
		})
	}
}

// Invariant "Fencing": Rev is the fencing token; Do and IsOwner stop working once
// the hold is gone.
func TestFencingGuards(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	m := etcdsync.NewMutex(session(t, cli), "guard")

	_, err := m.Do(ctx, clientv3.OpPut("guarded", "x"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	resp, err := cli.Txn(ctx).If(m.IsOwner()).Then(clientv3.OpPut("guarded", "x")).Commit()
	require.NoError(t, err)
	require.False(t, resp.Succeeded, "IsOwner with no hold must fail")

	require.NoError(t, m.Lock(ctx))
	first := m.Rev()
	require.Equal(t, m.Header().Revision, first)
	_, err = m.Do(ctx, clientv3.OpPut("guarded", "1"))
	require.NoError(t, err)
	_, err = cli.Delete(ctx, m.Key())
	require.NoError(t, err)
	_, err = m.Do(ctx, clientv3.OpPut("guarded", "2"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	got, err := cli.Get(ctx, "guarded")
	require.NoError(t, err)
	require.Equal(t, "1", string(got.Kvs[0].Value))
	require.Equal(t, int64(0), m.Rev(), "a failed guarded call resets the state")

	require.NoError(t, m.Lock(ctx))
	require.Greater(t, m.Rev(), first)
	require.NoError(t, m.Unlock(ctx))
}

// TryLock on a held lock costs one RPC and writes nothing; it fails also for
// the value that holds.
func TestTryLockCost(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	var cnt counter
	cli := kitClient(t, c, cnt.dial()...)
	ctx := ctxT(t)
	holder := heldMutex(t, ctx, cli, "try")
	require.ErrorIs(t, holder.TryLock(ctx), etcdsync.ErrLocked)

	other := etcdsync.NewMutex(session(t, cli), "try")
	before, err := cli.Get(ctx, "x")
	require.NoError(t, err)
	cnt.take()
	require.ErrorIs(t, other.TryLock(ctx), etcdsync.ErrLocked)
	n, methods := cnt.take()
	after, err := cli.Get(ctx, "x")
	require.NoError(t, err)
	require.Equal(t, int64(1), n, "RPCs: %v", methods)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "TryLock on a held lock wrote")
	require.Equal(t, []string{holder.Key()}, keys(t, cli, "try/"))
}

// Uncontended Lock and Unlock cost one RPC and one write each.
func TestUncontendedCost(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	var cnt counter
	cli := kitClient(t, c, cnt.dial()...)
	ctx := ctxT(t)
	m := etcdsync.NewMutex(session(t, cli), "cost")
	for i := 0; i < 3; i++ {
		cnt.take()
		require.NoError(t, m.Lock(ctx))
		n, methods := cnt.take()
		require.Equal(t, int64(1), n, "Lock RPCs: %v", methods)
		rev := m.Rev()
		require.NoError(t, m.Unlock(ctx))
		n, methods = cnt.take()
		require.Equal(t, int64(1), n, "Unlock RPCs: %v", methods)
		resp, err := cli.Get(ctx, "x")
		require.NoError(t, err)
		require.Equal(t, rev+1, resp.Header.Revision, "one write to lock, one to unlock")
	}
}

// The next waiter takes the lock after its predecessor's delete event with no
// further RPC.
func TestHandoffNeedsNoRPC(t *testing.T) {
	t.Parallel()
	c, admin, ctx := kitSingleClient(t)
	holder := heldMutex(t, ctx, admin, "handoff")
	cnt := counter{created: make(chan struct{}, 2)}
	cli := kitClient(t, c, cnt.dial()...)
	m := etcdsync.NewMutex(session(t, cli), "handoff")
	got := async(func() error { return m.Lock(ctx) })
	within(t, cnt.created, testTimeout, "waiter's watch created") // of the prefix
	cnt.take()                                                    // the enqueue transaction
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, <-got)
	n, methods := cnt.take()
	require.Equal(t, int64(0), n, "RPCs after the enqueue: %v", methods)
	require.NoError(t, m.Unlock(ctx))
}

// Bad input gets errors wrapping sentinels, never a panic, and writes nothing.
func TestMutexBadInput(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	for _, name := range []string{"", "a\x00b"} {
		m := etcdsync.NewMutex(s, name)
		require.ErrorIs(t, m.Lock(ctx), etcdsync.ErrInvalidName)
		require.ErrorIs(t, m.TryLock(ctx), etcdsync.ErrInvalidName)
		require.ErrorIs(t, m.Unlock(ctx), etcdsync.ErrInvalidName)
		_, err := m.Do(ctx)
		require.ErrorIs(t, err, etcdsync.ErrInvalidName)
		require.Equal(t, int64(0), m.Rev())
	}
	m := etcdsync.NewMutex(nil, "x")
	require.ErrorIs(t, m.Lock(ctx), etcdsync.ErrInvalidArgument)
	resp, err := cli.Get(ctx, "", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)
	require.Panics(t, func() { etcdsync.NewLocker(s, "").Lock() })
}

// NewLocker is a sync.Locker that excludes like Mutex.
func TestLocker(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	l1, l2 := etcdsync.NewLocker(session(t, cli), "locker"), etcdsync.NewLocker(session(t, cli), "locker")
	l1.Lock()
	got := make(chan struct{})
	go func() { defer close(got); l2.Lock() }()
	notWithin(t, got, 200*time.Millisecond, "second Locker while the first holds")
	l1.Unlock()
	within(t, got, testTimeout, "second Locker after release")
	l2.Unlock()
	require.Panics(t, func() { l2.Unlock() })
}

// A Lock on a closed session fails at once, with ErrSessionClosed: a session
// ended on purpose is not one that expired.
func TestLockOnEndedSession(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	s, err := etcdsync.NewSession(cli)
	require.NoError(t, err)
	require.NoError(t, s.Close())
	err = etcdsync.NewMutex(s, "ended").Lock(ctxT(t))
	require.ErrorIs(t, err, etcdsync.ErrSessionClosed)
	require.NotErrorIs(t, err, etcdsync.ErrSessionExpired)
}

// A waiter keeps its place while the raft leader is stopped and restarted,
// and takes the lock when the holder releases.
func TestWaiterSurvivesLeaderStop(t *testing.T) {
	t.Parallel()
	c := kitThree(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	holder := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(5*time.Second)), "weather")
	require.NoError(t, holder.Lock(ctx))
	waiter := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(5*time.Second)), "weather")
	got := lockAsync(t, ctx, waiter)
	waitKeys(t, cli, "weather/", 2)
	leader := c.Leader()
	require.NotNil(t, leader)
	leader.Stop()
	notWithin(t, got, time.Second, "waiter took the lock while it is held")
	require.NoError(t, leader.Restart())
	handOver(t, ctx, holder, waiter, got)
}

// Done keeps watching across a compaction of the revisions it started from.
func TestDoneSurvivesCompaction(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	m := heldMutex(t, ctx, cli, "compact")
	var last int64
	for i := 0; i < 5; i++ {
		resp, err := cli.Put(ctx, "compact-filler", fmt.Sprint(i))
		require.NoError(t, err)
		last = resp.Header.Revision
	}
	_, err := cli.Compact(ctx, last)
	require.NoError(t, err)
	done := m.Done() // its watch starts from a compacted revision
	notWithin(t, done, 700*time.Millisecond, "Done while still held")
	_, err = cli.Delete(ctx, m.Key())
	require.NoError(t, err)
	within(t, done, 3*time.Second, "Done after the key was deleted")
	require.ErrorIs(t, m.Err(), etcdsync.ErrNotHeld)
}

// lockAsync locks m in a goroutine; the channel closes when Lock returned
// (a failure is reported on t).
func lockAsync(t *testing.T, ctx context.Context, m *etcdsync.Mutex) <-chan struct{} {
	return doneAsync(t, "Lock", func() error { return m.Lock(ctx) })
}

// handOver releases from, waits for the Lock of to (got closes when it
// returned), checks the fencing token grew and releases to.
func handOver(t *testing.T, ctx context.Context, from, to *etcdsync.Mutex, got <-chan struct{}) {
	t.Helper()
	held := from.Rev()
	require.NoError(t, from.Unlock(ctx))
	within(t, got, testTimeout, "waiter's Lock after the release")
	require.Greater(t, to.Rev(), held)
	require.NoError(t, to.Unlock(ctx))
}

// Invariant "Interop": the server's lock API (v3lock, as etcdctl lock --endpoint
// uses through the gateway) and our Mutex exclude each other.
func TestInteropWithServerLockAPI(t *testing.T) {
	t.Parallel()
	c, cli, ctx := kitSingleClient(t)
	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	// The server's API keeps this lease alive in-process; end it.
	t.Cleanup(func() { cli.Revoke(context.Background(), lease.ID) })
	srv := v3lockpb.NewLockClient(etcdtest.Conn(t, c.Endpoints()[0]))
	held, err := srv.Lock(ctx, &v3lockpb.LockRequest{Name: []byte("srv-lock"), Lease: int64(lease.ID)})
	require.NoError(t, err)
	require.Equal(t, fmt.Sprintf("srv-lock/%x", int64(lease.ID)), string(held.Key))

	ours := etcdsync.NewMutex(session(t, cli), "srv-lock")
	require.ErrorIs(t, ours.TryLock(ctx), etcdsync.ErrLocked)
	got := lockAsync(t, ctx, ours)
	notWithin(t, got, 300*time.Millisecond, "our Lock while the server's lock holds")
	_, err = srv.Unlock(ctx, &v3lockpb.UnlockRequest{Key: held.Key})
	require.NoError(t, err)
	within(t, got, testTimeout, "our Lock after the server's unlock")
	require.NoError(t, ours.Unlock(ctx))
}

// Invariant "FIFO" with give-ups: when the waiter ahead gives up, or keys ahead
// vanish out of order, the next waiter keeps waiting while an older key is
// held, and takes the lock when the holder goes.
func TestQueueSurvivesGiveUps(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	holder := heldMutex(t, ctx, cli, "giveup")
	var quitters []context.CancelFunc
	var quitErrs []chan error
	for i := 0; i < 3; i++ { // three waiters that will give up
		qctx, cancel := context.WithCancel(ctx)
		quitters = append(quitters, cancel)
		errc := make(chan error, 1)
		m := etcdsync.NewMutex(session(t, cli), "giveup")
		go func() { errc <- m.Lock(qctx) }()
		quitErrs = append(quitErrs, errc)
		waitKeys(t, cli, "giveup/", i+2)
	}
	last := etcdsync.NewMutex(session(t, cli), "giveup")
	got := lockAsync(t, ctx, last)
	waitKeys(t, cli, "giveup/", 5)

	// The nearest waiter gives up first, then the farthest, then the middle.
	for _, i := range []int{2, 0, 1} {
		quitters[i]()
		require.ErrorIs(t, <-quitErrs[i], context.Canceled)
		notWithin(t, got, 200*time.Millisecond, "the last waiter took the lock while it is held")
	}
	require.Len(t, keys(t, cli, "giveup/"), 2)
	handOver(t, ctx, holder, last, got)
}

// queueToGiveUp starts acquire under a context of its own and waits until
// prefix has n keys (acquire's key the n-th); the returned giveUp ends that
// context and requires acquire to return context.Canceled, its key
// withdrawn (one delete under prefix). Every wait is bounded by testTimeout.
func queueToGiveUp(t *testing.T, cli *clientv3.Client, prefix string, n int, acquire func(ctx context.Context) error) (giveUp func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(ctxT(t))
	errc := async(func() error { return acquire(ctx) })
	waitKeys(t, cli, prefix, n)
	return func() {
		t.Helper()
		cancel()
		require.ErrorIs(t, resultWithin(t, errc, testTimeout, "an acquire given up"), context.Canceled)
	}
}

// giveUpNewestFirst runs giveUps newest first, each leaving one key fewer
// of the queued+len(giveUps) under prefix.
func giveUpNewestFirst(t *testing.T, cli *clientv3.Client, prefix string, queued int, giveUps []func()) {
	t.Helper()
	for j := len(giveUps) - 1; j >= 0; j-- {
		giveUps[j]()
		require.Len(t, keys(t, cli, prefix), queued+j)
	}
}

// heardAtMost waits until cnt heard at least least watch events since
// since (those that must come: the first two waiters hear every delete),
// then a moment for any that must not come with them, and requires at
// most most (what says whose).
func heardAtMost(t *testing.T, cnt *counter, since, least, most int64, what string) {
	t.Helper()
	require.Eventually(t, func() bool { return cnt.events.Load()-since >= least }, testTimeout, time.Millisecond,
		"%s: the first two waiters hear every delete", what)
	time.Sleep(50 * time.Millisecond)
	heard := cnt.events.Load() - since
	t.Logf("%s: %d events", what, heard)
	require.LessOrEqual(t, heard, most, what)
}

// Invariant "FIFO and herd-free" with give-ups behind the first waiters: a
// waiter that queues and gives up deletes its key, and that delete reaches
// the first two waiters of the queue (they watch the whole prefix) and the
// one waiter three places behind the key (it watches that key, then reads
// and watches its new third key ahead), never the waiters behind those: at
// most three of the queue's 20 waiters per delete (it was every waiter
// behind the key with a herd). Ten waiters queue behind the first five,
// fifteen more behind them, and the ten give up oldest first; then the 20
// hold in queue order and leave no key.
func TestMutexGiveUpReachesTheFrontAndItsWatcherOnly(t *testing.T) {
	t.Parallel()
	c, admin, ctx := kitSingleClient(t)
	const name, prefix = "mgiveup", "mgiveup/"
	const n, first, quitters = 20, 5, 10
	holder := heldMutex(t, ctx, admin, name)
	cnt := counter{created: make(chan struct{}, 4*n)}
	cli := kitClient(t, c, cnt.dial()...)
	order := make(chan int, n)
	ms := make([]*etcdsync.Mutex, n)
	queued := 1
	// Waiter i queues, and its watches are created, before the next key is
	// written (else it reads the gap): the prefix while at most two keys
	// are ahead, else its own key and the third key ahead.
	wait := func(i int) {
		ms[i] = etcdsync.NewMutex(session(t, cli), name)
		go func() {
			if err := ms[i].Lock(ctx); err != nil {
				t.Errorf("waiter %d: %v", i, err)
				return
			}
			order <- i
		}()
		queued++
		waitKeys(t, admin, prefix, queued)
		for range waits(queued-1, 1) {
			within(t, cnt.created, testTimeout, fmt.Sprintf("waiter %d's watch created", i))
		}
	}
	for i := range first {
		wait(i)
	}
	giveUps := make([]func(), quitters)
	for j := range giveUps {
		m := etcdsync.NewMutex(session(t, admin), name)
		queued++
		giveUps[j] = queueToGiveUp(t, admin, prefix, queued, m.Lock)
	}
	for i := first; i < n; i++ {
		wait(i)
	}
	events := cnt.events.Load()
	for j, giveUp := range giveUps { // oldest first
		giveUp()
		queued--
		require.Len(t, keys(t, admin, prefix), queued)
		// The last three are the third key ahead of the waiters behind
		// them (the others are of those that give up): the waiter that
		// watched the key reads, on a watch of the prefix, and watches
		// its own key and its new third key ahead (three watches), before
		// the next delete.
		if j >= quitters-3 {
			awaitCreated(t, cnt.created, 3, testTimeout, fmt.Sprintf("the watches of the waiter behind give-up %d", j))
		}
	}
	heardAtMost(t, &cnt, events, 2*quitters, 3*quitters,
		fmt.Sprintf("%d give-ups behind the first %d of %d waiters, each heard by the first two and the one watching it", quitters, first, n))

	require.NoError(t, holder.Unlock(ctx))
	for i := range n {
		select {
		case j := <-order:
			require.Equal(t, i, j, "FIFO")
		case <-time.After(testTimeout):
			t.Fatalf("waiter %d did not hold", i)
		}
		require.NoError(t, ms[i].Unlock(ctx))
	}
	require.Empty(t, keys(t, admin, prefix))
}

// A Lock whose context ends just as its turn comes either holds (it
// returns nil, its key is in etcd at Rev and stays after the context ends)
// or fails with nothing left behind; it never returns nil for a hold it gave
// up (etcd-io/etcd#10111: etcd's Lock, its context cancelled as its wait
// ended, deleted its key and still returned nil).
func TestLockRacingCancelHoldsOrLeavesNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "cancel-turn"
	holder := etcdsync.NewMutex(session(t, cli), name)
	m := etcdsync.NewMutex(session(t, cli), name)
	held := 0
	const trials = 30
	for i := range trials {
		require.NoError(t, holder.Lock(ctx))
		lctx, cancel := context.WithCancel(ctx)
		got := async(func() error { return m.Lock(lctx) })
		waitKeys(t, cli, name+"/", 2)
		require.NoError(t, holder.Unlock(ctx))
		// The cancel lands at a varying point around the waiter's turn.
		stop := time.AfterFunc(time.Duration(i%10)*100*time.Microsecond, cancel)
		err := resultWithin(t, got, testTimeout, "Lock")
		<-lctx.Done()
		stop.Stop()
		if err != nil {
			require.ErrorIs(t, err, context.Canceled, "trial %d", i)
			require.Empty(t, keys(t, cli, name+"/"), "trial %d: a failed Lock left its key", i)
			continue
		}
		held++
		resp, err := cli.Get(ctx, m.Key())
		require.NoError(t, err)
		require.Len(t, resp.Kvs, 1, "trial %d: Lock returned nil and its key is gone", i)
		require.Equal(t, m.Rev(), resp.Kvs[0].CreateRevision, "trial %d", i)
		require.NoError(t, m.Err(), "trial %d: the hold ended with the Lock's context", i)
		require.NoError(t, m.Unlock(ctx))
	}
	t.Logf("%d of %d Locks held, the others were cancelled", held, trials)
}
