package tests

// Run and loss: fn's context ends first, Run's error carries the cause, the
// release after fn is bounded, and nothing of Run outlives it.

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Cut off past the TTL while fn runs, for every kind: fn's context ends
// (ErrLostContact) before a contender of another session gets the hold, and
// Run's error carries the cause.
func TestRunCutOffEndsFnFirstEveryKind(t *testing.T) {
	slow(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	for _, k := range runKinds(nil, "x") {
		t.Run(k.kind, func(t *testing.T) {
			ctx := ctxT(t)
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(2*time.Second))
			k := runKindOf(s, "r13bh", k.kind)
			take, release := k.next(session(t, admin))
			err, cause := fnEndsFirst(t, ctx, admin, k.prefix, 10*time.Second, k.run, take, func() func() {
				p.Blackhole(true)
				return func() { p.Blackhole(false) }
			})
			require.ErrorIs(t, cause, etcdsync.ErrLostContact)
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired)
			require.ErrorIs(t, err, etcdsync.ErrLostContact)
			require.NoError(t, release(ctx))
		})
	}
}

// fnEndsFirst runs run (a Run of a hold on prefix) with an fn that starts
// take (a contender of another session), waits until the contender's key
// is queued under prefix (as admin sees it), cuts the hold off with cut
// (and heals with what cut returns as fn returns), and waits at most d for
// fn's context to end. The contender must then hold, within d and not
// before fn's context ended. It returns Run's error and the cause fn's
// context ended with.
func fnEndsFirst(t *testing.T, ctx context.Context, admin *clientv3.Client, prefix string, d time.Duration,
	run func(ctx context.Context, fn func(context.Context) error) error, take func(ctx context.Context) error, cut func() (heal func())) (err, cause error) {
	t.Helper()
	gotAt := make(chan time.Time, 1)
	var cancelledAt time.Time
	err = run(ctx, func(fctx context.Context) error {
		go func() {
			if take(ctx) == nil {
				gotAt <- time.Now()
			}
		}()
		waitKeys(t, admin, prefix, 2)
		heal := cut()
		defer heal()
		select {
		case <-fctx.Done():
			cancelledAt = time.Now()
		case <-time.After(d):
			t.Fatal("fn's context did not end")
		}
		cause = context.Cause(fctx)
		return nil
	})
	select {
	case got := <-gotAt:
		require.True(t, cancelledAt.Before(got), "fn's context ended %v, the contender held at %v", cancelledAt, got)
	case <-time.After(d):
		t.Fatal("the contender did not get the hold once the lease expired")
	}
	return err, cause
}

// Lease revoked, key deleted, Session Close and Orphan while fn runs, for
// every kind: fn's context ends with the cause, Run's error carries that
// very cause, and no key is left (but for Orphan, which leaves its keys to
// the lease).
func TestRunLossCarriesCauseEveryWay(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ways := []struct {
		name string
		end  func(t *testing.T, s *etcdsync.Session, prefix string)
		want error
	}{
		{"revoke", func(t *testing.T, s *etcdsync.Session, _ string) {
			_, err := admin.Revoke(ctxT(t), s.Lease())
			require.NoError(t, err)
		}, nil},
		{"delete", func(t *testing.T, _ *etcdsync.Session, prefix string) {
			_, err := admin.Delete(ctxT(t), prefix, clientv3.WithPrefix())
			require.NoError(t, err)
		}, etcdsync.ErrNotHeld},
		{"close", func(t *testing.T, s *etcdsync.Session, _ string) { require.NoError(t, s.Close()) }, etcdsync.ErrSessionClosed},
		{"orphan", func(t *testing.T, s *etcdsync.Session, _ string) { s.Orphan() }, etcdsync.ErrSessionClosed},
	}
	for _, w := range ways {
		for _, k0 := range runKinds(nil, "x") {
			t.Run(w.name+"/"+k0.kind, func(t *testing.T) {
				ctx := ctxT(t)
				s := session(t, admin)
				k := runKindOf(s, "r13loss-"+w.name, k0.kind)
				var cause error
				err := k.run(ctx, func(fctx context.Context) error {
					w.end(t, s, k.prefix)
					within(t, fctx.Done(), 5*time.Second, "fn's context after "+w.name)
					cause = context.Cause(fctx)
					return nil
				})
				if w.want != nil {
					require.ErrorIs(t, cause, w.want)
				} else if !errors.Is(cause, etcdsync.ErrNotHeld) && !errors.Is(cause, etcdsync.ErrSessionExpired) {
					t.Fatalf("cause after revoke: %v", cause)
				}
				require.Error(t, err)
				require.True(t, errors.Is(err, cause), "Run's error %v does not carry fn's cause %v", err, cause)
				require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
				if w.name == "orphan" {
					require.Len(t, keys(t, admin, k.prefix), 1, "Orphan leaves the key to the lease")
					_, err := admin.Revoke(ctx, s.Lease())
					require.NoError(t, err)
				}
				require.Empty(t, keys(t, admin, k.prefix))
			})
		}
	}
}

// The release after fn: with ctx already ended and a slow link (replies
// delayed TTL/2), it still happens, within the TTL, leaving no key, and Run
// returns only fn's error.
func TestRunReleasesOverSlowLink(t *testing.T) {
	slow(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	const ttl = 3 * time.Second
	for _, k0 := range runKinds(nil, "x") {
		t.Run(k0.kind, func(t *testing.T) {
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(ttl))
			k := runKindOf(s, "r13slow", k0.kind)
			ctx, cancel := context.WithCancel(ctxT(t))
			var returned time.Time
			err := k.run(ctx, func(fctx context.Context) error {
				p.SetLatency(ttl / 2)
				cancel()
				returned = time.Now()
				return fctx.Err()
			})
			took := time.Since(returned)
			p.SetLatency(0)
			require.ErrorIs(t, err, context.Canceled)
			require.Equal(t, context.Canceled.Error(), err.Error(), "only fn's error")
			require.Less(t, took, ttl, "release bounded by the TTL")
			require.Empty(t, keys(t, admin, k.prefix))
			require.NoError(t, s.Err(), "a slow link is not a lost one")
		})
	}
}

// The release after fn with the link blackholed as fn returns (ctx ended
// too): Run returns within about the TTL (not hanging on the release), says
// the hold is lost, and the key goes when the lease expires.
func TestRunReturnsWhenReleaseCutOff(t *testing.T) {
	slow(t)
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c := single(t)
	admin := c.Client(t)
	const ttl = 2 * time.Second
	for _, kind := range []string{"mutex", "rrun", "semaphore"} {
		t.Run(kind, func(t *testing.T) {
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, etcdsync.WithTTL(ttl))
			k := runKindOf(s, "r13bhrel", kind)
			ctx, cancel := context.WithCancel(ctxT(t))
			var returned time.Time
			err := k.run(ctx, func(fctx context.Context) error {
				p.Blackhole(true)
				cancel()
				returned = time.Now()
				return nil
			})
			took := time.Since(returned)
			p.Blackhole(false)
			require.Less(t, took, ttl+time.Second, "Run bounded by the TTL")
			require.Error(t, err, "the release could not have happened")
			waitCount(t, admin, k.prefix, 3*ttl, func(have int) bool { return have == 0 })
		})
	}
}

// ownGoroutines lists the goroutines running the package's own code.
func ownGoroutines() []string {
	buf := make([]byte, 1<<20)
	buf = buf[:runtime.Stack(buf, true)]
	var out []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		// Tests paused in t.Parallel wait for this one (it runs alone).
		if strings.Contains(g, "etcdsync/etcdsync.") && !strings.Contains(g, "testing.(*T).Parallel") {
			out = append(out, g)
		}
	}
	return out
}

func noGoroutinesLeft(t *testing.T, what string, match string) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for _, g := range ownGoroutines() {
			if strings.Contains(g, match) {
				left = append(left, g)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: goroutines left:\n%s", what, strings.Join(left, "\n\n"))
		}
		time.Sleep(20 * time.Millisecond) // goroutine exit is not an event to wait on
	}
}

// No goroutine of a Run (its Done watch) outlives Run, after a release,
// after a loss, and none of the session after Close ends a Run's hold.
//
// It counts the process's goroutines, so it does not run in parallel.
func TestRunLeavesNoGoroutines(t *testing.T) {
	_, admin, ctx := singleClient(t)
	s := session(t, admin)
	for _, k := range runKinds(s, "r13leak") {
		require.NoError(t, k.run(ctx, func(context.Context) error { return nil }))
		require.Error(t, k.run(ctx, func(fctx context.Context) error {
			_, err := admin.Delete(ctx, k.prefix, clientv3.WithPrefix())
			require.NoError(t, err)
			<-fctx.Done()
			return nil
		}))
	}
	noGoroutinesLeft(t, "after Runs", "(*hold).watchKey")

	s2, err := etcdsync.NewSession(admin)
	require.NoError(t, err)
	var wg sync.WaitGroup
	in := make(chan struct{}, 5)
	for _, k := range runKinds(s2, "r13leak2") {
		wg.Add(1)
		go func() {
			defer wg.Done()
			assert.ErrorIs(t, k.run(ctx, func(fctx context.Context) error {
				in <- struct{}{}
				<-fctx.Done()
				return nil
			}), etcdsync.ErrSessionClosed)
		}()
	}
	for range 5 {
		within(t, in, 10*time.Second, "Runs starting")
	}
	require.NoError(t, s2.Close())
	wg.Wait()
	require.Empty(t, keys(t, admin, "r13leak2"))
	require.NoError(t, s.Close())
	noGoroutinesLeft(t, "after Close", "etcdsync/etcdsync.")
}

// 3 members, Options.PeerProxies. The leader stopped while fn runs is no
// loss (fn's context stays, Run releases, no key left); the client's member
// cut off from its peers past the TTL is: fn's context ends before a
// contender on the majority gets the lock.
func TestRunLossOnThreeMembers(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	if testing.Short() {
		t.Skip("3 members")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	t.Run("leader stopped", func(t *testing.T) {
		ctx := ctxT(t)
		cli := c.Client(t)
		m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(5*time.Second)), "r13lead")
		err := m.Run(ctx, func(fctx context.Context) error {
			leader := c.Leader()
			require.NotNil(t, leader)
			c.Stop(leader)
			defer func() { require.NoError(t, c.Restart(leader)) }()
			for c.Leader() == nil { // no event to wait for: bounded by fctx
				if fctx.Err() != nil {
					return context.Cause(fctx)
				}
				time.Sleep(50 * time.Millisecond)
			}
			var err error
			for i := 0; i < 50; i++ {
				if _, err = m.Do(fctx, clientv3.OpPut("r13lead-data", "x")); err == nil {
					break
				}
				if errors.Is(err, etcdsync.ErrNotHeld) || fctx.Err() != nil {
					return err
				}
				time.Sleep(100 * time.Millisecond)
			}
			if err != nil {
				return err
			}
			if fctx.Err() != nil {
				return fmt.Errorf("fn's context ended: %w", context.Cause(fctx))
			}
			return nil
		})
		require.NoError(t, err)
		require.Empty(t, keys(t, cli, "r13lead/"))
	})
	t.Run("member cut off", func(t *testing.T) {
		ctx := ctxT(t)
		var f *etcdtest.Member
		for _, m := range c.Members() {
			if m.Running() && !m.IsLeader() {
				f = m
			}
		}
		require.NotNil(t, f)
		var others []string
		for _, m := range c.Members() {
			if m != f {
				others = append(others, m.Endpoint())
			}
		}
		cli := etcdtest.NewClient(t, []string{f.Endpoint()})
		admin := etcdtest.NewClient(t, others)
		m := etcdsync.NewMutex(session(t, cli, etcdsync.WithTTL(3*time.Second)), "r13cut")
		next := etcdsync.NewMutex(session(t, admin, etcdsync.WithTTL(10*time.Second)), "r13cut")
		err, cause := fnEndsFirst(t, ctx, admin, "r13cut/", 15*time.Second, m.Run, next.Lock, func() func() {
			require.NoError(t, c.CutPeers(f))
			return func() { require.NoError(t, c.HealPeers(f)) }
		})
		require.ErrorIs(t, cause, etcdsync.ErrSessionExpired)
		require.True(t, errors.Is(err, cause), "Run's error %v lacks the cause %v", err, cause)
		require.NoError(t, next.Unlock(ctx))
	})
}
