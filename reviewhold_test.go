package etcdsync_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"

	"github.com/etcdsync/etcdsync"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// rhGate holds back, while armed, Txns whose success branch deletes (an
// Unlock/Resign), until their context ends or open closes.
type rhGate struct {
	armed atomic.Bool
	held  chan struct{}
	open  chan struct{}
}

func newRHGate() *rhGate {
	return &rhGate{held: make(chan struct{}, 8), open: make(chan struct{})}
}

func (g *rhGate) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if tr, ok := req.(*pb.TxnRequest); ok && g.armed.Load() {
			del := false
			for _, op := range tr.Success {
				if op.GetRequestDeleteRange() != nil {
					del = true
				}
			}
			if del {
				select {
				case g.held <- struct{}{}:
				default:
				}
				select {
				case <-g.open:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

func rhResult(t *testing.T, ch <-chan error, d time.Duration, what string) error {
	t.Helper()
	select {
	case err := <-ch:
		return err
	case <-time.After(d):
		t.Fatalf("%s: not within %v", what, d)
		return nil
	}
}

// rhUnlockHeld locks name on a client whose delete transactions a gate holds
// back (until the test ends), and starts an Unlock, held in flight. It
// returns an admin client, the Mutex, its key and Unlock's result.
func rhUnlockHeld(t *testing.T, name string) (*clientv3.Client, *etcdsync.Mutex, string, chan error) {
	c := kitSingle(t)
	g := newRHGate()
	m := etcdsync.NewMutex(session(t, kitClient(t, c, g.dial())), name)
	ctx := ctxT(t)
	require.NoError(t, m.Lock(ctx))
	key := m.Key()
	g.armed.Store(true)
	t.Cleanup(func() { close(g.open) })
	errc := make(chan error, 1)
	go func() { errc <- m.Unlock(ctx) }()
	within(t, g.held, testTimeout, "unlock txn held")
	return c.Client(t), m, key, errc
}

// An Unlock in flight must return at once when the hold ends meanwhile
// because Done's watch saw the key deleted (Done first called during Unlock).
func TestRHUnlockBoundDoneDuringUnlock(t *testing.T) {
	t.Parallel()
	admin, m, key, errc := rhUnlockHeld(t, "rh-bound-done")
	ctx := ctxT(t)
	done := m.Done() // first call, after the unhold took its bound
	_, err := admin.Delete(ctx, key)
	require.NoError(t, err)
	within(t, done, 5*time.Second, "Done after delete")
	err = rhResult(t, errc, 3*time.Second, "Unlock returns once the hold ended")
	t.Logf("Unlock: %v; Err: %v", err, m.Err())
}

// Same, the hold ended by a concurrent Do that finds the key gone.
func TestRHUnlockBoundDoLost(t *testing.T) {
	t.Parallel()
	admin, m, key, errc := rhUnlockHeld(t, "rh-bound-do")
	ctx := ctxT(t)
	_, err := admin.Delete(ctx, key)
	require.NoError(t, err)
	_, err = m.Do(ctx, clientv3.OpPut("rh-bound-do-x", "1"))
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	err = rhResult(t, errc, 3*time.Second, "Unlock returns once the hold ended")
	t.Logf("Unlock: %v; Err: %v", err, m.Err())
}

// Done and Err after the session ended (Done never called before), and with
// Done called before.
func TestRHSessionEnd(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	for _, early := range []bool{false, true} {
		s := session(t, cli)
		m := etcdsync.NewMutex(s, "rh-send")
		require.NoError(t, m.Lock(ctx))
		var d <-chan struct{}
		if early {
			d = m.Done()
		}
		require.NoError(t, s.Close())
		if early {
			within(t, d, 5*time.Second, "early Done after Close")
		}
		within(t, m.Done(), time.Second, "Done after Close")
		require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)
		require.Equal(t, "", m.Key())
		require.ErrorIs(t, m.Unlock(ctx), etcdsync.ErrLockReleased)
		require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)
	}
}

// A release's cause is not overwritten by the later session end, and the
// reverse; Done first called after the hold ended is closed.
func TestRHCauses(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	m := etcdsync.NewMutex(s, "rh-cause")
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, m.Unlock(ctx))
	within(t, m.Done(), time.Second, "Done after Unlock")
	require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, s.Close())
	require.ErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
	require.NotErrorIs(t, m.Err(), etcdsync.ErrSessionClosed)

	// Released with Done watched, then deleted externally: not a loss.
	s2 := session(t, cli)
	m2 := etcdsync.NewMutex(s2, "rh-cause2")
	require.NoError(t, m2.Lock(ctx))
	d := m2.Done()
	_, err := cli.Delete(ctx, m2.Key())
	require.NoError(t, err)
	within(t, d, 5*time.Second, "Done after external delete")
	require.ErrorIs(t, m2.Err(), etcdsync.ErrNotHeld)
	require.NotErrorIs(t, m2.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, s2.Close())
	require.ErrorIs(t, m2.Err(), etcdsync.ErrNotHeld)
}

// A same-session waiter that started waiting while the first value was still
// acquiring (reserved, no hold) wakes when that value, once holding, unlocks.
func TestRHClaimWaiterAcrossNewHold(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	name := "rh-claim"
	other := session(t, cli)
	om := etcdsync.NewMutex(other, name)
	require.NoError(t, om.Lock(ctx))
	s := session(t, cli)
	m1, m2 := etcdsync.NewMutex(s, name), etcdsync.NewMutex(s, name)
	e1 := make(chan error, 1)
	go func() { e1 <- m1.Lock(ctx) }()
	waitKeys(t, cli, name+"/", 2)
	e2 := make(chan error, 1)
	go func() { e2 <- m2.Lock(ctx) }()
	select { // m2 waits on the session's reservation of the key
	case err := <-e2:
		t.Fatalf("m2 returned (%v) while m1 waits", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, om.Unlock(ctx))
	require.NoError(t, rhResult(t, e1, testTimeout, "m1 holds"))
	select {
	case err := <-e2:
		t.Fatalf("m2 returned (%v) while m1 holds", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, m1.Unlock(ctx))
	require.NoError(t, rhResult(t, e2, 5*time.Second, "m2 wakes after m1 Unlock"))
	require.NoError(t, m2.Unlock(ctx))
}

// ResumeElection shares a live hold; after a Resign frees the key, the
// sharer sees the end and a new resume is not handed the old hold.
func TestRHResumeShareAfterRelease(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e1 := etcdsync.NewElection(s, "rh-res")
	require.NoError(t, e1.Campaign(ctx, "a"))
	key, rev := e1.Key(), e1.Rev()
	e2 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.NoError(t, e2.Err())
	require.Equal(t, rev, e2.Rev())
	d2 := e2.Done()
	require.NoError(t, e2.Proclaim(ctx, "b"))
	require.Equal(t, e2.Header().Revision, e1.Header().Revision)
	require.NoError(t, e1.Resign(ctx))
	within(t, d2, 5*time.Second, "sharer's Done after Resign")
	require.ErrorIs(t, e2.Err(), etcdsync.ErrLockReleased)
	require.Equal(t, "", e2.Key())
	// new term by e2; a resume of the old rev must not share it
	require.NoError(t, e2.Campaign(ctx, "c"))
	e3 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.ErrorIs(t, e3.Err(), etcdsync.ErrNotHeld)
	e4 := etcdsync.ResumeElection(s, "rh-res", key, e2.Rev())
	require.NoError(t, e4.Err())
	// a Mutex on the name of the same session can't resume an election hold
	require.NoError(t, e4.Resign(ctx))
	require.ErrorIs(t, e2.Err(), etcdsync.ErrLockReleased)
	// resume after release: gets a fresh (stale) hold, gone at first guarded call
	e5 := etcdsync.ResumeElection(s, "rh-res", key, rev)
	require.NoError(t, e5.Err())
	_, err := e5.Do(ctx)
	require.ErrorIs(t, err, etcdsync.ErrNotHeld)
	require.NoError(t, e2.Campaign(ctx, "d"))
	require.NoError(t, e2.Resign(ctx))
}

// Header returns a fresh copy; callers mutating it do not change the hold.
func TestRHHeaderCopy(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
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

// Concurrent Done/Err/Header/Key/Unlock/Close under -race.
func TestRHRace(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	for i := 0; i < 6; i++ {
		s := session(t, cli)
		m := etcdsync.NewMutex(s, "rh-race")
		require.NoError(t, m.Lock(ctx))
		e := etcdsync.NewElection(s, "rh-race-e")
		require.NoError(t, e.Campaign(ctx, "v"))
		e2 := etcdsync.ResumeElection(s, "rh-race-e", e.Key(), e.Rev())
		var wg sync.WaitGroup
		for j := 0; j < 4; j++ {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for k := 0; k < 50; k++ {
					_ = m.Done()
					_ = m.Err()
					_ = m.Header()
					_ = e2.Done()
					_ = e.Err()
					_ = e2.Header()
				}
			}()
		}
		wg.Add(3)
		go func() { defer wg.Done(); _ = m.Unlock(ctx) }()
		go func() { defer wg.Done(); _ = e2.Resign(ctx) }()
		go func() {
			defer wg.Done()
			if i%2 == 0 {
				_ = s.Close()
			}
		}()
		wg.Wait()
		require.NoError(t, s.Close())
		within(t, m.Done(), time.Second, "m done")
		within(t, e.Done(), time.Second, "e done")
		require.Error(t, m.Err())
		require.Error(t, e.Err())
		if err := e.Err(); !errors.Is(err, etcdsync.ErrLockReleased) && !errors.Is(err, etcdsync.ErrSessionClosed) {
			t.Fatalf("e.Err: %v", err)
		}
	}
}
