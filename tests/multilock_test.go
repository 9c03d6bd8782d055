package tests

// MultiLock: every name in one transaction at one revision, so any order
// never deadlocks; waits that keep their place and watch the other keys
// (a key deleted on any name, a lagging member's replayed delete); loss on
// one name releases the rest; cancels, lost replies, late unlocks and
// restarts leave nothing behind and never touch a newer hold; its mix with
// Mutex, RWMutex and Semaphore keys, under every deployment.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"google.golang.org/grpc"
)

// A MultiLock takes every name in one RPC when none is taken: one key per
// name, the key a Mutex on that name writes, all at one create revision,
// which is each name's fencing token. Unlock removes them all.
func TestMultiLockTakesEveryNameInOneRPC(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	cnt := counter{}
	cli := c.Client(t, cnt.dial()...)
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "ml1/c", "ml1/a", "ml1/b", "ml1/a")
	cnt.take()
	require.NoError(t, ml.Lock(ctx))
	rpcs, methods := cnt.take()
	require.EqualValues(t, 1, rpcs, "RPCs to take 3 free names: %v", methods)
	rev := ml.Rev("ml1/a")
	require.NotZero(t, rev)
	for _, name := range []string{"ml1/a", "ml1/b", "ml1/c"} {
		require.Equal(t, keyOf(name, s), ml.Key(name))
		resp, err := admin.Get(ctx, keyOf(name, s))
		require.NoError(t, err)
		require.Len(t, resp.Kvs, 1, name)
		require.Equal(t, rev, resp.Kvs[0].CreateRevision, name)
		require.Equal(t, rev, ml.Rev(name), name)
	}
	require.Zero(t, ml.Rev("ml1/d"))
	require.NoError(t, ml.Check())
	require.NoError(t, ml.Err())
	require.NoError(t, ml.Unlock(ctx))
	require.ErrorIs(t, ml.Err(), etcdsync.ErrLockReleased)
	require.ErrorIs(t, ml.Check(), etcdsync.ErrLockReleased)
	require.Empty(t, keys(t, admin, "ml1/"))
	require.ErrorIs(t, ml.Unlock(ctx), etcdsync.ErrLockReleased)
}

// Callers that name overlapping sets in every order, beside plain Mutexes
// (etcdsync's and etcd's) on single names, never deadlock and never hold a
// name two at a time.
func TestMultiLocksInAnyOrderNeverDeadlock(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli := c.Client(t)
	names := []string{"ml2/x", "ml2/y", "ml2/z"}
	var inside [3]atomic.Int32
	enter := func(idx []int) error {
		for _, i := range idx {
			if inside[i].Add(1) != 1 {
				return fmt.Errorf("%s held twice", names[i])
			}
		}
		time.Sleep(time.Millisecond) // stay inside a moment, so that overlaps would show
		for _, i := range idx {
			inside[i].Add(-1)
		}
		return nil
	}
	sets := [][]int{{0, 1}, {1, 0}, {2, 1, 0}, {1, 2}, {0, 2}, {2, 0, 1}}
	rounds := 8
	if testing.Short() {
		rounds = 4
	}
	var wg sync.WaitGroup
	errs := make(chan error, len(sets)+2)
	for w, set := range sets {
		var of []string
		for _, i := range set {
			of = append(of, names[i])
		}
		ml := etcdsync.NewMultiLock(session(t, cli), of...)
		wg.Go(func() {
			for r := range rounds {
				err := ml.Run(ctx, func(context.Context) error { return enter(set) })
				if err != nil {
					errs <- fmt.Errorf("worker %d round %d: %w", w, r, err)
					return
				}
			}
		})
	}
	m := etcdsync.NewMutex(session(t, cli), names[1])
	wg.Go(func() {
		for r := range rounds {
			if err := m.Run(ctx, func(context.Context) error { return enter([]int{1}) }); err != nil {
				errs <- fmt.Errorf("mutex round %d: %w", r, err)
				return
			}
		}
	})
	theirs := concurrency.NewMutex(theirSession(t, cli), names[2])
	wg.Go(func() {
		for r := range rounds {
			if err := theirs.Lock(ctx); err != nil {
				errs <- fmt.Errorf("etcd's mutex round %d: %w", r, err)
				return
			}
			err := enter([]int{2})
			if uerr := theirs.Unlock(ctx); err == nil {
				err = uerr
			}
			if err != nil {
				errs <- fmt.Errorf("etcd's mutex round %d: %w", r, err)
				return
			}
		}
	})
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	within(t, done, testTimeout, "every worker done (a deadlock would stop them)")
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	require.Empty(t, keys(t, cli, "ml2/"))
}

// A MultiLock whose names are partly taken holds the free ones while it
// waits for the rest, in create-revision order like a Mutex: a Mutex
// behind it on a free name waits for it, and it holds once the taken name
// is released.
func TestMultiLockWaitsForTakenNamesAndKeepsItsPlace(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	holder := heldMutex(t, ctx, cli, "ml3/b")
	ml := etcdsync.NewMultiLock(session(t, cli), "ml3/a", "ml3/b")
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, cli, "ml3/b/", 2)
	behind := etcdsync.NewMutex(session(t, cli), "ml3/a")
	behindGot := async(func() error { return behind.Lock(ctx) })
	waitKeys(t, cli, "ml3/a/", 2)
	notYet(t, got, 200*time.Millisecond, "MultiLock while ml3/b is held")
	notYet(t, behindGot, 0, "Mutex on ml3/a behind the MultiLock")
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, got, testTimeout, "MultiLock after ml3/b's release"))
	notYet(t, behindGot, 200*time.Millisecond, "Mutex on ml3/a while the MultiLock holds")
	require.NoError(t, ml.Unlock(ctx))
	require.NoError(t, resultWithin(t, behindGot, testTimeout, "Mutex on ml3/a after the MultiLock's release"))
	require.NoError(t, behind.Unlock(ctx))
	require.Empty(t, keys(t, cli, "ml3/"))
}

// TryLock on a set with one name held costs one RPC, writes nothing and
// says ErrLocked; on a free set it holds every name in one RPC.
func TestMultiLockTryLockWritesNothingWhenANameIsHeld(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	theirs := concurrency.NewMutex(theirSession(t, admin), "ml4/b")
	require.NoError(t, theirs.Lock(ctx))
	cnt := counter{}
	ml := etcdsync.NewMultiLock(session(t, c.Client(t, cnt.dial()...)), "ml4/a", "ml4/b", "ml4/c")
	before, err := admin.Get(ctx, "ml4-none")
	require.NoError(t, err)
	cnt.take()
	require.ErrorIs(t, ml.TryLock(ctx), etcdsync.ErrLocked)
	rpcs, methods := cnt.take()
	require.EqualValues(t, 1, rpcs, "RPCs of a refused TryLock: %v", methods)
	after, err := admin.Get(ctx, "ml4-none")
	require.NoError(t, err)
	require.Equal(t, before.Header.Revision, after.Header.Revision, "a refused TryLock wrote")
	require.ErrorIs(t, ml.TryRun(ctx, func(context.Context) error { t.Error("fn ran"); return nil }), etcdsync.ErrLocked)
	require.NoError(t, theirs.Unlock(ctx))
	cnt.take()
	require.NoError(t, ml.TryLock(ctx))
	rpcs, methods = cnt.take()
	require.EqualValues(t, 1, rpcs, "RPCs of a TryLock on free names: %v", methods)
	require.ErrorIs(t, ml.TryLock(ctx), etcdsync.ErrLocked, "TryLock on itself")
	require.NoError(t, ml.Unlock(ctx))
	require.Empty(t, keys(t, admin, "ml4/"))
}

// When the hold ends on one name (its key deleted behind the holder's
// back), Done closes, Err says why, the other names are released at once,
// and Unlock reports the loss.
func TestMultiLockLossOnOneNameReleasesEveryName(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "ml5/a", "ml5/b", "ml5/c")
	require.NoError(t, ml.Lock(ctx))
	done := ml.Done()
	_, err := cli.Delete(ctx, keyOf("ml5/b", s))
	require.NoError(t, err)
	within(t, done, testTimeout, "Done after a key was deleted")
	require.ErrorIs(t, ml.Err(), etcdsync.ErrNotHeld)
	require.ErrorIs(t, ml.Check(), etcdsync.ErrNotHeld)
	waitNoKeys(t, cli, "ml5/")
	err = ml.Unlock(ctx)
	require.ErrorIs(t, err, etcdsync.ErrLockReleased)
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	// The names are free again for the same value.
	require.NoError(t, ml.Lock(ctx))
	require.NoError(t, ml.Unlock(ctx))
}

// A Run's fn sees its context cancelled when the hold ends on any name;
// Run returns the cause, and nothing is left.
func TestMultiLockRunEndsFnOnLoss(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "ml6/a", "ml6/b")
	err := ml.Run(ctx, func(fctx context.Context) error {
		key, rev, ok := etcdsync.HoldFrom(fctx)
		require.True(t, ok)
		require.Equal(t, ml.Rev("ml6/a"), rev)
		require.Contains(t, []string{ml.Key("ml6/a"), ml.Key("ml6/b")}, key)
		// A Run of names it holds enters the hold; of some it holds and
		// some it does not, or a Mutex on one of them, is refused rather
		// than deadlocking.
		require.NoError(t, ml.Run(fctx, func(context.Context) error { return nil }))
		require.NoError(t, etcdsync.NewMultiLock(s, "ml6/a").Run(fctx, func(context.Context) error { return nil }))
		require.ErrorIs(t, etcdsync.NewMultiLock(s, "ml6/a", "ml6/c").Run(fctx, func(context.Context) error { return nil }), etcdsync.ErrInvalidArgument)
		require.ErrorIs(t, etcdsync.NewMutex(s, "ml6/b").Run(fctx, func(context.Context) error { return nil }), etcdsync.ErrInvalidArgument)
		_, err := cli.Delete(ctx, keyOf("ml6/a", s))
		require.NoError(t, err)
		select {
		case <-fctx.Done():
			return context.Cause(fctx)
		case <-time.After(testTimeout):
			return errors.New("fn's context outlived the hold")
		}
	})
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	waitNoKeys(t, cli, "ml6/")
}

// A cancelled Lock leaves no key on any name, whichever of its waits the
// cancel comes in; bad input is an error wrapping a sentinel and writes
// nothing.
func TestMultiLockCancelAndBadInputLeaveNothing(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	holder := heldMutex(t, ctx, cli, "ml7/b")
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "ml7/a", "ml7/b", "ml7/c")
	for i := range 8 {
		rctx, cancel := context.WithTimeout(ctx, time.Duration(rand.IntN(3000))*time.Microsecond)
		err := ml.Lock(rctx)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "trial %d", i)
		require.Equal(t, []string{holder.Key()}, keys(t, cli, "ml7/"), "trial %d", i)
	}
	require.ErrorIs(t, etcdsync.NewMultiLock(s).Lock(ctx), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewMultiLock(s, "ok", "").Lock(ctx), etcdsync.ErrInvalidName)
	require.ErrorIs(t, etcdsync.NewMultiLock(nil, "ok").TryLock(ctx), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewMultiLock(s, "a\x00b").Unlock(ctx), etcdsync.ErrInvalidName)
	require.Equal(t, []string{holder.Key()}, keys(t, cli, "ml7/"))
	resp, err := cli.Get(ctx, "ok", clientv3.WithPrefix())
	require.NoError(t, err)
	require.Empty(t, resp.Kvs)
}

// Unlock is one transaction: when it fails the value still holds every
// name, with Done open and Err nil, as after a failed Mutex.Unlock, and
// Unlock again releases them.
func TestMultiLockFailedReleaseCanBeRetried(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	var inj faults.Injector
	cli := c.Client(t, inj.Dial())
	s := session(t, cli)
	ml := etcdsync.NewMultiLock(s, "ml8/a", "ml8/b")
	require.NoError(t, ml.Lock(ctx))
	done := ml.Done()
	inj.Arm(faults.TxnMethod, 1)
	err := ml.Unlock(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
	left := append(keys(t, cli, "ml8/a/"), keys(t, cli, "ml8/b/")...)
	require.Len(t, left, 2, "a failed release deletes nothing")
	require.NoError(t, ml.Err())
	require.False(t, isClosed(done), "Done while the names are still held")
	require.NoError(t, ml.Unlock(ctx))
	within(t, done, testTimeout, "Done after the retried Unlock")
	require.ErrorIs(t, ml.Err(), etcdsync.ErrLockReleased)
	require.Empty(t, append(keys(t, cli, "ml8/a/"), keys(t, cli, "ml8/b/")...))
}

// Under every deployment (namespace, gRPC proxy, in-process client, etcd
// 3.4 to 3.6 binaries, ...) a MultiLock excludes another on the same names
// and a Mutex on one of them, hands over on Unlock (one transaction of
// nested ones), and leaves nothing.
func TestMultiLockUnderEveryDeployment(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		t.Run(rig.name, func(t *testing.T) {
			t.Parallel()
			d := rig.start(t)
			ctx := ctxT(t)
			cli := d.newClient(t)
			first := etcdsync.NewMultiLock(session(t, cli), "mld/a", "mld/b")
			require.NoError(t, first.Lock(ctx))
			second := etcdsync.NewMultiLock(session(t, d.newClient(t)), "mld/b", "mld/a")
			require.ErrorIs(t, second.TryLock(ctx), etcdsync.ErrLocked)
			require.ErrorIs(t, etcdsync.NewMutex(session(t, cli), "mld/b").TryLock(ctx), etcdsync.ErrLocked)
			got := async(func() error { return second.Lock(ctx) })
			waitKeys(t, cli, "mld/a/", 2)
			notYet(t, got, 200*time.Millisecond, "second MultiLock while the first holds")
			require.NoError(t, first.Unlock(ctx))
			require.NoError(t, resultWithin(t, got, testTimeout, "second MultiLock after the first's Unlock"))
			_, err := second.Do(ctx, clientv3.OpPut("mld-counter", "1"))
			require.NoError(t, err)
			require.NoError(t, second.Unlock(ctx))
			_, err = cli.Delete(ctx, "mld-counter")
			require.NoError(t, err)
			require.Empty(t, rawKeys(t, d, "mld"))
		})
	}
}

// A MultiLock may take sides of RWMutexes beside Mutex names: its read side
// shares the name with other readers and keeps writers out, its write side
// keeps both out, and a writer holding a name it reads makes it wait.
func TestMultiLockTakesRWMutexSides(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	other := session(t, cli)
	reader := etcdsync.NewRWMutex(other, "ml9/r")
	require.NoError(t, reader.RLock(ctx))
	writer := etcdsync.NewRWMutex(session(t, cli), "ml9/w")
	require.NoError(t, writer.Lock(ctx))
	ml := etcdsync.NewMultiLockOf(session(t, cli),
		etcdsync.Part{Name: "ml9/r", Side: etcdsync.ReadSide},
		etcdsync.Part{Name: "ml9/w", Side: etcdsync.WriteSide},
		etcdsync.Part{Name: "ml9/m"})
	got := async(func() error { return ml.Lock(ctx) })
	waitKeys(t, cli, "ml9/w/write/", 2)
	notYet(t, got, 200*time.Millisecond, "MultiLock while a writer holds its write side's name")
	require.NoError(t, writer.Unlock(ctx))
	require.NoError(t, resultWithin(t, got, testTimeout, "MultiLock after the writer's release"), "a reader beside its read side")
	require.NoError(t, etcdsync.NewRWMutex(session(t, cli), "ml9/r").TryRLock(ctx), "another reader beside its read side")
	require.ErrorIs(t, etcdsync.NewRWMutex(session(t, cli), "ml9/r").TryLock(ctx), etcdsync.ErrLocked, "a writer on its read side's name")
	require.ErrorIs(t, etcdsync.NewRWMutex(session(t, cli), "ml9/w").TryRLock(ctx), etcdsync.ErrLocked, "a reader on its write side's name")
	require.ErrorIs(t, etcdsync.NewMutex(session(t, cli), "ml9/m").TryLock(ctx), etcdsync.ErrLocked, "a Mutex on its Mutex name")
	require.NoError(t, ml.Unlock(ctx))
	require.NoError(t, etcdsync.NewRWMutex(session(t, cli), "ml9/w").TryLock(ctx), "a writer after its release")

	bad := etcdsync.NewMultiLockOf(session(t, cli), etcdsync.Part{Name: "ml9/x", Side: etcdsync.ReadSide}, etcdsync.Part{Name: "ml9/x", Side: etcdsync.WriteSide})
	require.ErrorIs(t, bad.Lock(ctx), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewMultiLockOf(session(t, cli), etcdsync.Part{Name: "ml9/y", Side: 7}).TryLock(ctx), etcdsync.ErrInvalidArgument)
	require.Empty(t, keys(t, cli, "ml9/x"))
	require.Empty(t, keys(t, cli, "ml9/y"))
}

// A MultiLock waiter whose key on a name it already got its turn on is
// deleted while it waits for a later name must not come out holding: its
// doc says a waiter whose own key on any name vanishes returns
// ErrSessionExpired at once. Meanwhile another Mutex may take that name; a
// Lock returning nil then makes two holders of it.
func TestMultiLockKeyDeletedOnEarlierNameWhileWaitingForLater(t *testing.T) {
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

// A MultiLock waiting for a later name whose session's lease is revoked
// returns ErrSessionExpired at once, and leaves no key on any name.
func TestMultiLockLeaseRevokedMidWaitReturnsAndLeavesNothing(t *testing.T) {
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
func TestMultiLockCancelledInEachWaitLeavesOnlyHolders(t *testing.T) {
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
func TestMultiLockCreateReplyLostLeavesNothing(t *testing.T) {
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
func TestMultiLockWaitsForEtcdsMutexUnderEveryDeployment(t *testing.T) {
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
			awaitCreated(t, created, 2, cellTimeout, "its watches of b's prefix (etcd's key is all it waits for) and of its key on a")
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
			awaitCreated(t, created, 2, cellTimeout, "its watches of b's prefix (the holder's key is all it waits for) and of its key on a")
			_, err = d.admin.Txn(ctx).Then(clientv3.OpDelete(d.prefix+holder.Key()), clientv3.OpDelete(d.prefix+keyOf(b, ss[0]))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, resultWithin(t, got, cellTimeout, "MultiLock whose key on b went with the holder's"), etcdsync.ErrSessionExpired)
			within(t, holder.Done(), cellTimeout, "Done of the deleted hold")
			require.Empty(t, rawKeys(t, d, a))
			require.Empty(t, rawKeys(t, d, b))
		})
	}
}

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
func TestMultiLockBeyondMaxTxnOpsIsInvalidArgument(t *testing.T) {
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
func TestMultiLockUnlockRacingLossOnOneName(t *testing.T) {
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
func TestMultiLockDoAfterUnwatchedLossReleasesTheRest(t *testing.T) {
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
func TestMultiLockTryLockWithOnlyNestedKeys(t *testing.T) {
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
func TestMultiLockAndSemaphoreOnOneName(t *testing.T) {
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
func TestMultiLockAndRWMutexOnOneNameDoNotExclude(t *testing.T) {
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
func TestMultiLockRestartAdoptsKeys(t *testing.T) {
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
func TestMultiLockLateUnlockDeletesNoNewerHold(t *testing.T) {
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

// A MultiLock waiting on its first name (held by a Mutex), whose key on a
// later name (free, its turn there came at once) is deleted: the wait's
// watch of its other keys returns ErrSessionExpired at once, and its key on
// the first name goes too.
func TestMultiLockKeyDeletedOnLaterNameWhileWaitingForEarlier(t *testing.T) {
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

// A MultiLock on a and b unlocks while follower f lags, and locks again
// behind a Mutex on b: its wait on b watches its own key on a (the same
// acquire's) through f. When f catches up it replays the delete of the
// MultiLock's previous key on a (an older incarnation, deleted before the
// new acquire's read). That delete must not count as the new key's: Lock
// must go on waiting, and hold once the Mutex is released.
func TestMultiLockWaitIgnoresReplayedDeleteOfOlderKeyOnOtherName(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	viaF := etcdtest.Conn(t, f.Endpoint())
	created := make(chan struct{}, 16)
	ml := etcdsync.NewMultiLock(session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, faults.WatchVia(viaF, created))), "a28c", "b28c")
	blocker := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "b28c")

	require.NoError(t, ml.Lock(ctx)) // no wait: no watch
	require.NoError(t, c.CutPeers(f))
	require.NoError(t, ml.Unlock(ctx)) // f does not see this delete yet
	require.NoError(t, blocker.Lock(ctx))
	errc := async(func() error { return ml.Lock(ctx) })
	for range 2 { // b's prefix (the blocker's key is all it waits for), own key on a (also)
		within(t, created, testTimeout, "the MultiLock's watches created on f")
	}
	require.NoError(t, c.HealPeers(f))
	faults.CaughtUp(t, f, blocker.Rev())
	notYet(t, errc, 700*time.Millisecond, "MultiLock's Lock while the Mutex on b holds (a replayed old delete of its key on a counted)")
	require.NoError(t, blocker.Unlock(ctx))
	require.NoError(t, resultWithin(t, errc, testTimeout, "MultiLock's Lock after the Mutex's release"))
	require.NoError(t, ml.Unlock(ctx))
}

// A MultiLock on X and Y waits on X (held by H); Y is free. One admin
// transaction deletes H's key on X and the MultiLock's key on Y: the
// MultiLock must not hold (its Y key is gone at the turn's revision).
func TestMultiLockWaiterWhoseOtherKeyGoesWithTheHolderNeverHolds(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	for round := range 6 {
		x, y := fmt.Sprintf("mlx%d", round), fmt.Sprintf("mly%d", round)
		h := heldMutex(t, ctx, admin, x)
		s := session(t, admin)
		ml := etcdsync.NewMultiLock(s, x, y)
		g := async(func() error { return ml.Lock(ctx) })
		waitKeys(t, admin, x+"/", 2)
		time.Sleep(time.Duration(round*60) * time.Millisecond)
		_, err := admin.Txn(ctx).Then(clientv3.OpDelete(h.Key()), clientv3.OpDelete(keyOf(y, s))).Commit()
		require.NoError(t, err)
		err = resultWithin(t, g, testTimeout, "the MultiLock")
		if err == nil {
			t.Fatalf("round %d: MultiLock.Lock returned nil with its key on %s deleted with the holder's on %s", round, y, x)
		}
		require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "round %d", round)
		waitNoKeys(t, admin, x+"/")
		waitNoKeys(t, admin, y+"/")
	}
}
