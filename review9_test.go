package etcdsync_test

// Regression tests from the second adversarial review, of the restructured
// wait machinery and keepalive loop: each failed on commit 14ba0ae and
// passes since, except R9-7, a known limitation (skipped, with the reason).

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// R9-1: a waiter's stream creates the watch of a new nearest key long after
// the stream opened (its predecessor left while an older key still holds).
// With auth enabled, etcd checks each watch create against the token the
// stream opened with; once that token is no longer valid (a simple token,
// etcd's default, expires after --auth-token-ttl unused, 300 s by default;
// an administrator changes the user's password; with JWT any change of
// users or roles makes it "old") the create is refused with a response
// Created+Canceled carrying WatchId -1. The waiter ignores that response (it
// knows no watch by ID -1) and waits on a watch that does not exist: when the
// holder releases, nothing wakes it; it waits until its ctx or session ends.
// etcd's own client re-opens the stream on these cancel reasons
// (shouldRetryWatch in client/v3/watch.go). "unchanged" is the control.
func TestR9RefusedWatchCreateWaitsForever(t *testing.T) {
	t.Parallel()
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

// refusedWatch queues b behind a holder and c behind b, runs invalidate
// while c waits, makes b give up (so that c's stream must create a watch of
// the holder), releases the holder and expects c to acquire.
func refusedWatch(t *testing.T, connect func(user string, dial ...grpc.DialOption) *clientv3.Client, invalidate func()) {
	ctx := ctxT(t)
	root := connect("root")
	holder := etcdsync.NewMutex(session(t, connect("rw")), "locks/r9-auth")
	require.NoError(t, holder.Lock(ctx))

	// b queues behind the holder; c behind b, watching b.
	b := etcdsync.NewMutex(session(t, connect("rw")), "locks/r9-auth")
	bctx, bcancel := context.WithCancel(ctx)
	defer bcancel()
	berr := make(chan error, 1)
	go func() { berr <- b.Lock(bctx) }()
	waitKeys(t, root, "locks/r9-auth/", 2)
	cnt := counter{created: make(chan struct{}, 16)}
	c := etcdsync.NewMutex(session(t, connect("rw", cnt.dial()...)), "locks/r9-auth")
	cgot := make(chan error, 1)
	go func() { cgot <- c.Lock(ctx) }()
	for range 2 { // c's own key and b's
		within(t, cnt.created, testTimeout, "c's watch created")
	}

	invalidate()

	// b gives up: c now watches the holder, on its old stream.
	bcancel()
	require.ErrorIs(t, <-berr, context.Canceled)
	within(t, cnt.created, testTimeout, "c asked for a watch of the holder")
	require.NoError(t, holder.Unlock(ctx))
	select {
	case err := <-cgot:
		require.NoError(t, err)
	case <-time.After(5 * time.Second):
		t.Fatalf("c did not acquire within 5s of the release; keys %v", keys(t, root, "locks/r9-auth/"))
	}
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
	select {
	case <-e.Server.ReadyNotify():
	case <-time.After(testTimeout):
		t.Fatal("member not ready")
	}
	connect := func(user string, dial ...grpc.DialOption) *clientv3.Client {
		cfg := etcdtest.ClientConfig([]string{client.String()}, dial...)
		if user != "" {
			cfg.Username, cfg.Password = user, user+"-password"
		}
		cli, err := clientv3.New(cfg)
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		return cli
	}
	ctx := ctxT(t)
	admin := connect("")
	for _, user := range []string{"root", "rw"} {
		_, err := admin.UserAdd(ctx, user, user+"-password")
		require.NoError(t, err)
	}
	_, err = admin.RoleAdd(ctx, "locks-rw")
	require.NoError(t, err)
	_, err = admin.RoleGrantPermission(ctx, "locks-rw", "locks/", clientv3.GetPrefixRangeEnd("locks/"), clientv3.PermissionType(clientv3.PermReadWrite))
	require.NoError(t, err)
	_, err = admin.RoleAdd(ctx, "root")
	require.NoError(t, err)
	for user, role := range map[string]string{"root": "root", "rw": "locks-rw"} {
		_, err := admin.UserGrantRole(ctx, user, role)
		require.NoError(t, err)
	}
	_, err = admin.AuthEnable(ctx)
	require.NoError(t, err)
	return connect
}

// cpuTime returns the CPU time (user + system) this process has used.
func cpuTime(t *testing.T) time.Duration {
	var ru syscall.Rusage
	require.NoError(t, syscall.Getrusage(syscall.RUSAGE_SELF, &ru))
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// R9-2: the keepalive loop busy-loops while it cannot open its stream.
// After a stream fails, the next open is due at `next`, which is already in
// the past when the failed stream had sent no beat (it failed while opening),
// and `earliest(next, now+retryPause)` keeps it there. Two faces:
//
//   - open-fails: the open fails at once (no endpoint is up: a one-member
//     cluster restarting, all members down; with auth, a token fetch that
//     fails, e.g. after a password change). The loop reopens at once, again
//     and again: thousands of streams a second and two cores here (with
//     auth, one bcrypt Authenticate on the server after another), for up to
//     a TTL (60 s by default), per session.
//   - open-blocks: the open blocks (no endpoint ready and one connecting:
//     e.g. a restarting member, whose client listener is bound before it
//     replays its WAL, accepts TCP and answers only when ready; a proxy or
//     load balancer in front of a dead member). The beat is due, the timer
//     is armed at earliest(next, deadline), in the past, fires at once, and
//     "!ka.isReady()" sends the loop round again: one core, until the
//     stream opens or the deadline passes.
//
// The session (TTL 6 s) rightly lives on meanwhile; only the process burns.
func TestR9KeepaliveBusyLoopsWhileStreamCannotOpen(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		fault func(p *etcdtest.Proxy)
	}{
		{"open-fails", func(p *etcdtest.Proxy) { p.Close() }},
		{"open-blocks", func(p *etcdtest.Proxy) { p.Blackhole(true); p.DropConnections() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := single(t)
			u, err := url.Parse(c.Members()[0].Endpoint())
			require.NoError(t, err)
			p := etcdtest.NewProxy(t, u.Host)
			cnt := counter{}
			s := session(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...), etcdsync.WithTTL(6*time.Second))
			defer s.Orphan()                    // no revoke through a dead link: the lease expires by itself
			time.Sleep(2500 * time.Millisecond) // the first beat went, on an open stream

			tc.fault(p)
			defer p.Blackhole(false)
			time.Sleep(700 * time.Millisecond) // the stream failed; its next open is due
			c0, w0, st0 := cpuTime(t), time.Now(), cnt.streams.Load()
			time.Sleep(1500 * time.Millisecond)
			used, wall, opened := cpuTime(t)-c0, time.Since(w0), cnt.streams.Load()-st0
			require.NoError(t, s.Err(), "the session is still within its TTL")
			t.Logf("while the keepalive stream cannot open: CPU %v over %v, %d streams opened", used, wall, opened)
			require.Less(t, opened, int64(10), "stream opens without a pause")
			require.Less(t, used, wall/4, "the process spins while its keepalive stream cannot open")
		})
	}
}

// R9-3: ResumeElection shares any live hold of the session on that key, a
// Mutex's included (a Mutex and an Election on one name write the same key
// NAME/<lease>). The Election then "leads" on the Mutex's hold: Proclaim
// overwrites the lock key's value, and Resign deletes the Mutex's key, after
// which the Mutex reports its hold as released by Unlock (ErrLockReleased)
// although nobody unlocked it. The contract shares only a leadership: "when
// a value of the session uses the key otherwise, the Election does not lead
// and Err says why".
func TestR9ResumeElectionDoesNotShareAMutex(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t), etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "r9-shared")
	require.NoError(t, m.Lock(ctx))
	done := m.Done()
	r := etcdsync.ResumeElection(s, "r9-shared", m.Key(), m.Rev())
	if r.Key() != "" {
		perr := r.Proclaim(ctx, "hijacked")
		rerr := r.Resign(ctx)
		select {
		case <-done:
		case <-time.After(2 * time.Second):
		}
		t.Fatalf("ResumeElection shares the Mutex's hold: Proclaim %v, Resign %v; the Mutex's hold then ended: %v (Err %v)",
			perr, rerr, isClosed(done), m.Err())
	}
	require.Error(t, r.Err())
	require.NoError(t, m.Unlock(ctx))
}

func isClosed(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

// R9-4: the fix of R8-7 covers only creates whose acquire succeeded (they are
// recorded with Session.created and skipped). Once a create of unknown outcome
// has started the sweeper for a key, every later acquire of that key that
// fails after writing (a Lock whose ctx ends while it waits, the usual
// "try for a while" loop) leaves a create the sweeper has seen and not
// skipped: as soon as the acquire frees the key, the sweeper takes the key's
// in-process claim and sends a fenced delete of a key the acquire already
// deleted. Meanwhile TryLock on the same session and name returns ErrLocked
// ("held, or waited for, by this session") although nobody holds or waits for
// the name. "unswept" is the control.
func TestR9SweeperStealsClaimAfterFailedLock(t *testing.T) {
	t.Parallel()
	for _, swept := range []bool{true, false} {
		t.Run(map[bool]string{true: "swept", false: "unswept"}[swept], func(t *testing.T) {
			c := single(t)
			ctx := ctxT(t)
			m := sweptMutex(t, c, "r9-steal", swept)
			holder := etcdsync.NewMutex(session(t, c.Client(t)), "r9-steal")
			spurious := 0
			for i := 0; i < 5; i++ {
				require.NoError(t, holder.Lock(ctx))
				lctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
				require.ErrorIs(t, m.Lock(lctx), context.DeadlineExceeded) // it waited, and withdrew its key
				cancel()
				require.NoError(t, holder.Unlock(ctx))
				if err := m.TryLock(ctx); err != nil {
					require.ErrorIs(t, err, etcdsync.ErrLocked)
					spurious++
					t.Logf("trial %d: %v", i, err)
					time.Sleep(100 * time.Millisecond)
					continue
				}
				require.NoError(t, m.Unlock(ctx))
			}
			require.Zero(t, spurious, "TryLock on a free name returned ErrLocked")
		})
	}
}

// streamBreaker fails the Watch streams of a client at one chosen point: once
// armed, the first stream that receives a response with a DELETE event fails
// its next receive (as a member restart or a lost leader does); the watch ID
// of that first delete is reported on first. Each Created response is
// reported on created.
type streamBreaker struct {
	armed   atomic.Bool
	first   chan int64
	created chan struct{}
}

func (b *streamBreaker) dial() grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, method, opts...)
		if err != nil || method != "/etcdserverpb.Watch/Watch" {
			return s, err
		}
		return &breakingStream{ClientStream: s, b: b}, nil
	})
}

type breakingStream struct {
	grpc.ClientStream
	b        *streamBreaker
	failNext bool
}

func (s *breakingStream) RecvMsg(m any) error {
	if s.failNext {
		return status.Error(codes.Unavailable, "injected: the watch stream broke")
	}
	err := s.ClientStream.RecvMsg(m)
	wr, ok := m.(*pb.WatchResponse)
	if err != nil || !ok {
		return err
	}
	if wr.Created {
		s.b.created <- struct{}{}
	}
	for _, ev := range wr.Events {
		if ev.Type == mvccpb.DELETE && s.b.armed.CompareAndSwap(true, false) {
			s.failNext = true
			s.b.first <- wr.WatchId
			break
		}
	}
	return nil
}

// R9-5: when the waiter has seen its last predecessor's delete it trims that
// key from t.ahead *before* confirming the turn (st.confirm: progress request,
// own key not deleted at that revision). If the stream breaks during confirm,
// wait() retries: it sleeps, calls settle and ignores settle's error unless it
// says the key is gone; but t.blocked() is already false, so the loop ends
// and the turn is granted with no confirmation and no read, at the header of
// the last read (a revision at which the predecessor still held). With the
// holder's and the waiter's keys deleted in one revision (a prefix delete:
// issue 8 item 2) and the predecessor's event first on the stream, Lock
// returns nil with no key: the third contender then holds too. Here the
// stream breaks right after the predecessor's delete and the re-read fails
// (both injected, each a single fault: a member restart makes both).
func TestR9BrokenConfirmGrantsTurn(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	admin := c.Client(t)
	for trial := 0; trial < 10; trial++ {
		name := fmt.Sprintf("r9-confirm-%d", trial)
		holder := etcdsync.NewMutex(session(t, admin), name)
		require.NoError(t, holder.Lock(ctx))
		b := &streamBreaker{first: make(chan int64, 1), created: make(chan struct{}, 16)}
		var inj injector
		w := etcdsync.NewMutex(session(t, c.Client(t, b.dial(), inj.dial())), name)
		errc := make(chan error, 1)
		go func() { errc <- w.Lock(ctx) }()
		for range 2 { // own key and the holder's
			within(t, b.created, testTimeout, "waiter's watch created")
		}
		b.armed.Store(true)
		inj.arm("/etcdserverpb.KV/Range", 3) // the re-reads fail, then one gets through
		_, err := admin.Delete(ctx, name+"/", clientv3.WithPrefix())
		require.NoError(t, err)
		first := <-b.first
		var lerr error
		select {
		case lerr = <-errc:
		case <-time.After(testTimeout):
			t.Fatalf("trial %d: the waiter did not return", trial)
		}
		inj.arm("", 0)
		if first == 1 { // its own key's delete came first: not this case
			require.ErrorIs(t, lerr, etcdsync.ErrSessionExpired)
			continue
		}
		if lerr == nil {
			third := etcdsync.NewMutex(session(t, admin), name)
			terr := third.TryLock(ctx)
			t.Fatalf("trial %d: Lock returned nil with its key gone (keys %v, Header rev %d, the holder's delete came first); a third TryLock: %v",
				trial, keys(t, admin, name+"/"), w.Header().Revision, terr)
		}
		require.ErrorIs(t, lerr, etcdsync.ErrSessionExpired)
		return
	}
	t.Skip("the holder's delete never came first in 10 trials")
}

// R9-6 (minor): two handles of one shared leadership disagree on its Header.
// Election.Header is "the response header of the last successful Campaign or
// Proclaim of the current term", but each Election keeps the header of its
// own Proclaims: after a Proclaim through r, e (same term) still returns the
// Campaign's header, a revision at which the leader's value was the old one.
func TestR9SharedLeadershipHeader(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	s := session(t, c.Client(t), etcdsync.WithTTL(30*time.Second))
	e := etcdsync.NewElection(s, "r9-header")
	require.NoError(t, e.Campaign(ctx, "v1"))
	r := etcdsync.ResumeElection(s, "r9-header", e.Key(), e.Rev())
	require.NoError(t, r.Proclaim(ctx, "v2"))
	require.Equal(t, r.Header().Revision, e.Header().Revision, "one term, two headers")
	require.NoError(t, e.Resign(ctx))
}

// R9-7: the sweeper that removes a late-applied create dies with its session,
// so a hand-over (Orphan, then a restarted process adopts the lease with
// WithLease) drops it. A create of unknown outcome (here forwarded by a
// follower cut off from its peers) that the server applies after the
// hand-over leaves a key with the adopted, live lease at the head of the
// queue: the name is blocked for every other contender for as long as the
// adopting process lives. Issue 8 item 3: "a create whose outcome is unknown
// must never leave a key that outlives the call, however late it is applied".
// (The adopting session even counts the key as its own: its create revision
// is past the adoption's floor.)
//
// Not fixed yet: no process left alive knows of that create. A fix needs an
// incarnation fence (each create compares against a per-session marker that
// an adopting process replaces) or a hand-over of the swept names through
// Orphan; see the closing note of issues 8 and 9.
func TestR9LateCreateAfterHandOverBlocksName(t *testing.T) {
	t.Parallel()
	t.Skip("known limitation: a late create of an orphaned session's call, applied after a restarted process adopted the lease, is swept by nobody")
	c, f, u := peerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.NewClient(t, []string{f.Endpoint()})
	red := &unaryVia{conn: viaF.ActiveConnection()}
	cli := etcdtest.NewClient(t, []string{u.Endpoint()}, red.dial())
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m := etcdsync.NewMutex(s1, "r9-handover")
	from, err := admin.Get(ctx, "r9-handover/")
	require.NoError(t, err)

	require.NoError(t, c.CutPeers(f))
	healed := false
	defer func() {
		if !healed {
			c.HealPeers(f)
		}
	}()
	red.arm(txnMethod, 1) // the create goes to f, which forwards it to the leader
	lctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	require.Error(t, m.Lock(lctx))
	cancel()
	require.Empty(t, keys(t, admin, "r9-handover/"))

	// The process restarts: it hands its lease over to its next incarnation.
	s1.Orphan()
	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	require.NoError(t, c.HealPeers(f))
	healed = true

	wch := admin.Watch(ctx, "r9-handover/", clientv3.WithPrefix(), clientv3.WithRev(from.Header.Revision+1))
	created := lateCreate(t, wch)
	other := etcdsync.NewMutex(session(t, admin), "r9-handover")
	octx, ocancel := context.WithTimeout(ctx, 5*time.Second)
	defer ocancel()
	require.NoError(t, other.Lock(octx), "the late create (revision %d) of the handed-over lease blocks the name: keys %v", created, keys(t, admin, "r9-handover/"))
	require.NoError(t, other.Unlock(ctx))
	require.NoError(t, s2.Err())
}
