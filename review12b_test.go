package etcdsync_test

// Review 12b: attacks on e2e387c (join reads the shared read key, kept
// holds take no joins, try compares own key absent, resumed Semaphore keys
// ask for the same permits, saturating weights, exact readers).

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// r12bWatchesCreated waits for n watch creations counted by cnt.
func r12bWatchesCreated(t *testing.T, cnt *counter, n int, what string) {
	t.Helper()
	for range n {
		within(t, cnt.created, testTimeout, what)
	}
}

// An exact reader watches only its nearest writer W2. When W2 withdraws
// (cancelled Lock) or is deleted by an admin while the older writer W1
// still holds, the reader must keep waiting (no early hold), move to W1,
// and hold once W1 goes (no stuck reader).
func TestR12bExactReaderNearestWriterWithdraws(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		for _, how := range []string{"cancel", "admin-delete"} {
			t.Run(how, func(t *testing.T) {
				admin := c.Client(t)
				ctx := ctxT(t)
				name := "r12bwd-" + how
				w1 := etcdsync.NewRWMutex(session(t, admin), name)
				require.NoError(t, w1.Lock(ctx))
				w2 := etcdsync.NewRWMutex(session(t, admin), name)
				w2ctx, w2cancel := context.WithCancel(ctx)
				defer w2cancel()
				w2got := r12Go(func() error { return w2.Lock(w2ctx) })
				waitKeys(t, admin, name+"/", 2)
				resp, err := admin.Get(ctx, name+"/write/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
				require.NoError(t, err)
				require.Len(t, resp.Kvs, 2)
				w2key := string(resp.Kvs[1].Key)

				cnt := counter{created: make(chan struct{}, 64)}
				r := etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
				rgot := r12Go(func() error { return r.RLock(ctx) })
				r12bWatchesCreated(t, &cnt, 2, "reader's watches (own key, W2)")

				if how == "cancel" {
					w2cancel()
					require.ErrorIs(t, r12Result(t, w2got, testTimeout, "W2's cancelled Lock"), context.Canceled)
				} else {
					_, err := admin.Delete(ctx, w2key)
					require.NoError(t, err)
					require.ErrorIs(t, r12Result(t, w2got, testTimeout, "W2's deleted Lock"), etcdsync.ErrSessionExpired)
				}
				// The reader reads once and watches W1.
				within(t, cnt.created, testTimeout, "reader's watch of W1 after W2 went")
				r12NotYet(t, rgot, 500*time.Millisecond, "reader while W1 holds")
				require.NoError(t, w1.Unlock(ctx))
				require.NoError(t, r12Result(t, rgot, testTimeout, "reader after W1"))
				require.NoError(t, r.RUnlock(ctx))
				require.Empty(t, keys(t, admin, name+"/"))
			})
		}
	})
}

// Writers ahead of a waiting reader removed in one revision (a prefix
// delete of NAME/write/, or a transaction deleting both): the reader holds
// and a writer behind it waits for it. And the older writer deleted alone
// (the reader does not watch it): the reader keeps waiting for W2, which now
// holds, then holds after W2.
func TestR12bExactReaderWritersDeletedTogether(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		admin := c.Client(t)
		setup := func(t *testing.T, name string) (w1, w2 *etcdsync.RWMutex, w2got <-chan error, r *etcdsync.RWMutex, rgot <-chan error) {
			ctx := ctxT(t)
			w1 = etcdsync.NewRWMutex(session(t, admin), name)
			require.NoError(t, w1.Lock(ctx))
			w2 = etcdsync.NewRWMutex(session(t, admin), name)
			w2got = r12Go(func() error { return w2.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2)
			cnt := counter{created: make(chan struct{}, 64)}
			r = etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
			rgot = r12Go(func() error { return r.RLock(ctx) })
			r12bWatchesCreated(t, &cnt, 2, "reader's watches")
			return
		}
		t.Run("prefix", func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12bpfx"
			_, _, w2got, r, rgot := setup(t, name)
			w3 := etcdsync.NewRWMutex(session(t, admin), name)
			w3got := r12Go(func() error { return w3.Lock(ctx) })
			waitKeys(t, admin, name+"/", 4)
			// W1, W2 and W3 in one revision: the reader holds.
			_, err := admin.Delete(ctx, name+"/write/", clientv3.WithPrefix())
			require.NoError(t, err)
			require.ErrorIs(t, r12Result(t, w2got, testTimeout, "W2"), etcdsync.ErrSessionExpired)
			require.ErrorIs(t, r12Result(t, w3got, testTimeout, "W3"), etcdsync.ErrSessionExpired)
			require.NoError(t, r12Result(t, rgot, testTimeout, "reader after its writers went in one revision"))
			require.NoError(t, r.RUnlock(ctx))
		})
		t.Run("txn-both-and-writer-behind", func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12btxn"
			w1, _, w2got, r, rgot := setup(t, name)
			w3 := etcdsync.NewRWMutex(session(t, admin), name)
			w3got := r12Go(func() error { return w3.Lock(ctx) })
			waitKeys(t, admin, name+"/", 4)
			// delete W1 and W2 only (the writers before the reader)
			resp, err := admin.Get(ctx, name+"/write/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
			require.NoError(t, err)
			_, err = admin.Txn(ctx).Then(clientv3.OpDelete(string(resp.Kvs[0].Key)), clientv3.OpDelete(string(resp.Kvs[1].Key))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, r12Result(t, w2got, testTimeout, "W2"), etcdsync.ErrSessionExpired)
			require.NoError(t, r12Result(t, rgot, testTimeout, "reader after W1 and W2 went in one revision"))
			r12NotYet(t, w3got, 300*time.Millisecond, "W3 while the reader holds")
			require.NoError(t, r.RUnlock(ctx))
			require.NoError(t, r12Result(t, w3got, testTimeout, "W3 after the reader"))
			require.NoError(t, w3.Unlock(ctx))
			within(t, w1.Done(), testTimeout, "W1's Done after its key's delete")
			require.ErrorIs(t, w1.Err(), etcdsync.ErrNotHeld)
		})
		t.Run("older-writer-deleted", func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12bold"
			w1, w2, w2got, r, rgot := setup(t, name)
			_, err := admin.Delete(ctx, w1.Key())
			require.NoError(t, err)
			require.NoError(t, r12Result(t, w2got, testTimeout, "W2 after W1's key went"))
			r12NotYet(t, rgot, 500*time.Millisecond, "reader while W2 holds")
			require.NoError(t, w2.Unlock(ctx))
			require.NoError(t, r12Result(t, rgot, testTimeout, "reader after W2"))
			require.NoError(t, r.RUnlock(ctx))
			require.Empty(t, keys(t, admin, name+"/"))
		})
	})
}

// r12bRoutedClient returns a client whose watch streams go to member watch
// and whose unary calls go to member unary (-1: balanced over all), with
// cnt counting (cnt may be nil).
func r12bRoutedClient(t *testing.T, c *etcdtest.Cluster, watch, unary int, cnt *counter) *clientv3.Client {
	t.Helper()
	wcli := etcdtest.NewClient(t, []string{c.Member(watch).Endpoint()})
	var ucli *clientv3.Client
	if unary >= 0 {
		ucli = etcdtest.NewClient(t, []string{c.Member(unary).Endpoint()})
	}
	route := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method == "/etcdserverpb.Watch/Watch" {
			return wcli.ActiveConnection().NewStream(ctx, desc, method, opts...)
		}
		return streamer(ctx, desc, cc, method, opts...)
	})
	uroute := grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if ucli != nil {
			return ucli.ActiveConnection().Invoke(ctx, method, req, reply, opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
	var dial []grpc.DialOption
	if cnt != nil {
		dial = append(dial, cnt.dial()...)
	}
	dial = append(dial, route, uroute)
	return etcdtest.NewClient(t, c.Endpoints(), dial...)
}

// A reader whose watch stream is served by a follower cut off from its
// peers (lagging): its nearest writer withdraws, and (second case) the
// older writer releases too, while the follower lags. After the heal the
// reader must not hold while W1 holds, and must hold once W1 is gone.
func TestR12bExactReaderLaggingFollower(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("3 members")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	admin := c.Client(t)
	for _, tc := range []struct {
		name       string
		releaseW1  bool // during the cut
		unaryToAll bool // reads may go to the lagging follower too
	}{
		{"withdraw", false, false},
		{"withdraw-and-release", true, false},
		{"withdraw-reads-anywhere", false, true},
		{"both-reads-anywhere", true, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12blag-" + tc.name
			f := c.Follower()
			require.NotNil(t, f)
			li := slices.Index(c.Members(), c.Leader())
			require.GreaterOrEqual(t, li, 0)
			unary := li
			if tc.unaryToAll {
				unary = -1
			}
			w1, r, rgot := r12bReaderBehindWithdrawnWriter(t, ctx, c, name, f, unary, 64)
			if tc.releaseW1 {
				require.NoError(t, w1.Unlock(ctx))
			}
			time.Sleep(300 * time.Millisecond) // the fault's duration (below the election timeout)
			require.NoError(t, c.HealPeers(f))
			if tc.releaseW1 {
				require.NoError(t, r12Result(t, rgot, testTimeout, "reader after both writers went, follower healed"))
			} else {
				r12NotYet(t, rgot, 700*time.Millisecond, "reader while W1 holds (after W2 withdrew behind a lagging follower)")
				require.NoError(t, w1.Unlock(ctx))
				require.NoError(t, r12Result(t, rgot, testTimeout, "reader after W1"))
			}
			require.NoError(t, r.RUnlock(ctx))
			waitCount(t, admin, name+"/", 5*time.Second, func(n int) bool { return n == 0 })
		})
	}
}

// r12bReaderBehindWithdrawnWriter sets up both lagging-follower tests: W1
// holds and W2 waits on name (their calls go to the leader, so that the cut
// follower's proposals do not block them); a reader R waits with its watch
// stream on follower f (its unary calls to member unary, or balanced with
// -1; created sizes its watch counter); then f is cut off from its peers
// and W2 gives up. It returns W1, R and R's RLock result.
func r12bReaderBehindWithdrawnWriter(t *testing.T, ctx context.Context, c *etcdtest.Cluster, name string, f *etcdtest.Member, unary, created int) (w1, r *etcdsync.RWMutex, rgot <-chan error) {
	t.Helper()
	fi := slices.Index(c.Members(), f)
	li := slices.Index(c.Members(), c.Leader())
	require.GreaterOrEqual(t, li, 0)
	cnt := counter{created: make(chan struct{}, created)}
	cli := r12bRoutedClient(t, c, fi, unary, &cnt)
	wcli := etcdtest.NewClient(t, []string{c.Member(li).Endpoint()})
	w1 = etcdsync.NewRWMutex(session(t, wcli), name)
	require.NoError(t, w1.Lock(ctx))
	w2 := etcdsync.NewRWMutex(session(t, wcli), name)
	w2ctx, w2cancel := context.WithCancel(ctx)
	defer w2cancel()
	w2got := r12Go(func() error { return w2.Lock(w2ctx) })
	waitKeys(t, wcli, name+"/", 2)
	r = etcdsync.NewRWMutex(session(t, cli, etcdsync.WithTTL(10*time.Second)), name)
	rgot = r12Go(func() error { return r.RLock(ctx) })
	r12bWatchesCreated(t, &cnt, 2, "reader's watches on the follower")
	require.NoError(t, c.CutPeers(f))
	w2cancel()
	require.ErrorIs(t, r12Result(t, w2got, testTimeout, "W2 cancelled"), context.Canceled)
	return w1, r, rgot
}

// Same, with a cut longer than the election timeout: the follower loses
// its leader, the reader's stream (WithRequireLeader) breaks again and
// again, and the reader must neither hold early nor stay stuck.
func TestR12bExactReaderFollowerLosesLeader(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("3 members")
	}
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx := ctxT(t)
	name := "r12blost"
	f := c.Follower()
	require.NotNil(t, f)
	li := slices.Index(c.Members(), c.Leader())
	w1, r, rgot := r12bReaderBehindWithdrawnWriter(t, ctx, c, name, f, li, 256)
	r12NotYet(t, rgot, 2*time.Second, "reader while W1 holds (follower cut)")
	require.NoError(t, c.HealPeers(f))
	r12NotYet(t, rgot, time.Second, "reader while W1 holds (healed)")
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, r12Result(t, rgot, testTimeout, "reader after W1"))
	require.NoError(t, r.RUnlock(ctx))
}

// A last RUnlock whose request is stalled (a partition) fails on its
// deadline; the stalled delete may be applied when the link heals, or not.
// Either way: another value of the session must not join the kept hold,
// must not hold while a writer of another session holds, and gets a fresh
// key once the old hold is gone (by the late delete, or by a retry of the
// RUnlock); a third value then joins that fresh hold.
func TestR12bKeptThenLateOrRetry(t *testing.T) {
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			c := single(t)
			admin := c.Client(t)
			ctx := ctxT(t)
			cli, p := r12Proxied(t, c)
			defer p.Blackhole(false)
			name := "r12bkept"
			s := session(t, cli, etcdsync.WithTTL(30*time.Second))
			a, b, d := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			old := a.Rev()
			w := etcdsync.NewRWMutex(session(t, admin), name)
			wgot := r12Go(func() error { return w.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2)

			p.Blackhole(true)
			uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := a.RUnlock(uctx)
			cancel()
			require.Error(t, err, "RUnlock through a partition")
			require.NoError(t, a.Err(), "a failed RUnlock keeps the hold")
			bgot := r12Go(func() error { return b.RLock(ctx) })
			r12NotYet(t, bgot, 300*time.Millisecond, "RLock joined a hold whose release may commit")
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
				r12NotYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
				require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased, "retry after a delete that committed")
			} else {
				// the retry deletes the key, or finds it deleted by a delete applied later still
				if err := a.RUnlock(ctx); err != nil {
					require.ErrorIs(t, err, etcdsync.ErrLockReleased, "retry of the RUnlock")
				}
				require.NoError(t, r12Result(t, wgot, testTimeout, "writer after the retry"))
				r12NotYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
			}
			require.NoError(t, w.Unlock(ctx))
			require.NoError(t, r12Result(t, bgot, testTimeout, "b's RLock after the writer"))
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
func TestR12bJoinRacesDoneWatch(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for i := range 8 {
		ctx := ctxT(t)
		name := fmt.Sprintf("r12bjrace%d", i)
		s := session(t, c.Client(t))
		a, b := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
		require.NoError(t, a.RLock(ctx))
		old := a.Rev()
		ad := a.Done()
		w := etcdsync.NewRWMutex(session(t, admin), name)
		wgot := r12Go(func() error { return w.Lock(ctx) })
		waitKeys(t, admin, name+"/", 2)
		_, err := admin.Delete(ctx, a.Key())
		require.NoError(t, err)
		bgot := r12Go(func() error { return b.RLock(ctx) })
		require.NoError(t, r12Result(t, wgot, testTimeout, "writer"))
		within(t, ad, testTimeout, "a's Done after its key's delete")
		r12NotYet(t, bgot, 200*time.Millisecond, "b joined a deleted read key")
		require.NoError(t, w.Unlock(ctx))
		require.NoError(t, r12Result(t, bgot, testTimeout, "b after the writer"))
		require.Greater(t, b.Rev(), old)
		require.NoError(t, b.RUnlock(ctx))
		require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
		require.Empty(t, keys(t, admin, name+"/"))
	}
}

// r12bSentClient returns a client of c's first member through a proxy whose
// unary calls report their method on the returned channel as they are sent.
func r12bSentClient(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *etcdtest.Proxy, chan string) {
	t.Helper()
	_, p := r12Proxied(t, c)
	sent := make(chan string, 64)
	cli := etcdtest.NewClient(t, []string{p.Endpoint()}, grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		select {
		case sent <- method:
		default:
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}))
	return cli, p, sent
}

// r12bAwaitSent drains sent until method is sent.
func r12bAwaitSent(t *testing.T, sent chan string, method string) {
	t.Helper()
	for m := ""; m != method; {
		select {
		case m = <-sent:
		case <-time.After(testTimeout):
			t.Fatalf("%s not sent", method)
		}
	}
}

func r12bDrain(sent chan string) {
	for len(sent) > 0 {
		<-sent
	}
}

// The session ends while a value waits in shareKey: (1) behind the
// session's last RUnlock in flight (stalled by a partition), (2) while its
// join read is in flight on a slow link, (3) while its join read is stalled
// by a partition (the session ends as a partitioned one does, here by
// Orphan). RLock's contract: it returns when ctx ends or the session ends
// (ErrSessionExpired); so within a bound, with an error, never nil.
func TestR12bSessionEndsDuringJoin(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for _, tc := range []string{"waiting", "reading-slow", "reading-partitioned"} {
		t.Run(tc, func(t *testing.T) {
			ctx := ctxT(t)
			cli, p, sent := r12bSentClient(t, c)
			defer p.Blackhole(false)
			defer p.SetLatency(0)
			s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
			require.NoError(t, err)
			name := "r12bsend-" + tc
			a, b := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			r12bDrain(sent)
			var bgot <-chan error
			switch tc {
			case "waiting":
				p.Blackhole(true)
				r12Go(func() error { return a.RUnlock(ctx) })
				r12bAwaitSent(t, sent, "/etcdserverpb.KV/Txn")
				bgot = r12Go(func() error { return b.RLock(ctx) })
				r12NotYet(t, bgot, 200*time.Millisecond, "b joined a closing hold")
			case "reading-slow":
				p.SetLatency(time.Second)
				bgot = r12Go(func() error { return b.RLock(ctx) })
				r12bAwaitSent(t, sent, "/etcdserverpb.KV/Range")
			case "reading-partitioned":
				p.Blackhole(true)
				bgot = r12Go(func() error { return b.RLock(ctx) })
				r12bAwaitSent(t, sent, "/etcdserverpb.KV/Range")
			}
			orphaned := make(chan struct{})
			go func() { s.Orphan(); close(orphaned) }()
			within(t, orphaned, testTimeout, "Orphan")
			require.ErrorIs(t, r12Result(t, bgot, 3*time.Second, "b's RLock after the session ended"), etcdsync.ErrSessionExpired)
			p.Blackhole(false)
			p.SetLatency(0)
			_, err = admin.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		})
	}
}

// A Semaphore resumed (WithLease) with the value its key has keeps working:
// Acquire and TryAcquire of the held key resume it at its revision; a key
// that still waits is resumed and holds in its turn; another n is refused
// and leaves the key alone, after which the same n resumes.
func TestR12bSemaphoreResumeSameValue(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for _, try := range []bool{false, true} {
		t.Run(fmt.Sprintf("held-try=%v", try), func(t *testing.T) {
			ctx := ctxT(t)
			name := fmt.Sprintf("r12bsemres%v", try)
			s1, err := etcdsync.NewSession(c.Client(t), etcdsync.WithTTL(30*time.Second))
			require.NoError(t, err)
			sm1 := etcdsync.NewSemaphore(s1, name, 3)
			require.NoError(t, sm1.Acquire(ctx, 2))
			rev := sm1.Rev()
			s1.Orphan()
			s2 := session(t, c.Client(t), etcdsync.WithLease(s1.Lease()))
			sm2 := etcdsync.NewSemaphore(s2, name, 3)
			require.ErrorIs(t, sm2.Acquire(ctx, 1), etcdsync.ErrInvalidArgument, "another n")
			require.ErrorIs(t, sm2.TryAcquire(ctx, 3), etcdsync.ErrInvalidArgument, "another n")
			require.Len(t, keys(t, admin, name+"/"), 1, "a refused resume leaves the key")
			if try {
				require.NoError(t, sm2.TryAcquire(ctx, 2))
			} else {
				require.NoError(t, sm2.Acquire(ctx, 2))
			}
			require.Equal(t, rev, sm2.Rev())
			other := etcdsync.NewSemaphore(session(t, admin), name, 3)
			require.ErrorIs(t, other.TryAcquire(ctx, 2), etcdsync.ErrLocked)
			require.NoError(t, other.TryAcquire(ctx, 1))
			require.NoError(t, sm2.Release(ctx))
			require.NoError(t, other.Release(ctx))
			require.Empty(t, keys(t, admin, name+"/"))
		})
	}
	t.Run("waiting", func(t *testing.T) {
		ctx := ctxT(t)
		name := "r12bsemwait"
		h := etcdsync.NewSemaphore(session(t, admin), name, 3)
		require.NoError(t, h.Acquire(ctx, 2))
		lease, err := admin.Grant(ctx, 30)
		require.NoError(t, err)
		key := fmt.Sprintf("%s/%x", name, int64(lease.ID))
		resp, err := admin.Put(ctx, key, "2/3", clientv3.WithLease(lease.ID))
		require.NoError(t, err)
		s2 := session(t, c.Client(t), etcdsync.WithLease(lease.ID))
		sm2 := etcdsync.NewSemaphore(s2, name, 3)
		require.ErrorIs(t, sm2.Acquire(ctx, 1), etcdsync.ErrInvalidArgument, "another n")
		require.Len(t, keys(t, admin, name+"/"), 2, "a refused resume leaves the waiting key")
		got := r12Go(func() error { return sm2.Acquire(ctx, 2) })
		r12NotYet(t, got, 300*time.Millisecond, "resumed waiter while 2 of 3 are held")
		require.NoError(t, h.Release(ctx))
		require.NoError(t, r12Result(t, got, testTimeout, "resumed waiter"))
		require.Equal(t, resp.Header.Revision, sm2.Rev())
		require.NoError(t, sm2.Release(ctx))
		require.Empty(t, keys(t, admin, name+"/"))
	})
}

// Failing try calls cost one RPC and write nothing: TryRLock with a writer
// holding or waiting, TryLock beside a reader, TryAcquire with someone
// waiting ahead; a TryRLock on a session whose read hold is being released
// sends nothing.
func TestR12bTryCostsFailing(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		admin := c.Client(t)
		ctx := ctxT(t)
		var cnt counter
		cli := c.Client(t, cnt.dial()...)
		check := func(what string, f func() error) {
			t.Helper()
			rev := storeRev(t, admin)
			cnt.take()
			require.ErrorIs(t, f(), etcdsync.ErrLocked, what)
			n, m := cnt.take()
			require.Equal(t, int64(1), n, "%s: %v", what, m)
			require.Equal(t, rev, storeRev(t, admin), "%s wrote", what)
		}
		w := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, w.Lock(ctx))
		rw := etcdsync.NewRWMutex(session(t, cli), "r12bcost")
		check("TryRLock with a writer holding", func() error { return rw.TryRLock(ctx) })
		check("TryLock with a writer holding", func() error { return rw.TryLock(ctx) })
		require.NoError(t, w.Unlock(ctx))

		r := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		require.NoError(t, r.RLock(ctx))
		w2 := etcdsync.NewRWMutex(session(t, admin), "r12bcost")
		w2got := r12Go(func() error { return w2.Lock(ctx) })
		waitKeys(t, admin, "r12bcost/", 2)
		check("TryRLock with a writer waiting", func() error { return rw.TryRLock(ctx) })
		check("TryLock beside a reader", func() error { return rw.TryLock(ctx) })
		require.NoError(t, r.RUnlock(ctx))
		require.NoError(t, r12Result(t, w2got, testTimeout, "w2"))
		require.NoError(t, w2.Unlock(ctx))

		h := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		require.NoError(t, h.Acquire(ctx, 3))
		q := etcdsync.NewSemaphore(session(t, admin), "r12bcostsem", 3)
		qgot := r12Go(func() error { return q.Acquire(ctx, 1) })
		waitKeys(t, admin, "r12bcostsem/", 2)
		sm := etcdsync.NewSemaphore(session(t, cli), "r12bcostsem", 3)
		check("TryAcquire with a waiter ahead", func() error { return sm.TryAcquire(ctx, 1) })
		m := etcdsync.NewMutex(session(t, cli), "r12bcostsem")
		check("Mutex TryLock on a semaphore's name", func() error { return m.TryLock(ctx) })
		require.NoError(t, h.Release(ctx))
		require.NoError(t, r12Result(t, qgot, testTimeout, "q"))
		require.NoError(t, q.Release(ctx))
		require.Empty(t, keys(t, admin, "r12bcost"))
	})
}

// Weights saturate on the try path too: with capacity MaxInt64 and two
// keys of MaxInt64/2+1 ahead, TryAcquire(1) is ErrLocked, and Acquire(1)
// waits until both are gone.
func TestR12bSaturatingTry(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const capacity = math.MaxInt64
	const half = math.MaxInt64/2 + 1
	name := "r12bsat"
	a := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	require.NoError(t, a.Acquire(ctx, half))
	b := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	bgot := r12Go(func() error { return b.Acquire(ctx, half) })
	waitKeys(t, admin, name+"/", 2)
	d := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	err := d.TryAcquire(ctx, 1)
	if err == nil {
		_ = d.Release(ctx)
	}
	require.ErrorIs(t, err, etcdsync.ErrLocked)
	dgot := r12Go(func() error { return d.Acquire(ctx, capacity-half) })
	r12NotYet(t, dgot, 300*time.Millisecond, "third while the first two (over capacity) are ahead")
	require.NoError(t, a.Release(ctx))
	require.NoError(t, r12Result(t, bgot, testTimeout, "b"))
	require.NoError(t, b.Release(ctx))
	require.NoError(t, r12Result(t, dgot, testTimeout, "d"))
	require.NoError(t, d.Release(ctx))
}

// A Mutex on NAME/read of a session writes NAME/read/<lease>: the very key
// of that session's RWMutex read holds on NAME. An RLock of the session
// must not join the Mutex's hold as if it were a shared read hold: its
// RUnlock would then delete the Mutex's key (the Mutex silently loses its
// lock). Keys of one session are claimed locally, so the RLock must wait
// for the Mutex (or fail), and the Mutex must keep its hold.
func TestR12bReadJoinsMutexHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
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
