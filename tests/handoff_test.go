package tests

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
)

// queued is one waiter of a test queue, on a client of its own so that its
// RPCs and watches are counted alone.
type queued struct {
	i   int
	cnt *counter
	s   *etcdsync.Session
	m   *etcdsync.Mutex
	err chan error // Lock's result, or held's
}

// enqueue starts n waiters on name behind a holder, one at a time (each on a
// client of one member, the members in turn), each in its watches (the prefix, or its own key and the third key ahead) before the next
// starts, so that nobody writes between a waiter's read and its watches.
// Waiter i's Lock runs under ctxFor(i); once it holds, held runs.
func enqueue(t *testing.T, c *etcdtest.Cluster, name string, n int, ctxFor func(i int) context.Context, held func(q *queued) error) []*queued {
	var qs []*queued
	for i := range n {
		q := &queued{i: i, cnt: &counter{created: make(chan struct{}, 16), returned: make(chan struct{}, 16)}, err: make(chan error, 1)}
		// One member serves its watches and its reads, so that a read after
		// an event is never behind it (else a serializable read may be
		// followed by a linearizable one).
		member := c.Members()[i%len(c.Members())]
		q.s = session(t, etcdtest.NewClient(t, []string{member.Endpoint()}, q.cnt.dial()...))
		q.m = etcdsync.NewMutex(q.s, name)
		go func() {
			err := q.m.Lock(ctxFor(i))
			if err == nil {
				err = held(q)
			}
			q.err <- err
		}()
		for range waits(i+1, 1) {
			within(t, q.cnt.created, testTimeout, fmt.Sprintf("waiter %d's watch created", i))
		}
		for len(q.cnt.returned) > 0 { // its session's grant and its enqueue
			<-q.cnt.returned
		}
		qs = append(qs, q)
	}
	return qs
}

// enqueueBehind has a Mutex on name of a session of admin hold, then
// enqueues n waiters behind it, each Lock under ctx; it returns the holder
// and the waiters.
func enqueueBehind(t *testing.T, ctx context.Context, c *etcdtest.Cluster, admin *clientv3.Client, name string, n int, held func(q *queued) error) (*etcdsync.Mutex, []*queued) {
	holder := heldMutex(t, ctx, admin, name)
	return holder, enqueue(t, c, name, n, func(int) context.Context { return ctx }, held)
}

// turnWithNoRPC runs release and requires got (the waiter's acquire) to
// return nil with no RPC of cnt's client between the two (what: whose).
func turnWithNoRPC(t *testing.T, cnt *counter, release func() error, got <-chan error, what string) {
	t.Helper()
	cnt.take()
	require.NoError(t, release())
	require.NoError(t, resultWithin(t, got, testTimeout, what))
	n, methods := cnt.take()
	require.Zero(t, n, "%s: RPCs between the release and the acquire's return: %v", what, methods)
}

// releasedInAnyOrder releases the holders of releases newest first, the
// waiter (got) still waiting after each but the oldest, whose release must
// hand it the turn with no RPC (turnWithNoRPC).
func releasedInAnyOrder(t *testing.T, cnt *counter, releases []func() error, got <-chan error, what string) {
	t.Helper()
	for i := len(releases) - 1; i > 0; i-- {
		require.NoError(t, releases[i]())
		notYet(t, got, 200*time.Millisecond, what+" with a holder left") // and a read the release may cause is done
	}
	turnWithNoRPC(t, cnt, releases[0], got, what+" after the last release")
}

// Once a waiter's predecessor releases, the waiter owns the lock with no
// RPC, at every position of the queue: the read a waiter needs when keys
// it does not watch were listed ahead of it happens when its third key
// ahead goes, while the key before its predecessor holds.
func TestNoRPCOnTheCriticalPath(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		holder := heldMutex(t, ctx, admin, "critical")
		const n = 6
		var qs []*queued
		before := make([]atomic.Int64, n) // a waiter's RPCs when its predecessor began to unlock
		handOn := func(next int) {
			if next >= n {
				return
			}
			if next >= 2 { // it listed keys it does not watch: one read, now
				select {
				case <-qs[next].cnt.returned:
				case <-time.After(testTimeout):
					t.Errorf("waiter %d made no read while its predecessor held", next)
				}
			}
			before[next].Store(qs[next].cnt.unary.Load())
		}
		var mu sync.Mutex // the waiters' locks run in order; qs is set by then
		mu.Lock()
		qs = enqueue(t, c, "critical", n, func(int) context.Context { return ctx }, func(q *queued) error {
			mu.Lock()
			defer mu.Unlock()
			if got := q.cnt.unary.Load(); got != before[q.i].Load() {
				t.Errorf("waiter %d: %d RPCs between its predecessor's Unlock and its Lock's return", q.i, got-before[q.i].Load())
			}
			handOn(q.i + 1)
			return q.m.Unlock(ctx)
		})
		handOn(0)
		mu.Unlock()
		require.NoError(t, holder.Unlock(ctx))
		for _, q := range qs {
			require.NoError(t, <-q.err)
		}
		require.Empty(t, keys(t, admin, "critical/"))
	})
}

// Keys leave the queue at every position while the others wait: a waiter
// gives up, its lease is revoked, or an admin deletes its key; one at a time
// or two neighbours in one revision. The others are served in order, one at
// a time; the ones that left return at once (their own error) and never
// hold; nothing is left behind.
func TestQueueChangesAtEveryPosition(t *testing.T) {
	t.Parallel()
	const n = 5
	type leave func(t *testing.T, admin *clientv3.Client, qs []*queued, cancels []context.CancelFunc, at ...int)
	giveUp := func(t *testing.T, _ *clientv3.Client, _ []*queued, cancels []context.CancelFunc, at ...int) {
		for _, i := range at {
			cancels[i]()
		}
	}
	revoke := func(t *testing.T, admin *clientv3.Client, qs []*queued, _ []context.CancelFunc, at ...int) {
		for _, i := range at {
			_, err := admin.Revoke(ctxT(t), qs[i].s.Lease())
			require.NoError(t, err)
		}
	}
	deleteKeys := func(t *testing.T, admin *clientv3.Client, qs []*queued, _ []context.CancelFunc, at ...int) {
		var ops []clientv3.Op
		for _, i := range at {
			ops = append(ops, clientv3.OpDelete(fmt.Sprintf("pos/%x", int64(qs[i].s.Lease()))))
		}
		_, err := admin.Txn(ctxT(t)).Then(ops...).Commit() // one revision
		require.NoError(t, err)
	}
	c := single(t)
	admin := c.Client(t)
	for _, how := range []struct {
		name  string
		leave leave
		want  error
	}{{"give-up", giveUp, context.Canceled}, {"revoke", revoke, etcdsync.ErrSessionExpired}, {"delete", deleteKeys, etcdsync.ErrSessionExpired}} {
		for _, at := range [][]int{{0}, {1}, {2}, {3}, {4}, {0, 1}, {1, 2}, {2, 3}, {3, 4}, {0, 2}, {1, 3}} {
			t.Run(fmt.Sprintf("%s/%v", how.name, at), func(t *testing.T) {
				ctx := ctxT(t)
				holder := heldMutex(t, ctx, admin, "pos")
				var (
					mu      sync.Mutex
					order   []int
					holding atomic.Int32
				)
				cancels := make([]context.CancelFunc, n)
				ctxs := make([]context.Context, n)
				for i := range n {
					ctxs[i], cancels[i] = context.WithCancel(ctx)
					t.Cleanup(cancels[i])
				}
				qs := enqueue(t, c, "pos", n, func(i int) context.Context { return ctxs[i] }, func(q *queued) error {
					if holding.Add(1) != 1 {
						t.Errorf("waiter %d holds with another", q.i)
					}
					mu.Lock()
					order = append(order, q.i)
					mu.Unlock()
					holding.Add(-1)
					return q.m.Unlock(ctx)
				})
				waitKeys(t, admin, "pos/", n+1)
				how.leave(t, admin, qs, cancels, at...)
				var want []int
				for i, q := range qs {
					if !slices.Contains(at, i) {
						want = append(want, i)
						continue
					}
					select { // it returns at once, before anyone releases
					case err := <-q.err:
						require.ErrorIs(t, err, how.want, "waiter %d", i)
						q.err <- err
					case <-ctx.Done():
						t.Fatalf("waiter %d did not return", i)
					}
				}
				require.NoError(t, holder.Unlock(ctx))
				for i, q := range qs {
					err := <-q.err
					if slices.Contains(at, i) {
						require.True(t, errors.Is(err, how.want), "waiter %d: %v", i, err)
					} else {
						require.NoError(t, err, "waiter %d", i)
					}
				}
				require.Equal(t, want, order, "served in queue order")
				require.Empty(t, keys(t, admin, "pos/"))
			})
		}
	}
}

// A waiter whose watch create is refused still wakes when the holder
// releases. A waiter's stream creates the watch of a new nearest key long
// after the stream opened (its predecessor left while an older key still
// holds). With auth enabled, etcd checks each watch create against the token
// the stream opened with; once that token is no longer valid (a simple token,
// etcd's default, expires after --auth-token-ttl unused, 300 s by default; an
// administrator changes the user's password; with JWT any change of users or
// roles makes it "old") the create is refused with a response
// Created+Canceled carrying WatchId -1. The waiter must not ignore that
// response (it knows no watch by ID -1) and wait on a watch that does not
// exist until its ctx or session ends; etcd's own client re-opens the stream
// on these cancel reasons (shouldRetryWatch in client/v3/watch.go).
// "unchanged" is the control.
func TestWaiterWakesAfterRefusedWatchCreate(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	t.Run("unchanged", func(t *testing.T) {
		connect := secureCluster(t)
		refusedWatch(t, connect, func() {})
	})
	t.Run("password-changed", func(t *testing.T) {
		connect := secureCluster(t)
		root := connect("root")
		refusedWatch(t, connect, func() {
			// To the same password, so that the waiter's client can
			// authenticate again.
			_, err := root.UserChangePassword(ctxT(t), "rw", "rw-password")
			require.NoError(t, err)
		})
	})
	t.Run("token-expired", func(t *testing.T) {
		// A member whose simple tokens expire after 1 s unused; the
		// waiter waits 3 s before its predecessor leaves.
		connect := authMember(t, 1)
		refusedWatch(t, connect, func() { time.Sleep(3 * time.Second) })
	})
}

// refusedWatch queues a and b behind a holder and c behind them, runs
// invalidate while c waits (watching its own key and the holder's, the
// third ahead of it), releases the holder (so that c, which then lists all
// it waits for, must create a watch of the prefix on its stream), makes b
// give up, releases a, and expects c to acquire.
func refusedWatch(t *testing.T, connect func(user string, dial ...grpc.DialOption) *clientv3.Client, invalidate func()) {
	ctx := ctxT(t)
	root := connect("root")
	holder := etcdsync.NewMutex(session(t, connect("rw")), "locks/r9-auth")
	require.NoError(t, holder.Lock(ctx))

	// a and b queue behind the holder; c behind them, watching its own
	// key and the holder's.
	a := etcdsync.NewMutex(session(t, connect("rw")), "locks/r9-auth")
	agot := async(func() error { return a.Lock(ctx) })
	waitKeys(t, root, "locks/r9-auth/", 2)
	b := etcdsync.NewMutex(session(t, connect("rw")), "locks/r9-auth")
	bctx, bcancel := context.WithCancel(ctx)
	defer bcancel()
	berr := async(func() error { return b.Lock(bctx) })
	waitKeys(t, root, "locks/r9-auth/", 3)
	cnt := counter{created: make(chan struct{}, 16)}
	c := etcdsync.NewMutex(session(t, connect("rw", cnt.dial()...)), "locks/r9-auth")
	cgot := async(func() error { return c.Lock(ctx) })
	for range 2 {
		within(t, cnt.created, testTimeout, "c's watch created")
	}

	invalidate()

	// The holder's release: a holds; c rereads a and b, is at the front,
	// and watches the prefix, on its old stream.
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, agot, 5*time.Second, "a's Lock after the release"))
	within(t, cnt.created, testTimeout, "c asked for a watch of the prefix")
	bcancel()
	require.ErrorIs(t, <-berr, context.Canceled)
	require.NoError(t, a.Unlock(ctx))
	require.NoError(t, resultWithin(t, cgot, 5*time.Second, fmt.Sprintf("c's Lock after the releases; keys %v", keys(t, root, "locks/r9-auth/"))))
	require.NoError(t, c.Unlock(ctx))
}

// authMember starts one member with auth enabled (users root and rw, as
// secureCluster, without TLS) whose simple tokens expire after tokenTTL
// seconds unused, and returns a client factory.
func authMember(t *testing.T, tokenTTL uint) func(user string, dial ...grpc.DialOption) *clientv3.Client {
	port := func() url.URL {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer ln.Close()
		return url.URL{Scheme: "http", Host: ln.Addr().String()}
	}
	cfg := embed.NewConfig()
	cfg.Name, cfg.Dir = "r9", t.TempDir()
	client, peer := port(), port()
	cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
	cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	cfg.AuthTokenTTL = tokenTTL
	cfg.UnsafeNoFsync = true
	cfg.ZapLoggerBuilder = embed.NewZapLoggerBuilder(zap.NewNop())
	cfg.LogLevel = "fatal"
	cfg.ListenMetricsUrls = nil
	e, err := embed.StartEtcd(cfg)
	require.NoError(t, err)
	t.Cleanup(e.Close)
	within(t, e.Server.ReadyNotify(), testTimeout, "member ready")
	connect := authClients(t, []string{client.String()}, nil)
	etcdtest.EnableAuth(t, ctxT(t), connect(""), map[string]string{"root": "root", "rw": "locks-rw"})
	return connect
}

// A same-session waiter that started waiting while the first value was still
// acquiring (reserved, no hold) wakes when that value, once holding, unlocks.
func TestSameSessionWaiterWakesAfterNewHoldUnlocks(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	name := "rh-claim"
	om := heldMutex(t, ctx, cli, name)
	s := session(t, cli)
	m1, m2 := etcdsync.NewMutex(s, name), etcdsync.NewMutex(s, name)
	e1 := async(func() error { return m1.Lock(ctx) })
	waitKeys(t, cli, name+"/", 2)
	e2 := async(func() error { return m2.Lock(ctx) })
	notYet(t, e2, 300*time.Millisecond, "m2 while m1 waits") // on the session's reservation of the key
	require.NoError(t, om.Unlock(ctx))
	require.NoError(t, resultWithin(t, e1, testTimeout, "m1 holds"))
	notYet(t, e2, 300*time.Millisecond, "m2 while m1 holds")
	require.NoError(t, m1.Unlock(ctx))
	require.NoError(t, resultWithin(t, e2, 5*time.Second, "m2 wakes after m1 Unlock"))
	require.NoError(t, m2.Unlock(ctx))
}

// Every wait watches on a gRPC stream of its own, even when many wait on
// one client: on a shared stream, one wait's progress answer can meet
// another's watch whose cancel the client has just received, and etcd's
// client (3.7.3, etcd-io/etcd#21969) then panics with "send on closed
// channel" (shared streams were tried; the handoff benchmarks hit it within
// minutes). The queue then drains with each new holder unlocking at once.
func TestWaitsWatchOnAStreamEach(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cnt := counter{}
	cli := c.Client(t, cnt.dial()...)
	const n = 40
	holder := heldMutex(t, ctx, cli, "stream-each")
	before := cnt.watchStreams.Load()
	var wg sync.WaitGroup
	for i := range n {
		m := etcdsync.NewMutex(session(t, cli), "stream-each")
		wg.Go(func() {
			if err := m.Lock(ctx); err != nil {
				t.Errorf("waiter %d: %v", i, err)
				return
			}
			if err := m.Unlock(ctx); err != nil {
				t.Errorf("waiter %d unlock: %v", i, err)
			}
		})
	}
	waitKeys(t, cli, "stream-each/", n+1)
	require.Eventually(t, func() bool { return cnt.watchStreams.Load()-before >= n }, testTimeout, 10*time.Millisecond,
		"%d waits opened %d watch streams", n, cnt.watchStreams.Load()-before)
	require.NoError(t, holder.Unlock(ctx))
	wg.Wait()
	waitNoKeys(t, cli, "stream-each/")
}

// One transaction deletes the whole queue (a prefix delete: the holder's key
// and the waiter's at one revision) on each server line: the waiter, which
// watches the prefix, gets both deletes in one response, so Lock says its
// key went, never that it holds. Forty rounds each.
func TestPrefixDeleteNeverHandsTheTurnPerServer(t *testing.T) {
	perServerLine(t, func(t *testing.T, ep string, admin *clientv3.Client, v string) {
		ctx := ctxCell(t)
		cnt := &counter{created: make(chan struct{}, 16)}
		cli := etcdtest.NewClient(t, []string{ep}, cnt.dial()...)
		for i := range 40 {
			name := "pd/" + strconv.Itoa(i)
			holder := etcdsync.NewMutex(session(t, admin), name)
			waiter := etcdsync.NewMutex(session(t, cli), name)
			require.NoError(t, holder.Lock(ctx))
			w := async(func() error { return waiter.Lock(ctx) })
			within(t, cnt.created, cellTimeout, "the waiter's watch of the prefix")
			_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
			require.NoError(t, err)
			err = resultWithin(t, w, cellTimeout, "the waiter after the prefix delete")
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "etcd %s, round %d: the waiter held after a delete of its own key", v, i)
		}
	})
}

// A Mutex's third waiter watches per key: its own and the third key ahead
// (the holder); once that goes it rereads the two keys it keeps and moves
// to the prefix watch, one handoff before its turn; then its predecessor's
// release hands it the turn with no RPC. Exclusion holds across the move.
func TestThirdWaiterMovesToThePrefixThenNeedsNoRPC(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	name := "third"
	h := heldMutex(t, ctx, admin, name)
	w1 := etcdsync.NewMutex(session(t, admin), name)
	g1 := async(func() error { return w1.Lock(ctx) })
	waitKeys(t, admin, name+"/", 2)
	w2 := etcdsync.NewMutex(session(t, admin), name)
	g2 := async(func() error { return w2.Lock(ctx) })
	waitKeys(t, admin, name+"/", 3)
	cnt := counter{created: make(chan struct{}, 16), returned: make(chan struct{}, 64)}
	cli := c.Client(t, cnt.dial()...)
	w3 := etcdsync.NewMutex(session(t, cli), name)
	g3 := async(func() error { return w3.Lock(ctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "w3's watches: own key and the third ahead")
	require.NoError(t, h.Unlock(ctx))
	require.NoError(t, resultWithin(t, g1, testTimeout, "w1"))
	notYet(t, g3, 200*time.Millisecond, "w3 while w1 holds")
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, resultWithin(t, g2, testTimeout, "w2"))
	within(t, cnt.created, testTimeout, "w3's watch of the prefix")
	time.Sleep(300 * time.Millisecond) // a read the creation may need is done
	notYet(t, g3, 10*time.Millisecond, "w3 while w2 holds")
	before := cnt.unary.Load()
	require.NoError(t, w2.Unlock(ctx))
	require.NoError(t, resultWithin(t, g3, testTimeout, "w3"))
	n := cnt.unary.Load() - before
	_, methods := cnt.take()
	require.Zero(t, n, "RPCs between w2's Unlock and w3's Lock: %v", methods)
	require.NoError(t, w3.Unlock(ctx))
}
