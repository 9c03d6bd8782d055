package tests

// Nothing left behind: cancelled and failed acquires, late creates and
// cleanups, and the sweeper leave no key and no claim — Invariant
// "Nothing left".

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// A waiter whose Lock ends (ctx cancelled) and whose cleanup delete fails
// (one RPC error) must still not leave its key behind for as long as its
// session lives: the create's outcome was known, so no sweep would find it,
// and once the holder ahead released, that key would head the queue and block
// the name for every other contender. Invariant "Nothing left": a cancelled
// Lock leaves no key.
func TestCancelledLockLeavesNoKeyAfterFailedWithdraw(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	holder := heldMutex(t, ctx, admin, "r8-withdraw")

	var inj faults.Injector
	cnt := counter{created: make(chan struct{}, 4)}
	s := session(t, c.Client(t, append(cnt.dial(), inj.Dial())...), etcdsync.WithTTL(30*time.Second))
	w := etcdsync.NewMutex(s, "r8-withdraw")
	lctx, cancel := context.WithCancel(ctx)
	errc := async(func() error { return w.Lock(lctx) })
	within(t, cnt.created, testTimeout, "waiter's watch created") // of the prefix: the holder is all it waits for
	inj.Arm(faults.TxnMethod, 1)                                  // the cleanup delete fails, unsent
	cancel()
	require.ErrorIs(t, resultWithin(t, errc, testTimeout, "the cancelled Lock"), context.Canceled)
	require.NoError(t, s.Err(), "the session lives on")
	require.NoError(t, holder.Unlock(ctx))

	nameFree(t, ctx, admin, "r8-withdraw", "the cancelled waiter's key")
}

// nameFree fails t unless a Mutex on name of a new session of cli locks
// within 5 s (and unlocks): whose (the key that must not stay) does not
// block the name.
func nameFree(t *testing.T, ctx context.Context, cli *clientv3.Client, name, whose string) {
	t.Helper()
	third := etcdsync.NewMutex(session(t, cli), name)
	tctx, tcancel := context.WithTimeout(ctx, 5*time.Second)
	defer tcancel()
	require.NoError(t, third.Lock(tctx), "the name is blocked by %s: %v", whose, keys(t, cli, name+"/"))
	require.NoError(t, third.Unlock(ctx))
}

// A cleanup of a create of unknown outcome must never delete a later hold
// of the session. That cleanup deletes "any key with this lease created after
// the session began", unfenced by a create revision, and a request is not
// withdrawn with its context: forwarded by a follower cut off from its peers,
// it is applied when the partition heals. Here: the create commits but its
// reply is lost (one Unavailable after the call went through); the cleanup
// goes to a follower f cut off a moment before and is held in the network;
// the session sweeps the created key; the same Mutex then Locks again and
// holds; f heals, and the new hold must stay. Invariant "Fenced release".
func TestLateWithdrawNeverDeletesLaterHold(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.Conn(t, f.Endpoint())
	var sc faults.Script
	s := session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, sc.Dial()), etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "r8-late")

	require.NoError(t, c.CutPeers(f))
	healed := false
	defer func() {
		if !healed {
			c.HealPeers(f)
		}
	}()
	// The create commits on u, its reply is lost; the cleanup goes to f.
	sc.Arm(faults.TxnMethod, faults.ReplyLost, faults.Via(viaF))
	start := time.Now()
	err := m.Lock(ctx)
	require.Error(t, err)
	t.Logf("Lock: %v (after %v)", err, time.Since(start))

	// The session sweeps the committed key, then the Mutex holds again.
	waitNoKeys(t, admin, "r8-late/")
	require.NoError(t, m.Lock(ctx))
	held := m.Rev()
	done := m.Done()
	notWithin(t, done, time.Second, "the hold ended before f healed")

	require.NoError(t, c.HealPeers(f))
	healed = true
	select {
	case <-done:
		t.Fatalf("the hold at %d ended after f healed: %v; keys now %v", held, m.Err(), keys(t, admin, "r8-late/"))
	case <-time.After(2 * time.Second):
	}
	require.NoError(t, m.Unlock(ctx))
}

// Once a create of unknown outcome has started the sweeper for a key, the
// session's later holds of that key must not lend the sweeper the key's
// in-process claim after they end: TryLock on the same session and name must
// not return ErrLocked while nobody holds the name, and Lock must not wait a
// round trip for a (fenced, no-op) sweeper delete. "unswept" is the control.
func TestSweeperLeavesClaimAfterUnlock(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	sweptOrNot(t, "r8-steal", func(t *testing.T, ctx context.Context, _ *etcdtest.Cluster, m *etcdsync.Mutex) {
		freeTryLocks(t, ctx, m, 10, 50*time.Millisecond, func() {
			require.NoError(t, m.Lock(ctx))
			require.NoError(t, m.Unlock(ctx))
			time.Sleep(5 * time.Millisecond) // the caller tries again a moment later
		})
	})
}

// sweptOrNot runs f on sweptMutex(name), each case in a subtest on a member
// of its own: "swept", and "unswept", the control (no create of unknown
// outcome, no sweeper).
func sweptOrNot(t *testing.T, name string, f func(t *testing.T, ctx context.Context, c *etcdtest.Cluster, m *etcdsync.Mutex)) {
	for _, swept := range []bool{true, false} {
		t.Run(map[bool]string{true: "swept", false: "unswept"}[swept], func(t *testing.T) {
			c := single(t)
			ctx := ctxT(t)
			f(t, ctx, c, sweptMutex(t, c, name, swept))
		})
	}
}

// sweptMutex returns a Mutex on name of a session whose writes take 30 ms
// more; with swept, after one Lock of unknown outcome, so that the session
// sweeps the key from then on.
func sweptMutex(t *testing.T, c *etcdtest.Cluster, name string, swept bool) *etcdsync.Mutex {
	var inj faults.Injector
	slow := faults.Delay(faults.TxnMethod, 30*time.Millisecond)
	m := etcdsync.NewMutex(session(t, c.Client(t, inj.Dial(), slow)), name)
	if swept {
		inj.Arm(faults.TxnMethod, 1)
		require.Error(t, m.Lock(ctxT(t)))
	}
	return m
}

// freeTryLocks runs trials rounds of free (which leaves m's name free)
// and a TryLock of m, which must not return ErrLocked ("held, or waited
// for, by this session"); a refusal is logged and waited out for pause.
func freeTryLocks(t *testing.T, ctx context.Context, m *etcdsync.Mutex, trials int, pause time.Duration, free func()) {
	t.Helper()
	spurious := 0
	for i := 0; i < trials; i++ {
		free()
		if err := m.TryLock(ctx); err != nil {
			require.ErrorIs(t, err, etcdsync.ErrLocked)
			spurious++
			t.Logf("trial %d: %v", i, err)
			time.Sleep(pause)
			continue
		}
		require.NoError(t, m.Unlock(ctx))
	}
	require.Zero(t, spurious, "TryLock on a free name returned ErrLocked")
}

// A restarted process (WithLease) whose previous incarnation was *waiting*
// (its key is in the queue, not at the head) and whose Lock is cancelled
// while it waits must not leave that key behind: the session lives on and
// holds nothing in-process, so once the key reached the head it would block
// the name for every other contender until the session ends. (A resumed
// *hold* is kept: TestResumedHoldSurvivesFailedCreate; a resumed waiting key
// has no hold to keep.) Invariant "Nothing left".
func TestCancelledResumedWaiterLeavesNoKey(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	holder := heldMutex(t, ctx, admin, "r8-rwait")

	// The previous process queued behind the holder, then died.
	lease, err := admin.Grant(ctx, 30)
	require.NoError(t, err)
	key := fmt.Sprintf("r8-rwait/%x", int64(lease.ID))
	_, err = admin.Txn(ctx).If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, "", clientv3.WithLease(lease.ID))).Commit()
	require.NoError(t, err)

	s2 := session(t, admin, etcdsync.WithLease(lease.ID))
	m2 := etcdsync.NewMutex(s2, "r8-rwait")
	lctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, m2.Lock(lctx), context.DeadlineExceeded)
	require.NoError(t, holder.Unlock(ctx))

	nameFree(t, ctx, admin, "r8-rwait", "the cancelled resumed waiter's key")
}

// As TestSweeperLeavesClaimAfterUnlock, for acquires that fail after
// writing: once a create of unknown outcome has started the sweeper for a
// key, a later acquire of that key that fails (a Lock whose ctx ends while it
// waits, the usual "try for a while" loop) must not leave the sweeper a
// create to act on: once the acquire frees the key, TryLock on the same
// session and name must not return ErrLocked ("held, or waited for, by this
// session") while nobody holds or waits for the name. "unswept" is the
// control.
func TestSweeperLeavesClaimAfterFailedLock(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	sweptOrNot(t, "r9-steal", func(t *testing.T, ctx context.Context, c *etcdtest.Cluster, m *etcdsync.Mutex) {
		holder := etcdsync.NewMutex(session(t, c.Client(t)), "r9-steal")
		freeTryLocks(t, ctx, m, 5, 100*time.Millisecond, func() {
			require.NoError(t, holder.Lock(ctx))
			lctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			require.ErrorIs(t, m.Lock(lctx), context.DeadlineExceeded) // it waited, and withdrew its key
			cancel()
			require.NoError(t, holder.Unlock(ctx))
		})
	})
}

func TestCancelledAcquiresLeaveNoKey(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	holder := etcdsync.NewSemaphore(session(t, cli), "r12cancel", 3)
	require.NoError(t, holder.Acquire(ctx, 2))
	w := etcdsync.NewRWMutex(session(t, cli), "r12cancelrw")
	s := session(t, cli)
	sm := etcdsync.NewSemaphore(s, "r12cancel", 3)
	rw := etcdsync.NewRWMutex(s, "r12cancelrw")
	for i := 0; i < 48; i++ {
		if i == 24 {
			require.NoError(t, w.Lock(ctx)) // now readers wait too
		}
		cctx, cancel := context.WithTimeout(ctx, time.Duration(i%12)*250*time.Microsecond)
		var err error
		switch i % 4 {
		case 0:
			err = sm.Acquire(cctx, 2)
		case 1:
			err = sm.TryAcquire(cctx, 2)
		case 2:
			err = rw.RLock(cctx)
		case 3:
			err = rw.TryRLock(cctx)
		}
		cancel()
		if err == nil {
			if i%4 < 2 {
				t.Fatalf("trial %d: %d+2 of 3 permits", i, 2)
			}
			require.Less(t, i, 24, "trial %d: a read hold beside the writer", i)
			require.NoError(t, rw.RUnlock(ctx))
		}
		require.Equal(t, []string{holder.Key()}, keys(t, cli, "r12cancel/"), "trial %d", i)
		if i >= 24 {
			require.Equal(t, []string{w.Key()}, keys(t, cli, "r12cancelrw/"), "trial %d", i)
		}
	}
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, holder.Release(ctx))
	waitCount(t, cli, "r12cancel", 5*time.Second, func(n int) bool { return n == 0 })
}

// lateCreate waits for the create that a follower cut off from its peers
// forwarded to be applied, and returns its revision.
func lateCreate(t *testing.T, wch clientv3.WatchChan) int64 {
	t.Helper()
	for {
		select {
		case wr := <-wch:
			require.NoError(t, wr.Err())
			for _, ev := range wr.Events {
				if ev.IsCreate() {
					return ev.Kv.CreateRevision
				}
			}
		case <-time.After(testTimeout):
			t.Fatal("the forwarded create was never applied: the rig no longer reproduces a late create")
		}
	}
}

// A create sent to a follower cut off from its peers is forwarded to the
// leader and sits in the network; the client gives up and its cleanup, served
// by another member, finds nothing. When the partition heals the create is
// applied. The session must remove that key although it lives on, so that
// the name is not blocked until the session ends. Invariant "Nothing left".
func TestLateCreateIsSwept(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.Conn(t, f.Endpoint())
	red := &faults.UnaryVia{Conn: viaF}
	s := session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, red.Dial()))
	m := etcdsync.NewMutex(s, "late")
	from, err := admin.Get(ctx, "late/")
	require.NoError(t, err)

	require.NoError(t, c.CutPeers(f))
	red.Arm(faults.TxnMethod, 1) // the create goes to f
	lctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err = m.Lock(lctx)
	cancel()
	require.Error(t, err)
	require.Empty(t, keys(t, admin, "late/"), "the create was applied before the heal")
	require.NoError(t, c.HealPeers(f))

	// The forwarded create is applied late, and the session sweeps it.
	wch := admin.Watch(ctx, "late/", clientv3.WithPrefix(), clientv3.WithRev(from.Header.Revision+1))
	created := lateCreate(t, wch)
	other := etcdsync.NewMutex(session(t, admin), "late")
	octx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	require.NoError(t, other.Lock(octx), "the late-applied key of a live session blocks the name")
	require.Greater(t, other.Rev(), created)
	require.NoError(t, other.Unlock(ctx))
	require.Empty(t, keys(t, admin, "late/"))
	require.NoError(t, s.Err(), "the session lives on")
}

// Lock behind a holder, cancelled at every moment from its create through
// its prefix watch's creation and the read it may need: each fails and
// leaves the holder's key alone.
func TestCancelsAcrossThePrefixWatchLeaveNothing(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	h := heldMutex(t, ctx, admin, "cxl")
	s := session(t, admin)
	lctx, lcancel := context.WithCancel(ctx)
	load := doneAsync(t, "load", func() error { // writes so that Created is often past the enqueue
		for i := 0; lctx.Err() == nil; i++ {
			if _, err := admin.Put(lctx, "cxl-load", fmt.Sprint(i)); err != nil && lctx.Err() == nil {
				return err
			}
		}
		return nil
	})
	for i := range 60 {
		rctx, cancel := context.WithTimeout(ctx, time.Duration(i%20)*400*time.Microsecond)
		err := etcdsync.NewMutex(s, "cxl").Lock(rctx)
		cancel()
		require.Error(t, err, "trial %d", i)
		require.Equal(t, []string{h.Key()}, keys(t, admin, "cxl/"), "trial %d", i)
	}
	lcancel()
	within(t, load, testTimeout, "load")
	require.NoError(t, h.Unlock(ctx))
}

// A session that lost contact, closed while the cluster's leader keeps
// moving: each leader change re-arms every lease on the server, so its
// own expiry keeps moving away; Close keeps revoking through the moves
// (the first second of it on a still silent link), and the session's key
// is gone while the moves go on.
func TestCloseAfterLostContactRevokesWhileTheLeaderMoves(t *testing.T) {
	t.Parallel()
	c := three(t)
	admin, ctx := c.Client(t), ctxT(t)
	const name = "close-moving"
	p := etcdtest.NewProxy(t, strings.TrimPrefix(c.Member(0).Endpoint(), "http://"))
	cli := etcdtest.NewClient(t, []string{p.Endpoint()})
	s := session(t, cli, etcdsync.WithTTL(2*time.Second))
	require.NoError(t, etcdsync.NewMutex(s, name).Lock(ctx))
	p.Blackhole(true)
	t.Cleanup(func() { p.Blackhole(false) })
	within(t, s.Done(), testTimeout, "the session's end for lost contact")

	moving, stop := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(moving)
		for {
			mctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_ = c.TransferLeader(mctx) // a move that fails is followed by the next
			cancel()
			select {
			case <-stop:
				return
			case <-time.After(500 * time.Millisecond):
			}
		}
	}()
	defer func() { close(stop); <-moving }()
	closed := async(s.Close)
	time.Sleep(1500 * time.Millisecond) // the fault's schedule: the link stays silent for Close's first 1.5 s
	p.Blackhole(false)
	require.NoError(t, resultWithin(t, closed, testTimeout, "Close"))
	waitCount(t, admin, name+"/", 5*time.Second, func(have int) bool { return have == 0 })
	select {
	case <-moving:
		t.Fatal("the leader stopped moving before the key went")
	default:
	}
}
