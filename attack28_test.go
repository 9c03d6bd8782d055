package etcdsync_test

// Adversarial tests of the shared watch streams, the multi-slot acquire
// step, MultiLock and Group (attack 28).

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/faults"
)

// A MultiLock waiter whose key on a name it already got its turn on is
// deleted while it waits for a later name must not come out holding: its
// doc says a waiter whose own key on any name vanishes returns
// ErrSessionExpired at once. Meanwhile another Mutex may take that name; a
// Lock returning nil then makes two holders of it.
func TestAttackMultiLockKeyDeletedOnEarlierNameWhileWaitingForLater(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	holder := heldMutex(t, ctx, cli, "a28ml1/b")
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "a28ml1/a", "a28ml1/b")
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, cli, "a28ml1/b/", 2)
	// Its turn on a came at once; it waits on b. Delete its key on a.
	_, err := cli.Delete(ctx, keyOf("a28ml1/a", s))
	require.NoError(t, err)
	other := etcdsync.NewMutex(session(t, cli), "a28ml1/a")
	require.NoError(t, other.Lock(ctx), "a Mutex takes a, whose MultiLock key is gone")
	select {
	case err := <-got:
		require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "MultiLock whose key on a went")
		require.NoError(t, holder.Unlock(ctx))
	case <-time.After(2 * time.Second):
		// It did not notice; let its turn on b come and see what it says.
		require.NoError(t, holder.Unlock(ctx))
		err := resultWithin(t, got, testTimeout, "MultiLock after b's release")
		if err == nil {
			t.Errorf("MultiLock.Lock returned nil (holding a at rev %d) while a Mutex holds a at rev %d: two holders of a; Check=%v",
				ml.Rev("a28ml1/a"), other.Rev(), ml.Check())
			_ = ml.Unlock(ctx)
		} else {
			t.Errorf("MultiLock did not return at once when its key on a went (returned %v only after b's release)", err)
		}
	}
	require.NoError(t, other.Unlock(ctx))
	waitNoKeys(t, cli, "a28ml1/")
}

// lockWaiter is a Mutex.Lock in flight and where its result goes.
type lockWaiter struct {
	m   *etcdsync.Mutex
	key string
	res <-chan error
}

// Forty waits on three names, all on one client (so that each gRPC watch
// stream carries waits of several names and progress answers requested by
// one wait reach the others), and rounds of one transaction that deletes,
// on every name at one revision, the holder's key and the first waiter's:
// each first waiter returns ErrSessionExpired (its key went at the revision
// its turn would have come), each second waiter holds, nobody else moves.
func TestAttackSharedStreamsSameRevisionDeletesAcrossNames(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli := c.Client(t)
	names := []string{"a28ss/x", "a28ss/y", "a28ss/z"}
	perName := 14 // 42 waits: three streams, each with waits of every name
	if testing.Short() {
		perName = 6 // 18 waits: two streams
	}
	queues := make(map[string][]*lockWaiter)
	for i := range perName {
		for _, name := range names {
			s := session(t, cli)
			m := etcdsync.NewMutex(s, name)
			w := &lockWaiter{m: m, key: keyOf(name, s), res: async(func() error { return m.Lock(ctx) })}
			queues[name] = append(queues[name], w)
			waitKeys(t, admin, name+"/", i+1) // FIFO order is start order
		}
	}
	for _, name := range names {
		require.NoError(t, resultWithin(t, queues[name][0].res, testTimeout, "first Lock"))
	}
	for round := 0; len(queues[names[0]]) >= 3; round++ {
		var ops []clientv3.Op
		for _, name := range names {
			q := queues[name]
			ops = append(ops, clientv3.OpDelete(q[0].key), clientv3.OpDelete(q[1].key))
		}
		_, err := admin.Txn(ctx).Then(ops...).Commit()
		require.NoError(t, err)
		for _, name := range names {
			q := queues[name]
			require.ErrorIs(t, resultWithin(t, q[1].res, 5*time.Second, "first waiter"), etcdsync.ErrSessionExpired, "round %d %s", round, name)
			require.NoError(t, resultWithin(t, q[2].res, 5*time.Second, "second waiter"), "round %d %s", round, name)
			within(t, q[0].m.Done(), 5*time.Second, "Done of the deleted hold")
			queues[name] = q[2:]
		}
		for _, name := range names {
			for _, w := range queues[name][1:] {
				notYet(t, w.res, 0, "a waiter behind the new holder")
			}
			resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend), clientv3.WithLimit(1))
			require.NoError(t, err)
			require.Equal(t, queues[name][0].key, string(resp.Kvs[0].Key), "the holder is the oldest key")
		}
	}
	for _, name := range names {
		q := queues[name]
		require.NoError(t, q[0].m.Unlock(ctx))
		for _, w := range q[1:] {
			require.NoError(t, resultWithin(t, w.res, 5*time.Second, "last waiters"))
			require.NoError(t, w.m.Unlock(ctx))
		}
	}
	waitNoKeys(t, admin, "a28ss/")
}

// A MultiLock waiting for a later name whose session's lease is revoked
// returns ErrSessionExpired at once, and leaves no key on any name.
func TestAttackMultiLockLeaseRevokedMidWaitReturnsAndLeavesNothing(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	hb := heldMutex(t, ctx, cli, "a28ml2/b")
	hc := heldMutex(t, ctx, cli, "a28ml2/c")
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "a28ml2/a", "a28ml2/b", "a28ml2/c")
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, cli, "a28ml2/c/", 2)
	notYet(t, got, 200*time.Millisecond, "MultiLock while b and c are held")
	_, err := cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, got, 5*time.Second, "MultiLock whose lease was revoked"), etcdsync.ErrSessionExpired)
	require.Empty(t, keys(t, cli, "a28ml2/a/"))
	require.Equal(t, []string{hb.Key()}, keys(t, cli, "a28ml2/b/"))
	require.Equal(t, []string{hc.Key()}, keys(t, cli, "a28ml2/c/"))
	require.ErrorIs(t, ml.Unlock(ctx), etcdsync.ErrLockReleased)
}

// A MultiLock cancelled while it waits for its first taken name, after that
// name's turn came while it waits for a later one, or as the turn of a later
// one comes, leaves only the holders' keys; a Mutex behind it on a free name
// then takes that name at once.
func TestAttackMultiLockCancelledInEachWaitLeavesOnlyHolders(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	for trial := range 6 {
		prefix := fmt.Sprintf("a28ml3/%d/", trial)
		a, b, c := prefix+"a", prefix+"b", prefix+"c"
		ha := heldMutex(t, ctx, cli, a)
		hc := heldMutex(t, ctx, cli, c)
		ml := etcdsync.NewMultiLock(session(t, cli), a, b, c)
		rctx, cancel := context.WithCancel(ctx)
		got := async(func() error { return ml.Lock(rctx) })
		waitKeys(t, cli, a+"/", 2)
		if trial >= 2 {
			require.NoError(t, ha.Unlock(ctx)) // its turn on a comes; it waits on c
			if trial >= 4 {
				require.NoError(t, hc.Unlock(ctx)) // its turn on c comes as it is cancelled
			}
		}
		if trial%2 == 1 {
			time.Sleep(2 * time.Millisecond)
		}
		cancel()
		err := resultWithin(t, got, 5*time.Second, "cancelled MultiLock")
		if err == nil { // it won the race: it holds, release
			require.GreaterOrEqual(t, trial, 4)
			require.NoError(t, ml.Unlock(ctx))
		} else {
			require.ErrorIs(t, err, context.Canceled, "trial %d", trial)
		}
		var want []string
		if trial < 2 {
			want = append(want, ha.Key())
		}
		if trial < 4 {
			want = append(want, hc.Key())
		}
		require.ElementsMatch(t, want, keys(t, cli, prefix), "trial %d", trial)
		m := etcdsync.NewMutex(session(t, cli), b)
		require.NoError(t, m.TryLock(ctx), "trial %d: b is free", trial)
		require.NoError(t, m.Unlock(ctx))
		if trial < 2 {
			require.NoError(t, ha.Unlock(ctx))
		}
		if trial < 4 {
			require.NoError(t, hc.Unlock(ctx))
		}
	}
}

// A MultiLock's create that commits while its reply is lost fails the Lock,
// and the keys it wrote on every name are removed (swept); the value can
// lock again.
func TestAttackMultiLockCreateReplyLostLeavesNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	var sc faults.Script
	cli := c.Client(t, sc.Dial())
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "a28ml4/a", "a28ml4/b", "a28ml4/c")
	sc.Arm(faults.TxnMethod, faults.ReplyLost)
	err := ml.Lock(ctx)
	require.Error(t, err)
	waitNoKeys(t, admin, "a28ml4/")
	require.ErrorIs(t, ml.Unlock(ctx), etcdsync.ErrLockReleased)
	require.NoError(t, ml.Lock(ctx))
	require.NoError(t, ml.Unlock(ctx))
	waitNoKeys(t, admin, "a28ml4/")
}

// Under every deployment (namespace, gRPC proxy, in-process client...): a
// MultiLock waits for etcd's own Mutex (taken on the raw keyspace, under
// the deployment's prefix) on one of its names, holds once it is released,
// excludes it meanwhile, and a waiter whose key on the name it waits for
// goes with its predecessor's (one transaction) returns ErrSessionExpired,
// leaving nothing.
func TestAttackMultiLockAcrossDeployments(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		t.Run(rig.name, func(t *testing.T) {
			if testing.Short() && !rig.short {
				t.Skip("skipped in -short")
			}
			t.Parallel()
			d := rig.start(t)
			ctx := ctxCell(t)
			ws, created := watchedSession(t, d)
			ss := []*etcdsync.Session{ws, d.sessions(t, 1)[0]}
			a, b := "a28dep/a", "a28dep/b"
			theirs := concurrency.NewMutex(theirSession(t, d.admin), d.prefix+b)
			require.NoError(t, theirs.Lock(ctx))
			ml := etcdsync.NewMultiLock(ss[0], a, b)
			got := async(func() error { return ml.Lock(ctx) })
			awaitCreated(t, created, 2, cellTimeout, "its watches of its key on b and etcd's")
			notYet(t, got, blockedFor, "MultiLock while etcd's Mutex holds b")
			require.NoError(t, theirs.Unlock(ctx))
			require.NoError(t, resultWithin(t, got, cellTimeout, "MultiLock after etcd's Mutex released b"))
			tctx, cancel := context.WithTimeout(ctx, blockedFor)
			err := theirs.Lock(tctx)
			cancel()
			require.Error(t, err, "etcd's Mutex took b while the MultiLock holds it")
			require.NoError(t, ml.Unlock(ctx))

			// Same-revision delete of the holder's and the waiter's key on b.
			holder := etcdsync.NewMutex(ss[1], b)
			require.NoError(t, holder.Lock(ctx))
			got = async(func() error { return ml.Lock(ctx) })
			awaitCreated(t, created, 2, cellTimeout, "its watches of its key on b and the holder's")
			_, err = d.admin.Txn(ctx).Then(clientv3.OpDelete(d.prefix+holder.Key()), clientv3.OpDelete(d.prefix+keyOf(b, ss[0]))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, resultWithin(t, got, cellTimeout, "MultiLock whose key on b went with the holder's"), etcdsync.ErrSessionExpired)
			within(t, holder.Done(), cellTimeout, "Done of the deleted hold")
			require.Empty(t, rawKeys(t, d, a))
			require.Empty(t, rawKeys(t, d, b))
		})
	}
}

// Waits sharing streams on a follower cut off from its peers: one
// transaction (on the quorum) deletes, on two names at one revision, the
// holder's key and the first waiter's. Nothing moves while the follower
// lags; once it heals, each first waiter returns ErrSessionExpired, each
// second waiter holds (its Done open), the rest wait.
func TestAttackSharedStreamsOnLaggingFollowerSameRevisionDeletes(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	fi, ui := slices.Index(c.Members(), f), slices.Index(c.Members(), u)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	cli := faults.RoutedClient(t, c, fi, ui) // watches on f, the rest on u
	names := []string{"a28lag/x", "a28lag/y"}
	const perName = 9
	queues := make(map[string][]*lockWaiter)
	for i := range perName {
		for _, name := range names {
			s := session(t, cli, etcdsync.WithTTL(30*time.Second))
			m := etcdsync.NewMutex(s, name)
			w := &lockWaiter{m: m, key: keyOf(name, s), res: async(func() error { return m.Lock(ctx) })}
			queues[name] = append(queues[name], w)
			waitKeys(t, admin, name+"/", i+1)
		}
	}
	for _, name := range names {
		require.NoError(t, resultWithin(t, queues[name][0].res, testTimeout, "first Lock"))
	}
	for round := 0; round < 3; round++ {
		resp, err := admin.Get(ctx, "a28lag-rev")
		require.NoError(t, err)
		faults.CaughtUp(t, f, resp.Header.Revision) // every waiter watches from here
		require.NoError(t, c.CutPeers(f))
		var ops []clientv3.Op
		for _, name := range names {
			q := queues[name]
			ops = append(ops, clientv3.OpDelete(q[0].key), clientv3.OpDelete(q[1].key))
		}
		_, err = admin.Txn(ctx).Then(ops...).Commit()
		require.NoError(t, err)
		for _, name := range names {
			for _, w := range queues[name][1:] {
				notYet(t, w.res, 0, "a waiter while its member lags")
			}
		}
		notYet(t, queues[names[0]][2].res, 300*time.Millisecond, "second waiter while its member lags")
		require.NoError(t, c.HealPeers(f))
		for _, name := range names {
			q := queues[name]
			require.ErrorIs(t, resultWithin(t, q[1].res, 10*time.Second, "first waiter"), etcdsync.ErrSessionExpired, "round %d %s", round, name)
			require.NoError(t, resultWithin(t, q[2].res, 10*time.Second, "second waiter"), "round %d %s", round, name)
			require.NoError(t, q[2].m.Check())
			queues[name] = q[2:]
		}
		for _, name := range names {
			for _, w := range queues[name][1:] {
				notYet(t, w.res, 0, "a waiter behind the new holder")
			}
		}
	}
	for _, name := range names {
		q := queues[name]
		require.NoError(t, q[0].m.Unlock(ctx))
		for _, w := range q[1:] {
			require.NoError(t, resultWithin(t, w.res, 10*time.Second, "last waiters"))
			require.NoError(t, w.m.Unlock(ctx))
		}
	}
	waitNoKeys(t, admin, "a28lag/")
}
