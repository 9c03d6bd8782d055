package etcdsync_test

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
	"github.com/etcdsync/etcdsync/internal/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
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
// 3.4, ...) a MultiLock excludes another on the same names and a Mutex on
// one of them, hands over on Unlock (one transaction of nested ones), and
// leaves nothing.
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
