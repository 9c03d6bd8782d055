package etcdsync_test

// Tests for the exclusion and liveness holes an adversarial review found
// (issue 8): each one failed on the code before its fix.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

const txnMethod = "/etcdserverpb.KV/Txn"

// injector fails the next n calls of one unary method of a client with
// Unavailable, before they are sent: the server never sees them.
type injector struct {
	mu     sync.Mutex
	method string
	n      int
}

func (in *injector) arm(method string, n int) {
	in.mu.Lock()
	defer in.mu.Unlock()
	in.method, in.n = method, n
}

func (in *injector) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		in.mu.Lock()
		fail := in.n > 0 && method == in.method
		if fail {
			in.n--
		}
		in.mu.Unlock()
		if fail {
			return status.Error(codes.Unavailable, "injected")
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// contender is a Mutex or an Election, seen as "acquire, release, hold".
type contender struct {
	kind    string
	acquire func(context.Context) error
	release func(context.Context) error
	done    func() <-chan struct{}
	err     func() error
}

func contenders(s *etcdsync.Session, name string) []contender {
	m := etcdsync.NewMutex(s, name)
	e := etcdsync.NewElection(s, name)
	return []contender{
		{kind: "mutex", acquire: m.Lock, release: m.Unlock, done: m.Done, err: m.Err},
		{kind: "election", acquire: func(ctx context.Context) error { return e.Campaign(ctx, "v") }, release: e.Resign, done: e.Done, err: e.Err},
	}
}

// Item 2: when the holder's and a waiter's keys go in one revision (a prefix
// delete), the server may send the holder's delete to the waiter first. The
// waiter must see that its own key went too and never acquire.
func TestPrefixDeleteGrantsNobody(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		const trials = 20
		for i := 0; i < trials; i++ {
			for k := range 2 {
				name := fmt.Sprintf("pfx-%d-%d", i, k)
				holder := contenders(session(t, admin), name)[k]
				require.NoError(t, holder.acquire(ctx))
				cnt := counter{created: make(chan struct{}, 2)}
				w := contenders(session(t, c.Client(t, cnt.dial()...)), name)[k]
				errc := make(chan error, 1)
				go func() { errc <- w.acquire(ctx) }()
				for range 2 { // the waiter watches its own key and the holder's
					within(t, cnt.created, testTimeout, "waiter's watch created")
				}
				_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
				require.NoError(t, err)
				select {
				case err := <-errc:
					require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "trial %d %s: the waiter acquired although its key was deleted", i, w.kind)
				case <-time.After(5 * time.Second):
					t.Fatalf("trial %d %s: waiter did not return after its key was deleted", i, w.kind)
				}
				require.Empty(t, keys(t, admin, name+"/"))
			}
		}
	})
}

// Item 4: a Lock whose context has no deadline waits through a partition
// longer than the library's cleanup bound (5 s) and then acquires.
func TestLockOutlivesCleanupBound(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("7 s partition skipped in -short")
	}
	c := single(t)
	u, err := url.Parse(c.Members()[0].Endpoint())
	require.NoError(t, err)
	p := etcdtest.NewProxy(t, u.Host)
	s := session(t, etcdtest.NewClient(t, []string{p.Endpoint()}), etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "nodeadline")
	p.Blackhole(true)
	errc := make(chan error, 1)
	go func() { errc <- m.Lock(context.Background()) }()
	select {
	case err := <-errc:
		t.Fatalf("Lock(Background) returned during the partition: %v", err)
	case <-time.After(7 * time.Second):
	}
	p.Blackhole(false)
	select {
	case err := <-errc:
		require.NoError(t, err)
	case <-time.After(testTimeout):
		t.Fatal("Lock did not return after the partition healed")
	}
	require.NoError(t, m.Unlock(ctxT(t)))
}

// Item 5: a restarted process (WithLease) whose first create fails with an
// RPC error keeps the hold it came to resume, and resumes it on the next try;
// the waiter behind never gets the lock meanwhile.
func TestFailedResumeKeepsHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	var inj injector
	cli := c.Client(t, inj.dial())
	s2, rev, waiter, got := restartBehind(t, cli, admin, "resume")
	m2 := etcdsync.NewMutex(s2, "resume")
	inj.arm(txnMethod, 1)
	err := m2.Lock(ctx)
	require.Error(t, err)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	notWithin(t, got, 500*time.Millisecond, "the waiter acquired: the failed resume deleted the hold")
	require.Len(t, keys(t, admin, "resume/"), 2)

	require.NoError(t, m2.Lock(ctx))
	require.Equal(t, rev, m2.Rev(), "the resumed hold keeps its revision")
	handOver(t, ctx, m2, waiter, got)
}

// restartBehind has a process hold name through cli and die (Orphan), a
// waiter queue behind it through admin, and a restarted process adopt the
// lease (WithLease). It returns the restarted session, the hold's revision,
// and the waiter with a channel closed when its Lock returns.
func restartBehind(t *testing.T, cli, admin *clientv3.Client, name string) (*etcdsync.Session, int64, *etcdsync.Mutex, <-chan struct{}) {
	t.Helper()
	ctx := ctxT(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m1 := etcdsync.NewMutex(s1, name)
	require.NoError(t, m1.Lock(ctx))
	rev := m1.Rev()
	s1.Orphan()
	waiter := etcdsync.NewMutex(session(t, admin), name)
	got := lockAsync(t, ctx, waiter)
	waitKeys(t, admin, name+"/", 2)
	return session(t, cli, etcdsync.WithLease(s1.Lease())), rev, waiter, got
}

// Item 6: Lock, TryLock and Campaign on an ended context send nothing.
func TestEndedContextSendsNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	var cnt counter
	s := session(t, c.Client(t, cnt.dial()...))
	m := etcdsync.NewMutex(s, "ended")
	e := etcdsync.NewElection(s, "ended")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, cancel2 := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel2()
	cnt.take()
	streams := cnt.streams.Load()
	for _, ctx := range []context.Context{cancelled, expired} {
		require.ErrorIs(t, m.Lock(ctx), ctx.Err())
		require.ErrorIs(t, m.TryLock(ctx), ctx.Err())
		require.ErrorIs(t, e.Campaign(ctx, "v"), ctx.Err())
	}
	n, methods := cnt.take()
	require.Zero(t, n, "RPCs sent on an ended context: %v", methods)
	require.Equal(t, streams, cnt.streams.Load(), "streams opened on an ended context")
	require.Empty(t, keys(t, c.Client(t), "ended/"))
}

// Item 7: after an Unlock that failed with an RPC error (and did not
// commit), a loss by someone else's delete reads as ErrNotHeld.
func TestLossCauseAfterFailedUnlock(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	var inj injector
	m := etcdsync.NewMutex(session(t, c.Client(t, inj.dial())), "cause")
	require.NoError(t, m.Lock(ctx))
	done := m.Done()
	inj.arm(txnMethod, 1)
	err := m.Unlock(ctx)
	require.Error(t, err)
	require.NotErrorIs(t, err, etcdsync.ErrLockReleased)
	require.NoError(t, m.Err(), "a failed Unlock keeps the hold")
	_, err = admin.Delete(ctx, m.Key())
	require.NoError(t, err)
	within(t, done, testTimeout, "Done after the key was deleted")
	require.ErrorIs(t, m.Err(), etcdsync.ErrNotHeld)
	require.NotErrorIs(t, m.Err(), etcdsync.ErrLockReleased)
}

// Item 8: the guard of a value with an invalid name or no session is a
// comparison etcd accepts and that is always false.
func TestGuardOnBadValue(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli := c.Client(t)
	s := session(t, cli)
	guards := map[string]clientv3.Cmp{
		"mutex empty name":       etcdsync.NewMutex(s, "").IsOwner(),
		"mutex NUL name":         etcdsync.NewMutex(s, "a\x00b").IsOwner(),
		"mutex nil session":      etcdsync.NewMutex(nil, "x").IsOwner(),
		"election empty name":    etcdsync.NewElection(s, "").IsLeader(),
		"election nil session":   etcdsync.NewElection(nil, "x").IsLeader(),
		"mutex valid, not held":  etcdsync.NewMutex(s, "x").IsOwner(),
		"election valid, no win": etcdsync.NewElection(s, "x").IsLeader(),
	}
	for what, g := range guards {
		resp, err := cli.Txn(ctx).If(g).Then(clientv3.OpPut("guarded", what)).Commit()
		require.NoError(t, err, what)
		require.False(t, resp.Succeeded, what)
	}
	require.Empty(t, keys(t, cli, "guarded"))
}

// Item 9: a Lock that completes as its session ends never hands back a hold
// that is already over without saying so: it returns an error, or a hold
// whose Err says why it ended; and no key stays once the session is closed.
func TestLockAtSessionEnd(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli := c.Client(t)
	holder := etcdsync.NewMutex(session(t, cli), "end")
	for i := 0; i < 30; i++ {
		require.NoError(t, holder.Lock(ctx))
		s, err := etcdsync.NewSession(cli)
		require.NoError(t, err)
		m := etcdsync.NewMutex(s, "end")
		errc := make(chan error, 1)
		go func() { errc <- m.Lock(ctx) }()
		waitKeys(t, cli, "end/", 2)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); s.Close() }()
		require.NoError(t, holder.Unlock(ctx))
		wg.Wait()
		err = <-errc
		if err != nil {
			require.True(t, errors.Is(err, etcdsync.ErrSessionExpired) || errors.Is(err, context.Canceled), "trial %d: %v", i, err)
		} else {
			within(t, m.Done(), testTimeout, "Done of a hold whose session closed")
			require.ErrorIs(t, m.Err(), etcdsync.ErrSessionClosed, "trial %d", i)
		}
		require.Empty(t, keys(t, cli, "end/"), "trial %d", i)
	}
}

// Item 10: with etcd unreachable, Unlock and Resign of a live hold return by
// the session's local deadline whatever their context says, and a release of
// a hold that has ended returns at once.
func TestReleaseBoundedWhileEtcdDown(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	u, err := url.Parse(c.Members()[0].Endpoint())
	require.NoError(t, err)
	p := etcdtest.NewProxy(t, u.Host)
	s := session(t, etcdtest.NewClient(t, []string{p.Endpoint()}), etcdsync.WithTTL(2*time.Second))
	m := etcdsync.NewMutex(s, "down-m")
	e := etcdsync.NewElection(s, "down-e")
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, e.Campaign(ctx, "v"))
	p.Blackhole(true)
	defer p.Blackhole(false)
	cut := time.Now()
	unlocked, resigned := make(chan error, 1), make(chan error, 1)
	go func() { unlocked <- m.Unlock(context.Background()) }()
	go func() { resigned <- e.Resign(context.Background()) }()
	bound := s.TTL() + 1500*time.Millisecond
	select {
	case err := <-unlocked:
		require.ErrorIs(t, err, etcdsync.ErrLockReleased)
	case <-time.After(bound):
		t.Fatalf("Unlock(Background) still blocked %v after etcd became unreachable", bound)
	}
	select {
	case err := <-resigned:
		require.NoError(t, err, "Resign of a leadership that ended is nil, as when not leading")
	case <-time.After(bound - time.Since(cut) + 100*time.Millisecond):
		t.Fatalf("Resign(Background) still blocked %v after etcd became unreachable", bound)
	}
	require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
	start := time.Now()
	require.ErrorIs(t, m.Unlock(context.Background()), etcdsync.ErrLockReleased)
	require.NoError(t, e.Resign(context.Background()))
	require.Less(t, time.Since(start), 100*time.Millisecond, "a release of an ended hold returns at once")
}

// watchVia sends the Watch streams of a client to another connection (a
// chosen member) and leaves its other calls where they were, as a client
// balancing requests over members may do. Each watch created on those streams
// is reported on created, if non-nil.
func watchVia(conn *grpc.ClientConn, created chan<- struct{}) grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		if method != "/etcdserverpb.Watch/Watch" {
			return streamer(ctx, desc, cc, method, opts...)
		}
		s, err := conn.NewStream(ctx, desc, method, opts...)
		if err != nil || created == nil {
			return s, err
		}
		return &createdStream{ClientStream: s, created: created}, nil
	})
}

type createdStream struct {
	grpc.ClientStream
	created chan<- struct{}
}

func (s *createdStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if wr, ok := m.(*pb.WatchResponse); ok && err == nil && wr.Created {
		s.created <- struct{}{}
	}
	return err
}

// unaryVia sends the next n calls of one unary method of a client to another
// connection (a chosen member).
type unaryVia struct {
	conn *grpc.ClientConn
	injector
}

func (u *unaryVia) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		u.mu.Lock()
		redirect := u.n > 0 && method == u.method
		if redirect {
			u.n--
		}
		u.mu.Unlock()
		if redirect {
			return u.conn.Invoke(ctx, method, req, reply, opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	})
}

// peerRig is a 3-member cluster whose members can be cut off from their
// peers, with a follower f and another member u.
func peerRig(t *testing.T) (c *etcdtest.Cluster, f, u *etcdtest.Member) {
	if testing.Short() {
		t.Skip("3-member cluster skipped in -short")
	}
	c = etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	f = c.Follower()
	require.NotNil(t, f)
	for _, m := range c.Members() {
		if m != f {
			u = m
		}
	}
	return c, f, u
}

// caughtUp waits until member m has applied revision rev.
func caughtUp(t *testing.T, m *etcdtest.Member, rev int64) {
	t.Helper()
	deadline := time.Now().Add(testTimeout)
	for m.Rev() < rev {
		require.True(t, time.Now().Before(deadline), "%s did not reach revision %d", m.Name, rev)
		time.Sleep(10 * time.Millisecond) // polling the member's applied revision
	}
}

// Item 1: a waiter whose acquire is served by an up-to-date member but whose
// watches land on a follower lagging behind its read gets replayed deletes of
// older incarnations of the keys it watches (the same sessions unlock and
// lock again). Neither the predecessor's old delete (two holders) nor its own
// key's old delete (a spurious ErrSessionExpired) may count.
func TestLaggingFollowerReplays(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c, f, u := peerRig(t)
	ctx := ctxT(t)
	viaF := etcdtest.NewClient(t, []string{f.Endpoint()})
	created := make(chan struct{}, 16)
	a := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "lag")
	b := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, watchVia(viaF.ActiveConnection(), created))), "lag")
	cut := func() { require.NoError(t, c.CutPeers(f)) }
	// b queues behind a while f lags; f heals and replays what it missed to
	// b's watches; b must still wait for a's real release.
	queueBehindThenHeal := func(trial int, what string) {
		require.Less(t, f.Rev(), a.Rev(), "f does not lag")
		errc := make(chan error, 1)
		go func() { errc <- b.Lock(ctx) }()
		for range 2 {
			within(t, created, testTimeout, "b's watch created on f")
		}
		require.NoError(t, c.HealPeers(f))
		caughtUp(t, f, a.Rev())
		select {
		case err := <-errc:
			t.Fatalf("trial %d: b's Lock returned (%v) while a holds: %s counted", trial, err, what)
		case <-time.After(500 * time.Millisecond):
		}
		require.NoError(t, a.Unlock(ctx))
		select {
		case err := <-errc:
			require.NoError(t, err)
		case <-time.After(testTimeout):
			t.Fatal("b did not acquire after a's release")
		}
	}
	for trial := 0; trial < 3; trial++ {
		// The predecessor's old incarnation: a unlocks and locks again
		// while f lags; b queues behind a's new key, watching through f.
		require.NoError(t, a.Lock(ctx))
		cut()
		require.NoError(t, a.Unlock(ctx))
		require.NoError(t, a.Lock(ctx))
		queueBehindThenHeal(trial, "the predecessor's old delete")

		// Its own key's old incarnation: b unlocks while a waits, and
		// locks again behind a while f lags.
		cut()
		aGot := lockAsync(t, ctx, a)
		waitKeys(t, etcdtest.NewClient(t, []string{u.Endpoint()}), "lag/", 2)
		require.NoError(t, b.Unlock(ctx))
		within(t, aGot, testTimeout, "a's Lock after b's release")
		queueBehindThenHeal(trial, "its own key's old delete")
		require.NoError(t, b.Unlock(ctx))
	}
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

// Item 3: a create sent to a follower cut off from its peers is forwarded to
// the leader and sits in the network; the client gives up and its cleanup,
// served by another member, finds nothing. When the partition heals the create
// is applied. The session must remove that key although it lives on, so that
// the name is not blocked until the session ends.
func TestLateCreateIsSwept(t *testing.T) {
	t.Parallel()
	c, f, u := peerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.NewClient(t, []string{f.Endpoint()})
	red := &unaryVia{conn: viaF.ActiveConnection()}
	s := session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, red.dial()))
	m := etcdsync.NewMutex(s, "late")
	from, err := admin.Get(ctx, "late/")
	require.NoError(t, err)

	require.NoError(t, c.CutPeers(f))
	red.arm(txnMethod, 1) // the create goes to f
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
