package tests

// RWMutex read shares: the values of one session share its read hold;
// joins, share counting, and what a join must never trust.

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// sharers returns a new session of cli and two RWMutex values of it on
// name: values that share the session's read hold.
func sharers(t *testing.T, cli *clientv3.Client, name string, opts ...etcdsync.SessionOption) (*etcdsync.Session, *etcdsync.RWMutex, *etcdsync.RWMutex) {
	s := session(t, cli, opts...)
	return s, etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
}

// A value that joins the session's read hold trusts it without an RPC:
// when that key was deleted (by an admin, say) and a writer now holds, a
// new RLock must not return as if it held a read beside the writer.
func TestRLockDoesNotJoinDeletedReadHold(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	_, a, b := sharers(t, c.Client(t), "r12join")
	require.NoError(t, a.RLock(ctx))
	_, err := admin.Delete(ctx, a.Key())
	require.NoError(t, err)
	w := etcdsync.NewRWMutex(session(t, admin), "r12join")
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, w.Lock(wctx), "the writer, once the read key is gone")
	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	err = b.RLock(rctx)
	if err == nil {
		t.Errorf("RLock returned nil (joined %s at %d, deleted) while writer %s holds", b.Key(), b.Rev(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// TryRLock with no writer anywhere returns ErrLocked while the session's
// own read acquire or last RUnlock is in flight, as documented (it sends
// nothing then), and succeeds once that call has returned.
func TestTryRLockRefusedWhileShareInFlight(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	_, a, b := sharers(t, cli, "r12tryfl")

	t.Run("acquire", func(t *testing.T) {
		p.SetLatency(time.Second)
		agot := async(func() error { return a.RLock(ctx) })
		waitKeys(t, admin, "r12tryfl/read/", 1) // applied; its reply is on the way
		err := b.TryRLock(ctx)
		require.NoError(t, resultWithin(t, agot, testTimeout, "RLock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's RLock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	t.Run("release", func(t *testing.T) {
		p.SetLatency(time.Second)
		ugot := async(func() error { return a.RUnlock(ctx) })
		waitCount(t, admin, "r12tryfl/", testTimeout, func(n int) bool { return n == 0 })
		err := b.TryRLock(ctx)
		require.NoError(t, resultWithin(t, ugot, testTimeout, "RUnlock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's last RUnlock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	p.SetLatency(0)
}

// An RUnlock whose reply is lost (its deadline ends after the server
// applied the delete) keeps the hold, as documented, and lets the session's
// other values join it again. The key is gone and a writer of another
// session holds, yet a new RLock of the session returns at once, without an
// RPC, as if it held a read: a reader and a writer hold together, and the
// reader's call said nothing was wrong.
func TestRLockDoesNotJoinAfterLostRUnlockReply(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	defer p.SetLatency(0)
	_, a, b := sharers(t, cli, "r12rejoin", etcdsync.WithTTL(30*time.Second))
	require.NoError(t, a.RLock(ctx))
	w := etcdsync.NewRWMutex(session(t, admin), "r12rejoin")
	wgot := async(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12rejoin/", 2)

	p.SetLatency(time.Second) // replies only: the delete is applied
	uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := a.RUnlock(uctx)
	cancel()
	require.Error(t, err, "RUnlock whose reply came after its deadline")
	require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the read key's delete"))
	p.SetLatency(0)

	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	if err := b.RLock(rctx); err == nil {
		t.Errorf("RLock returned nil (joined %s, deleted) while writer %s holds", b.Key(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// A join while the session's last read share is releasing waits for the
// release, and then queues a new key behind the writer that was waiting.
func TestRLockJoinWaitsForReleasingShare(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	defer p.SetLatency(0)
	_, a, b := sharers(t, cli, "r12closing", etcdsync.WithTTL(30*time.Second))
	require.NoError(t, a.RLock(ctx))
	oldRev := a.Rev()
	w := etcdsync.NewRWMutex(session(t, admin), "r12closing")
	wgot := async(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12closing/", 2)

	p.SetLatency(time.Second)
	ugot := async(func() error { return a.RUnlock(ctx) })
	waitCount(t, admin, "r12closing/read/", testTimeout, func(n int) bool { return n == 0 })
	bgot := async(func() error { return b.RLock(ctx) })
	require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the read key's delete"))
	require.NoError(t, resultWithin(t, ugot, testTimeout, "RUnlock"))
	p.SetLatency(0)
	notYet(t, bgot, 500*time.Millisecond, "RLock joined while the writer holds")
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, resultWithin(t, bgot, testTimeout, "RLock after the writer"))
	require.Greater(t, b.Rev(), oldRev, "a new read key")
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, b.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12closing/"))
}

// The session ends while two values share its read hold: both see it
// (Done closed, Err wraps ErrSessionClosed), and RUnlock says not held.
func TestSessionEndEndsEveryReadShare(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	s, a, b := sharers(t, c.Client(t), "r12end")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	ad := a.Done()
	require.NoError(t, s.Close())
	within(t, ad, testTimeout, "a's Done")
	within(t, b.Done(), testTimeout, "b's Done")
	require.ErrorIs(t, a.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, b.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RLock(ctx), etcdsync.ErrSessionClosed)
	require.Empty(t, keys(t, admin, "r12end/"))
}

// Shares of one value and of two values released in every order, an
// RUnlock that fails before sending (ended ctx) keeps the share; Done and
// Err follow each value's own shares.
func TestReadSharesCountedPerValue(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	_, a, b := sharers(t, c.Client(t), "r12count")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	bd := b.Done()
	require.NoError(t, a.RUnlock(ctx))
	require.NoError(t, a.RUnlock(ctx))
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	select {
	case <-a.Done():
	default:
		t.Error("a's Done open after its last share")
	}
	require.NoError(t, b.Err())
	select {
	case <-bd:
		t.Fatal("b's Done closed while it holds")
	default:
	}
	dead, cancel := context.WithCancel(ctx)
	cancel()
	require.Error(t, b.RUnlock(dead))
	require.NoError(t, b.Err(), "a release that sent nothing keeps the share")
	require.Len(t, keys(t, admin, "r12count/read/"), 1)
	require.NoError(t, b.RUnlock(ctx))
	within(t, bd, testTimeout, "b's Done after its release")
	require.ErrorIs(t, b.Err(), etcdsync.ErrLockReleased)
	require.Empty(t, keys(t, admin, "r12count/"))
}

// Many goroutines on two values of one session take and release read
// holds while writers of other sessions come and go: no overlap, nothing
// left.
func TestSharedReadHoldsUnderStress(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var x rwCheck
	s := session(t, c.Client(t))
	vals := []*etcdsync.RWMutex{etcdsync.NewRWMutex(s, "r12stress"), etcdsync.NewRWMutex(s, "r12stress")}
	var wg sync.WaitGroup
	for g := 0; g < 6; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := vals[g%2]
			for i := 0; i < 8; i++ {
				if err := rw.RLock(ctx); err != nil {
					t.Errorf("RLock: %v", err)
					return
				}
				x.read(t)
				time.Sleep(time.Millisecond)
				x.readers.Add(-1)
				if err := rw.RUnlock(ctx); err != nil {
					t.Errorf("RUnlock: %v", err)
					return
				}
			}
		}()
	}
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "r12stress")
			for i := 0; i < 5; i++ {
				if err := rw.Lock(ctx); err != nil {
					t.Errorf("Lock: %v", err)
					return
				}
				x.write(t, rw.Rev())
				time.Sleep(time.Millisecond)
				x.writers.Add(-1)
				if err := rw.Unlock(ctx); err != nil {
					t.Errorf("Unlock: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Empty(t, keys(t, admin, "r12stress/"))
}

// A last RUnlock whose request is stalled (a partition) fails on its
// deadline; the stalled delete may be applied when the link heals, or not.
// Either way: another value of the session must not join the kept hold,
// must not hold while a writer of another session holds, and gets a fresh
// key once the old hold is gone (by the late delete, or by a retry of the
// RUnlock); a third value then joins that fresh hold.
func TestKeptReadHoldNotJoinedUntilGone(t *testing.T) {
	slow(t)
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			c, admin, ctx := singleClient(t)
			cli, p := faults.Proxied(t, c)
			defer p.Blackhole(false)
			name := "r12bkept"
			s := session(t, cli, etcdsync.WithTTL(30*time.Second))
			a, b, d := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			old := a.Rev()
			w := etcdsync.NewRWMutex(session(t, admin), name)
			wgot := async(func() error { return w.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2)

			p.Blackhole(true)
			uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := a.RUnlock(uctx)
			cancel()
			require.Error(t, err, "RUnlock through a partition")
			require.NoError(t, a.Err(), "a failed RUnlock keeps the hold")
			bgot := async(func() error { return b.RLock(ctx) })
			notYet(t, bgot, 300*time.Millisecond, "RLock joined a hold whose release may commit")
			require.ErrorIs(t, d.TryRLock(ctx), etcdsync.ErrLocked, "TryRLock beside a kept hold")
			p.Blackhole(false)

			var late bool
			select {
			case err := <-wgot:
				require.NoError(t, err)
				late = true
			case <-time.After(1500 * time.Millisecond):
			}
			t.Logf("stalled delete applied late: %v", late)
			if late {
				within(t, a.Done(), testTimeout, "a's Done after its late delete")
				notYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
				require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased, "retry after a delete that committed")
			} else {
				// the retry deletes the key, or finds it deleted by a delete applied later still
				if err := a.RUnlock(ctx); err != nil {
					require.ErrorIs(t, err, etcdsync.ErrLockReleased, "retry of the RUnlock")
				}
				require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the retry"))
				notYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
			}
			require.NoError(t, w.Unlock(ctx))
			require.NoError(t, resultWithin(t, bgot, testTimeout, "b's RLock after the writer"))
			require.Greater(t, b.Rev(), old, "b holds a fresh key")
			require.NoError(t, d.RLock(ctx), "d joins b's fresh hold")
			require.Equal(t, b.Rev(), d.Rev())
			_, err = d.Do(ctx, clientv3.OpGet(name+"-x"))
			require.NoError(t, err)
			require.Len(t, keys(t, admin, name+"/"), 1)
			require.NoError(t, b.RUnlock(ctx))
			require.NoError(t, d.RUnlock(ctx))
			require.Empty(t, keys(t, admin, name+"/"))
		})
	}
}

// An admin deletes the session's read key while a writer waits behind it
// and while the hold's Done watch runs; right after the delete returns,
// another value of the session RLocks. The join's read must see the key
// gone (whether or not the watch reported first): the new RLock queues a
// fresh key behind the writer and holds only after it.
func TestRLockJoinSeesDeletedReadKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for i := range 8 {
		ctx := ctxT(t)
		name := fmt.Sprintf("r12bjrace%d", i)
		_, a, b := sharers(t, c.Client(t), name)
		require.NoError(t, a.RLock(ctx))
		old := a.Rev()
		ad := a.Done()
		w := etcdsync.NewRWMutex(session(t, admin), name)
		wgot := async(func() error { return w.Lock(ctx) })
		waitKeys(t, admin, name+"/", 2)
		_, err := admin.Delete(ctx, a.Key())
		require.NoError(t, err)
		bgot := async(func() error { return b.RLock(ctx) })
		require.NoError(t, resultWithin(t, wgot, testTimeout, "writer"))
		within(t, ad, testTimeout, "a's Done after its key's delete")
		notYet(t, bgot, 200*time.Millisecond, "b joined a deleted read key")
		require.NoError(t, w.Unlock(ctx))
		require.NoError(t, resultWithin(t, bgot, testTimeout, "b after the writer"))
		require.Greater(t, b.Rev(), old)
		require.NoError(t, b.RUnlock(ctx))
		require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
		require.Empty(t, keys(t, admin, name+"/"))
	}
}

// The session ends while a value waits in shareKey: (1) behind the
// session's last RUnlock in flight (stalled by a partition), (2) while its
// join read is in flight on a slow link, (3) while its join read is stalled
// by a partition (the session ends as a partitioned one does, here by
// Orphan). RLock's contract: it returns when ctx ends or the session ends
// (ErrSessionExpired); so within a bound, with an error, never nil.
func TestRLockJoinEndsWithSession(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for _, tc := range []string{"waiting", "reading-slow", "reading-partitioned"} {
		t.Run(tc, func(t *testing.T) {
			ctx := ctxT(t)
			cli, p, sent := faults.SentClient(t, c)
			defer p.Blackhole(false)
			defer p.SetLatency(0)
			s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
			require.NoError(t, err)
			name := "r12bsend-" + tc
			a, b := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			faults.DrainSent(sent)
			var bgot <-chan error
			switch tc {
			case "waiting":
				p.Blackhole(true)
				async(func() error { return a.RUnlock(ctx) })
				faults.AwaitSent(t, sent, faults.TxnMethod)
				bgot = async(func() error { return b.RLock(ctx) })
				notYet(t, bgot, 200*time.Millisecond, "b joined a closing hold")
			case "reading-slow":
				p.SetLatency(time.Second)
				bgot = async(func() error { return b.RLock(ctx) })
				faults.AwaitSent(t, sent, faults.RangeMethod)
			case "reading-partitioned":
				p.Blackhole(true)
				bgot = async(func() error { return b.RLock(ctx) })
				faults.AwaitSent(t, sent, faults.RangeMethod)
			}
			orphaned := make(chan struct{})
			go func() { s.Orphan(); close(orphaned) }()
			within(t, orphaned, testTimeout, "Orphan")
			require.ErrorIs(t, resultWithin(t, bgot, 3*time.Second, "b's RLock after the session ended"), etcdsync.ErrSessionClosed)
			p.Blackhole(false)
			p.SetLatency(0)
			_, err = admin.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		})
	}
}

// A Mutex on NAME/read of a session writes NAME/read/<lease>: the very key
// of that session's RWMutex read holds on NAME. An RLock of the session
// must not join the Mutex's hold as if it were a shared read hold: its
// RUnlock would then delete the Mutex's key (the Mutex silently loses its
// lock). Keys of one session are claimed locally, so the RLock must wait
// for the Mutex (or fail), and the Mutex must keep its hold.
func TestRLockDoesNotJoinMutexHold(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	s := session(t, c.Client(t))
	m := etcdsync.NewMutex(s, "r12bmx/read")
	require.NoError(t, m.Lock(ctx))
	md := m.Done()
	rw := etcdsync.NewRWMutex(s, "r12bmx")
	rctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	err := rw.RLock(rctx)
	if err == nil {
		t.Errorf("RLock joined the Mutex's hold of %s", rw.Key())
		if uerr := rw.RUnlock(ctx); uerr != nil {
			t.Logf("RUnlock: %v", uerr)
		}
	}
	select {
	case <-md:
		t.Fatalf("the Mutex lost its hold through the RWMutex: %v", m.Err())
	default:
	}
	require.NoError(t, m.Err())
	require.Equal(t, []string{m.Key()}, keys(t, admin, "r12bmx/"))
	require.NoError(t, m.Unlock(ctx))
}
