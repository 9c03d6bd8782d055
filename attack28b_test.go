package etcdsync_test

// Adversarial tests of the third batch's recipes (attack 28b): MultiLock's
// release, loss and restart paths, its mix with other primitives on one
// name, Barrier, DoubleBarrier and Group views.

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/faults"
)

// manyNames returns n names under prefix.
func manyNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s/%03d", prefix, i)
	}
	return out
}

// A MultiLock on more names than etcd takes operations in one transaction
// (--max-txn-ops, 128 by default: the acquire writes and lists two per
// name) must fail with a clear error wrapping ErrInvalidArgument (bad input,
// as the house rules ask), not a raw etcd error, and leave nothing.
func TestAttack28bMultiLockBeyondMaxTxnOpsIsInvalidArgument(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, manyNames("a28bmany", 65)...)
	err := ml.Lock(ctx)
	require.Error(t, err, "a Lock of 65 names")
	waitNoKeys(t, cli, "a28bmany/")
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument, "a Lock of 65 names: %v", err)
	require.ErrorIs(t, ml.TryLock(ctx), etcdsync.ErrInvalidArgument)
	// 64 names fit in the acquire (128 operations).
	ml64 := etcdsync.NewMultiLock(s, manyNames("a28bmany", 64)...)
	require.NoError(t, ml64.Lock(ctx))
	require.NoError(t, ml64.Unlock(ctx))
	waitNoKeys(t, cli, "a28bmany/")
}

// Unlock racing a loss on one name: an admin deletes the key on one name
// while Unlock runs, so that the relay of the lost name releases the others
// as Unlock does. Whoever wins, every key goes, Unlock returns nil or an
// error wrapping ErrLockReleased, Done closes, and the value locks again.
func TestAttack28bMultiLockUnlockRacingLossOnOneName(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	names := []string{"a28bur/a", "a28bur/b", "a28bur/c"}
	ml := etcdsync.NewMultiLock(s, names...)
	rounds := 20
	if testing.Short() {
		rounds = 6
	}
	for i := range rounds {
		require.NoError(t, ml.Lock(ctx), "round %d", i)
		done := ml.Done()
		key := ml.Key(names[i%3]) // before Unlock may have ended the hold
		var wg sync.WaitGroup
		wg.Add(2)
		var uerr, derr error
		go func() {
			defer wg.Done()
			_, derr = admin.Delete(ctx, key)
		}()
		go func() {
			defer wg.Done()
			if i%2 == 1 {
				time.Sleep(time.Duration(i) * 200 * time.Microsecond)
			}
			uerr = ml.Unlock(ctx)
		}()
		wg.Wait()
		require.NoError(t, derr, "round %d: the admin's delete", i)
		if uerr != nil {
			require.ErrorIs(t, uerr, etcdsync.ErrLockReleased, "round %d", i)
		}
		within(t, done, testTimeout, "Done")
		require.Error(t, ml.Err())
		waitNoKeys(t, admin, "a28bur/")
		require.ErrorIs(t, ml.Unlock(ctx), etcdsync.ErrLockReleased, "round %d: a second Unlock", i)
	}
}

// Do after a loss on one name that nobody watched (no Done, no Check):
// nothing is written, the error wraps ErrNotHeld, the hold ends (Done
// closed, Err says why) and the keys on the other names are released.
func TestAttack28bMultiLockDoAfterUnwatchedLossReleasesTheRest(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	ml := etcdsync.NewMultiLock(s, "a28bdo/a", "a28bdo/b", "a28bdo/c")
	require.NoError(t, ml.Lock(ctx))
	_, err := admin.Delete(ctx, ml.Key("a28bdo/b"))
	require.NoError(t, err)
	_, err = ml.Do(ctx, clientv3.OpPut("a28bdo-out", "x"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	resp, err := admin.Get(ctx, "a28bdo-out")
	require.NoError(t, err)
	require.Empty(t, resp.Kvs, "Do wrote after a loss")
	within(t, ml.Done(), testTimeout, "Done after Do found a key gone")
	require.ErrorIs(t, ml.Err(), etcdsync.ErrNotHeld)
	waitNoKeys(t, admin, "a28bdo/")
	_, err = ml.Do(ctx, clientv3.OpPut("a28bdo-out", "x"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.ErrorIs(t, ml.Unlock(ctx), etcdsync.ErrLockReleased)
	require.NoError(t, ml.Lock(ctx), "locks again")
	require.NoError(t, ml.Unlock(ctx))
}

// TryLock on names that have only nested keys under them (NAME/x/...,
// another name's): nothing blocks, so it holds, in the fallback enqueue;
// when one name is held as well it writes nothing. The nested keys stay.
func TestAttack28bMultiLockTryLockWithOnlyNestedKeys(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	nested := []string{"a28btn/a/x/1", "a28btn/b/y/z"}
	for _, k := range nested {
		_, err := admin.Put(ctx, k, "")
		require.NoError(t, err)
	}
	s := session(t, admin)
	ml := etcdsync.NewMultiLock(s, "a28btn/a", "a28btn/b")
	require.NoError(t, ml.TryLock(ctx))
	require.NoError(t, ml.Check())
	require.ErrorIs(t, etcdsync.NewMutex(session(t, admin), "a28btn/b").TryLock(ctx), etcdsync.ErrLocked)
	require.NoError(t, ml.Unlock(ctx))

	holder := heldMutex(t, ctx, admin, "a28btn/b/y") // a nested name's hold: blocks nobody here
	require.NoError(t, ml.TryLock(ctx))
	require.NoError(t, ml.Unlock(ctx))
	other := heldMutex(t, ctx, admin, "a28btn/b")
	resp, err := admin.Get(ctx, "a28btn/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.ErrorIs(t, ml.TryLock(ctx), etcdsync.ErrLocked)
	after, err := admin.Get(ctx, "a28btn/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Equal(t, resp.Header.Revision, after.Header.Revision, "a TryLock on a held set wrote")
	require.NoError(t, other.Unlock(ctx))
	require.NoError(t, holder.Unlock(ctx))
	require.ElementsMatch(t, nested, keys(t, admin, "a28btn/"))
}

// A MultiLock and a Semaphore on one name write the same key layout
// (NAME/<lease-hex>): the MultiLock waits for the semaphore's holders; a
// semaphore behind a MultiLock's key cannot read its weight and must say
// so (ErrInvalidArgument), not hang or panic, and leave no key.
func TestAttack28bMultiLockAndSemaphoreOnOneName(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	sem := etcdsync.NewSemaphore(session(t, admin), "a28bsm/n", 2)
	require.NoError(t, sem.Acquire(ctx, 1))
	ml := etcdsync.NewMultiLock(session(t, admin), "a28bsm/n", "a28bsm/m")
	require.ErrorIs(t, ml.TryLock(ctx), etcdsync.ErrLocked)
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, admin, "a28bsm/n/", 2)
	notYet(t, got, 200*time.Millisecond, "MultiLock while a semaphore holds a permit of n")
	require.NoError(t, sem.Release(ctx))
	require.NoError(t, resultWithin(t, got, testTimeout, "MultiLock after the semaphore's release"))

	sem2 := etcdsync.NewSemaphore(session(t, admin), "a28bsm/n", 2)
	tctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	err := sem2.Acquire(tctx, 1)
	cancel()
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument, "a semaphore behind a MultiLock's key: %v", err)
	require.Equal(t, []string{ml.Key("a28bsm/n")}, keys(t, admin, "a28bsm/n/"))
	require.NoError(t, ml.Unlock(ctx))
	waitNoKeys(t, admin, "a28bsm/")
}

// A MultiLock and an RWMutex on one name use different keys (NAME/<hex>
// and NAME/write/<hex>, a nested name): they do not exclude each other.
// Pinned so that a change of either layout is seen.
func TestAttack28bMultiLockAndRWMutexOnOneNameDoNotExclude(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	rw := etcdsync.NewRWMutex(session(t, admin), "a28brw/n")
	require.NoError(t, rw.Lock(ctx))
	ml := etcdsync.NewMultiLock(session(t, admin), "a28brw/n", "a28brw/m")
	require.NoError(t, ml.TryLock(ctx), "the RWMutex's write key is a nested name's")
	rw2 := etcdsync.NewRWMutex(session(t, admin), "a28brw/n")
	require.ErrorIs(t, rw2.TryRLock(ctx), etcdsync.ErrLocked)
	require.NoError(t, ml.Unlock(ctx))
	require.NoError(t, rw.Unlock(ctx))
	waitNoKeys(t, admin, "a28brw/")
}

// A process restarted with WithLease adopts the keys of its previous
// MultiLock: when all are there it holds them again at once, at the same
// revision, without a write; when one was deleted, Lock fails with an
// error wrapping ErrInvalidArgument, writes nothing and deletes nothing
// (the held keys are the earlier process's); a Mutex of the session on
// that name resumes and releases it.
func TestAttack28bMultiLockRestartAdoptsKeys(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	names := []string{"a28brs/a", "a28brs/b", "a28brs/c"}
	lease, err := admin.Grant(ctx, 30)
	require.NoError(t, err)
	old, err := etcdsync.NewSession(admin, etcdsync.WithLease(lease.ID))
	require.NoError(t, err)
	ml := etcdsync.NewMultiLock(old, names...)
	require.NoError(t, ml.Lock(ctx))
	rev := ml.Rev(names[0])
	old.Orphan()

	s := session(t, admin, etcdsync.WithLease(lease.ID))
	again := etcdsync.NewMultiLock(s, names...)
	before, err := admin.Get(ctx, "a28brs/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.NoError(t, again.Lock(ctx))
	for _, n := range names {
		require.Equal(t, rev, again.Rev(n), "resumed %s", n)
	}
	require.NoError(t, again.Check())
	after, err := admin.Get(ctx, "a28brs/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "a resumed MultiLock wrote")
	s.Orphan()

	// One key gone: the set is not one acquire's any more.
	_, err = admin.Delete(ctx, keyOf(names[1], s))
	require.NoError(t, err)
	s2 := session(t, admin, etcdsync.WithLease(lease.ID))
	third := etcdsync.NewMultiLock(s2, names...)
	err = third.Lock(ctx)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	require.ElementsMatch(t, []string{keyOf(names[0], s2), keyOf(names[2], s2)}, keys(t, admin, "a28brs/"))
	err = third.TryLock(ctx)
	require.Error(t, err)
	require.ElementsMatch(t, []string{keyOf(names[0], s2), keyOf(names[2], s2)}, keys(t, admin, "a28brs/"))
	for _, n := range []string{names[0], names[2]} {
		m := etcdsync.NewMutex(s2, n)
		require.NoError(t, m.Lock(ctx))
		require.Equal(t, rev, m.Rev())
		require.NoError(t, m.Unlock(ctx))
	}
	require.NoError(t, third.Lock(ctx))
	require.NoError(t, third.Unlock(ctx))
	require.NoError(t, s2.Close())
	waitNoKeys(t, admin, "a28brs/")
}

// keptTxns is an interceptor that, while armed, fails the next Txn unsent
// and keeps its request, to be applied later (a release the server applies
// after its caller gave up on it).
type keptTxns struct {
	mu    sync.Mutex
	armed bool
	kept  []*pb.TxnRequest
}

func (l *keptTxns) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		l.mu.Lock()
		tr, ok := req.(*pb.TxnRequest)
		if ok && l.armed {
			l.armed = false
			l.kept = append(l.kept, tr)
			l.mu.Unlock()
			return faults.Unavailable("kept for later")
		}
		l.mu.Unlock()
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// A MultiLock's Unlock (one transaction of nested fenced deletes) applied
// late, after a retried Unlock released the names and the same session's
// MultiLock and another's Mutex took them again (same key names, new
// revisions), deletes nothing.
func TestAttack28bMultiLockLateUnlockDeletesNoNewerHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	late := &keptTxns{}
	cli := c.Client(t, late.dial())
	s := session(t, cli)
	names := []string{"a28blt/a", "a28blt/b"}
	ml := etcdsync.NewMultiLock(s, names...)
	require.NoError(t, ml.Lock(ctx))
	late.mu.Lock()
	late.armed = true
	late.mu.Unlock()
	require.Error(t, ml.Unlock(ctx), "the kept Unlock")
	require.NoError(t, ml.Check(), "a failed Unlock still holds")
	require.NoError(t, ml.Unlock(ctx), "retried")
	require.NoError(t, ml.Lock(ctx), "the same session again: same keys, new revisions")
	m := heldMutex(t, ctx, admin, "a28blt/c")
	want := keys(t, admin, "a28blt/")
	conn := etcdtest.Conn(t, c.Endpoints()[0])
	resp, err := pb.NewKVClient(conn).Txn(ctx, late.kept[0])
	require.NoError(t, err)
	for i, r := range resp.Responses {
		require.False(t, r.GetResponseTxn().Succeeded, "nested delete %d of the late Unlock deleted a newer hold", i)
	}
	require.Equal(t, want, keys(t, admin, "a28blt/"))
	require.NoError(t, ml.Check())
	require.NoError(t, ml.Unlock(ctx))
	require.NoError(t, m.Unlock(ctx))
	waitNoKeys(t, admin, "a28blt/")
}

// Members created at one revision (one transaction of an admin, of etcd's
// clients) tie on create revision. A view from the watch and a read at the
// same revision must list them in the same order: observers that take
// "the oldest member" (a coordinator) from Watch and from Members must
// agree. The watch inserts each event before the members of its revision
// (slices.BinarySearchFunc finds the first of equal revisions), so the
// watch's order is the reverse of the transaction's; etcd's read sorts them
// by key.
func TestAttack28bGroupViewOrderOfSameRevisionJoinsMatchesRead(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "a28bgo"
	a := joined(t, ctx, cli, name, "a")
	views := watchGroup(t, a)
	requireExact(t, cli, name, nextView(t, views))
	lease, err := cli.Grant(ctx, 30)
	require.NoError(t, err)
	resp, err := cli.Txn(ctx).Then(
		clientv3.OpPut(name+"/1f", "one", clientv3.WithLease(lease.ID)),
		clientv3.OpPut(name+"/2f", "two", clientv3.WithLease(lease.ID)),
		clientv3.OpPut(name+"/3f", "three", clientv3.WithLease(lease.ID))).Commit()
	require.NoError(t, err)
	v := nextView(t, views)
	require.Equal(t, resp.Header.Revision, v.Rev)
	members, rev, err := a.Members(ctx)
	require.NoError(t, err)
	require.Equal(t, rev, v.Rev)
	require.Equal(t, membersSeen(members), membersSeen(v.Members), "the watch's view and the read at one revision")
	_, err = cli.Revoke(ctx, lease.ID)
	require.NoError(t, err)
}

// A party whose key goes (lease revoked, or its Enter cancelled) after the
// party that makes count has read the round but before it puts ready: the
// doc says such a party no longer counts and the others go on waiting for
// count parties. fill's transaction checks only the filler's own key and
// ready, not the parties it counted, so the filler lets a round of one out
// of Enter with count 2.
func TestAttack28bDoubleBarrierFillAfterACountedPartyWent(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	const name = "a28bdb"
	first, s0 := newParty(t, admin, name, 2)
	e0 := async(func() error { return first.Enter(ctx) })
	waitKeys(t, admin, name+"/waiters/", 1)

	var sc faults.Script
	cli := c.Client(t, sc.Dial())
	s1 := session(t, cli)
	second := etcdsync.NewDoubleBarrier(s1, name, 2)
	gate, reached := make(chan struct{}), make(chan struct{})
	sc.Arm(faults.TxnMethod, faults.Pass, func(c faults.Call) error { // the join, then the fill
		close(reached)
		<-gate
		return c.Invoke()
	})
	e1 := async(func() error { return second.Enter(ctx) })
	within(t, reached, testTimeout, "the second party's put of ready")
	_, err := admin.Revoke(ctx, s0.Lease())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, e0, testTimeout, "the first party whose lease was revoked"), etcdsync.ErrSessionExpired)
	close(gate)
	select {
	case err := <-e1:
		t.Errorf("Enter of a double barrier of 2 returned (%v) with one party in: %v", err, keys(t, admin, name+"/"))
		if err == nil {
			require.NoError(t, second.Leave(ctx))
		}
	case <-time.After(time.Second):
		third, _ := newParty(t, admin, name, 2)
		require.NoError(t, third.Enter(ctx))
		require.NoError(t, resultWithin(t, e1, testTimeout, "the second party once a third came"))
		l := async(func() error { return third.Leave(ctx) })
		require.NoError(t, second.Leave(ctx))
		require.NoError(t, resultWithin(t, l, testTimeout, "Leave"))
	}
	waitNoKeys(t, admin, name+"/")
}

// A MultiLock waiting on its first name (held by a Mutex), whose key on a
// later name (free, its turn there came at once) is deleted: the wait's
// watch of its other keys returns ErrSessionExpired at once, and its key on
// the first name goes too.
func TestAttack28bMultiLockKeyDeletedOnLaterNameWhileWaitingForEarlier(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	holder := heldMutex(t, ctx, admin, "a28brv/a")
	s := session(t, admin)
	ml := etcdsync.NewMultiLock(s, "a28brv/a", "a28brv/b", "a28brv/c")
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, admin, "a28brv/a/", 2)
	notYet(t, got, 200*time.Millisecond, "MultiLock while a is held")
	_, err := admin.Delete(ctx, keyOf("a28brv/c", s))
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, got, 2*time.Second, "MultiLock whose key on c went"), etcdsync.ErrSessionExpired)
	require.Equal(t, []string{holder.Key()}, keys(t, admin, "a28brv/"))
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, ml.Lock(ctx))
	require.NoError(t, ml.Unlock(ctx))
	waitNoKeys(t, admin, "a28brv/")
}

// Views under churn: members join, leave, change values, lose their lease,
// and an admin deletes two members in one transaction, while a reader
// takes every view: each is exactly the members at its Rev, in revision
// order. Joins and Leaves racing on one Group value leave it consistent:
// a member with its key (and last value), or no key.
func TestAttack28bGroupViewsExactUnderChurnAndJoinLeaveRaces(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const name = "a28bgc"
	watcher := etcdsync.NewGroup(session(t, cli), name)
	views := watchGroup(t, watcher)
	requireExact(t, cli, name, nextView(t, views))
	const workers = 5
	rounds := 12
	if testing.Short() {
		rounds = 6
	}
	var gs []*etcdsync.Group
	var ss []*etcdsync.Session
	for range workers {
		s := session(t, cli)
		ss = append(ss, s)
		gs = append(gs, etcdsync.NewGroup(s, name))
	}
	churned := make(chan struct{})
	go func() {
		defer close(churned)
		var wg sync.WaitGroup
		for w, g := range gs {
			wg.Add(2)
			go func() {
				defer wg.Done()
				for i := range rounds {
					_ = g.Join(ctx, fmt.Sprintf("w%d-%d", w, i))
				}
			}()
			go func() {
				defer wg.Done()
				for range rounds / 2 {
					_ = g.Leave(ctx)
				}
			}()
		}
		wg.Wait()
		_, _ = cli.Txn(ctx).Then(clientv3.OpDelete(keyOf(name, ss[0])), clientv3.OpDelete(keyOf(name, ss[1]))).Commit()
		_, _ = cli.Revoke(ctx, ss[2].Lease())
	}()
	var last int64
	for done := false; !done; {
		select {
		case <-churned:
			done = true
		case v := <-views:
			require.Greater(t, v.Rev, last)
			last = v.Rev
			requireExact(t, cli, name, v)
		}
	}
	members, _, err := watcher.Members(ctx)
	require.NoError(t, err)
	byKey := map[string]string{}
	for _, m := range members {
		byKey[m.Key] = string(m.Value)
	}
	for w, g := range gs {
		if w < 3 {
			within(t, g.Done(), testTimeout, "Done of a deleted or revoked member")
		}
		val, in := byKey[keyOf(name, ss[w])]
		if g.Err() == nil {
			require.True(t, in, "worker %d: a member without its key", w)
			require.Equal(t, fmt.Sprintf("w%d-%d", w, rounds-1), val, "worker %d's value", w)
		} else {
			require.False(t, in, "worker %d: not a member (%v), yet its key is there", w, g.Err())
		}
	}
}
