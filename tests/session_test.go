package tests

// Sessions: TTLs and options, their end (Close, Orphan, revoke, lost
// contact), health answers (Check), NewSession's bounds against refused,
// silent and leaderless endpoints, and adopted leases.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
)

func TestSessionBadInput(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	_, err := etcdsync.NewSession(nil)
	require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	for _, opts := range [][]etcdsync.SessionOption{
		{etcdsync.WithTTL(999 * time.Millisecond)},
		{etcdsync.WithTTL(-time.Second)},
		{etcdsync.WithTTL(5 * time.Second), etcdsync.WithLease(1)},
		{nil},
	} {
		_, err := etcdsync.NewSession(cli, opts...)
		require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
	}
	_, err = etcdsync.NewSession(cli, etcdsync.WithLease(12345))
	require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "adopting a lease that does not exist")
	leases, err := cli.Leases(ctxT(t))
	require.NoError(t, err)
	require.Empty(t, leases.Leases, "a failed NewSession left a lease")
}

func TestSessionTTLRoundsUp(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli := c.Client(t)
	s := session(t, cli, etcdsync.WithTTL(1500*time.Millisecond))
	require.Equal(t, 2*time.Second, s.TTL())
	require.Equal(t, 2*time.Second, s.Slack(), "the default slack: at least 2 s")
	resp, err := cli.TimeToLive(ctxT(t), s.Lease())
	require.NoError(t, err)
	require.Equal(t, int64(4), resp.GrantedTTL, "the lease: the TTL and the slack")
}

// DeadlineMoved closes when an acknowledged keepalive moves the local
// deadline (later than before), and at the session's end; after the end it
// is closed already.
func TestSessionDeadlineMoved(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	s := session(t, c.Client(t), etcdsync.WithTTL(time.Second))
	for range 3 {
		moved := s.DeadlineMoved()
		before := s.Deadline()
		within(t, moved, 10*time.Second, "an acknowledged keepalive moves the deadline")
		require.True(t, s.Deadline().After(before), "the deadline moved on")
		require.Nil(t, s.Err())
	}
	moved := s.DeadlineMoved()
	require.NoError(t, s.Close())
	within(t, moved, 5*time.Second, "the end closes the channel")
	select {
	case <-s.DeadlineMoved():
	default:
		t.Fatal("DeadlineMoved after the end: not closed")
	}
}

// The lease outlives several TTLs while the session runs; Close revokes it,
// Orphan leaves it to expire.
func TestSessionKeepAliveCloseOrphan(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli, etcdsync.WithTTL(time.Second))
	notWithin(t, s.Done(), 3500*time.Millisecond, "session with keepalives ended")
	ttl, err := cli.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.GreaterOrEqual(t, ttl.TTL, int64(0), "lease still exists")
	require.True(t, s.Deadline().After(time.Now()))

	require.NoError(t, s.Close())
	require.NoError(t, s.Close())
	s.Orphan()
	require.ErrorIs(t, s.Err(), etcdsync.ErrSessionClosed)
	ttl, err = cli.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.Equal(t, int64(-1), ttl.TTL, "Close revokes")

	o := session(t, cli, etcdsync.WithTTL(30*time.Second))
	o.Orphan()
	o.Orphan()
	within(t, o.Done(), 5*time.Second, "Done after Orphan")
	require.ErrorIs(t, context.Cause(o.Ctx()), etcdsync.ErrSessionClosed)
	ttl, err = cli.TimeToLive(ctx, o.Lease())
	require.NoError(t, err)
	require.Greater(t, ttl.TTL, int64(0), "Orphan keeps the lease")
	_, err = cli.Revoke(ctx, o.Lease())
	require.NoError(t, err)
}

// Invariant "Loss signal": a lease revoked by someone else ends the session at the next
// keepalive; cancelling the WithContext context ends it at once.
func TestSessionEnds(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli, etcdsync.WithTTL(12*time.Second))
	_, err := cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	// The next keepalive is due within TTL/3; the local deadline is a TTL away.
	within(t, s.Done(), 8*time.Second, "session Done after its lease was revoked")
	require.ErrorIs(t, s.Err(), etcdsync.ErrSessionExpired)
	require.NoError(t, s.Close(), "closing a session whose lease is gone")

	sctx, cancel := context.WithCancel(ctx)
	s2 := session(t, cli, etcdsync.WithContext(sctx))
	cancel()
	within(t, s2.Done(), 5*time.Second, "session Done after its context was cancelled")
	require.ErrorIs(t, s2.Err(), context.Canceled)
}

// Invariant "Loss signal": when keepalives stop getting through (blackhole), the
// session's Done, and a hold's Done, close before the server deletes the
// key (watched from another client) (etcd-io/etcd#5571: etcd's Session.Done
// never closed while etcd was unreachable; since the fix it closes a TTL
// after the last keepalive reply arrived, which can be after the server's
// expiry).
func TestSessionDeadlineBeatsServerExpiry(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		cli, link := c.ClientThrough(t)
		s := session(t, cli, etcdsync.WithTTL(2*time.Second))
		m := etcdsync.NewMutex(s, "blackhole")
		require.NoError(t, m.Lock(ctx))
		holdDone := m.Done()

		wch := admin.Watch(ctx, m.Key(), clientv3.WithRev(m.Rev()+1))
		doneAt := make(chan time.Time, 1)
		go func() { <-s.Done(); doneAt <- time.Now() }()
		cut := time.Now()
		link.Cut()
		deleted := awaitDelete(t, wch)
		require.True(t, isClosed(s.Done()), "the server deleted the key before the session's Done closed")
		require.True(t, isClosed(holdDone), "the server deleted the key before the hold's Done closed")
		closed := <-doneAt
		require.False(t, s.Deadline().After(cut.Add(s.TTL())), "deadline later than the cut plus the TTL")
		require.False(t, closed.After(s.Deadline().Add(250*time.Millisecond)), "Done closed %v after the local deadline", closed.Sub(s.Deadline()))
		require.ErrorIs(t, s.Err(), etcdsync.ErrSessionExpired)
		require.ErrorIs(t, s.Err(), etcdsync.ErrLostContact)
		require.ErrorIs(t, m.Err(), etcdsync.ErrLostContact)
		t.Logf("lead of the local deadline over the server's delete (as seen by a watcher): %v", deleted.Sub(s.Deadline()))
		link.Heal()
	})
}

// NewSession never waits past its context (etcd-io/etcd#14631), nor, without
// one, past the TTL.
func TestNewSessionBounded(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	cli, link := c.ClientThrough(t)
	link.Cut()

	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, err := etcdsync.NewSession(cli, etcdsync.WithContext(ctx))
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	}()
	within(t, done, 5*time.Second, "NewSession with a 300ms context")

	done = make(chan struct{})
	go func() {
		defer close(done)
		_, err := etcdsync.NewSession(cli, etcdsync.WithTTL(time.Second))
		assert.Error(t, err)
	}()
	within(t, done, 5*time.Second, "NewSession with a 1s TTL")
	link.Heal()
}

// The session keeps its lease while the raft leader is stopped and restarted.
func TestSessionSurvivesLeaderStop(t *testing.T) {
	t.Parallel()
	c := kitThree(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli, etcdsync.WithTTL(3*time.Second))
	m := etcdsync.NewMutex(s, "leader-stop")
	require.NoError(t, m.Lock(ctx))
	leader := c.Leader()
	require.NotNil(t, leader)
	leader.Stop()
	notWithin(t, s.Done(), 7*time.Second, "session ended while a quorum was up")
	require.NoError(t, leader.Restart())
	resp, err := cli.Get(ctx, m.Key())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1)
	require.Equal(t, m.Rev(), resp.Kvs[0].CreateRevision)
	require.NoError(t, m.Unlock(ctx))
}

// Invariant "Loss signal": a lease revoked by someone else ends a session that holds a
// watched lock within a round trip, not at the next keepalive (TTL/3 = 20s
// at the default TTL).
func TestSessionEndsSoonAfterRevoke(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli) // default 60s TTL
	m := etcdsync.NewMutex(s, "revoke-soon")
	require.NoError(t, m.Lock(ctx))
	m.Done()
	_, err := cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
	within(t, m.Done(), 5*time.Second, "hold Done after the revoke")
	within(t, s.Done(), 5*time.Second, "session Done after the revoke")
	require.ErrorIs(t, s.Err(), etcdsync.ErrSessionExpired)
	require.NotErrorIs(t, s.Err(), etcdsync.ErrLostContact)
}

// Close returns by the TTL when etcd cannot be reached: its revoke is
// bounded, the lease is left to expire on the server (etcd-io/etcd#6681:
// etcd's Session.Close blocked in Revoke for as long as the client had no
// connection).
func TestCloseBoundedWhileEtcdUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	p := faults.Proxy(t, c)
	s, err := etcdsync.NewSession(etcdtest.NewClient(t, []string{p.Endpoint()}), etcdsync.WithTTL(2*time.Second))
	require.NoError(t, err)
	m := etcdsync.NewMutex(s, "close-unreachable")
	require.NoError(t, m.Lock(ctx))
	p.Blackhole(true)
	defer p.Blackhole(false)
	closed := async(s.Close)
	require.Error(t, resultWithin(t, closed, s.TTL()+1500*time.Millisecond, "Close with etcd unreachable"), "the revoke cannot have gone through")
	waitNoKeys(t, admin, "close-unreachable/") // the server expires the lease
}

// cutHolder holds name on s (whose client goes through p), queues a
// contender on other, cuts p, and returns when the holder was told (its
// hold's Done), when the contender got the lock, and the send time of the
// holder's last acknowledged keepalive (its Deadline less its TTL when told).
func cutHolder(t *testing.T, ctx context.Context, s *etcdsync.Session, p *etcdtest.Proxy, other *clientv3.Client, name string) (told, got, lastAck time.Time) {
	t.Helper()
	m := etcdsync.NewMutex(s, name)
	require.NoError(t, m.Lock(ctx))
	b := etcdsync.NewMutex(session(t, other), name)
	bHolds := async(func() error { return b.Lock(ctx) })
	waitKeys(t, other, name+"/", 2)
	p.Blackhole(true)
	within(t, m.Done(), s.TTL()+testTimeout, "the holder is told")
	told = time.Now()
	lastAck = s.Deadline().Add(-s.TTL())
	require.ErrorIs(t, m.Check(), etcdsync.ErrLostContact)
	require.NoError(t, resultWithin(t, bHolds, s.TTL()+s.Slack()+2*time.Minute, "the contender gets the lock"))
	got = time.Now()
	return told, got, lastAck
}

// A session that adopts a lease (WithLease) after a restart keeps the slack
// promise whoever granted the lease and with what: etcd's own concurrency
// package (no slack), etcdsync with another slack or none, with a lock
// delay adopted with it, or with little of the TTL left. Cut off, the
// adopter is told at least its slack (and delay) before the next holder
// gets the lock.
func TestAdoptedLeaseTellsBeforeSuccessorHolds(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := single(t)
	admin := c.Client(t)
	orphaned := func(t *testing.T, opts ...etcdsync.SessionOption) clientv3.LeaseID {
		s, err := etcdsync.NewSession(admin, opts...)
		require.NoError(t, err)
		s.Orphan()
		return s.Lease()
	}
	for _, tc := range []struct {
		name  string
		lease func(t *testing.T) clientv3.LeaseID
		opts  []etcdsync.SessionOption
		delay time.Duration
	}{
		{"etcd concurrency TTL 5", func(t *testing.T) clientv3.LeaseID {
			s, err := concurrency.NewSession(admin, concurrency.WithTTL(5))
			require.NoError(t, err)
			s.Orphan()
			return s.Lease()
		}, nil, 0},
		{"etcdsync slack 4s", func(t *testing.T) clientv3.LeaseID {
			return orphaned(t, etcdsync.WithTTL(3*time.Second), etcdsync.WithSlack(4*time.Second))
		}, nil, 0},
		{"etcdsync no slack", func(t *testing.T) clientv3.LeaseID {
			return orphaned(t, etcdsync.WithTTL(4*time.Second), etcdsync.WithSlack(0))
		}, nil, 0},
		{"etcdsync no slack adopted without", func(t *testing.T) clientv3.LeaseID {
			return orphaned(t, etcdsync.WithTTL(4*time.Second), etcdsync.WithSlack(0))
		}, []etcdsync.SessionOption{etcdsync.WithSlack(0)}, 0},
		{"etcdsync lock delay 2s", func(t *testing.T) clientv3.LeaseID {
			return orphaned(t, etcdsync.WithTTL(3*time.Second), etcdsync.WithLockDelay(2*time.Second))
		}, []etcdsync.SessionOption{etcdsync.WithLockDelay(2 * time.Second)}, 2 * time.Second},
		{"little TTL left", func(t *testing.T) clientv3.LeaseID {
			id := orphaned(t, etcdsync.WithTTL(3*time.Second)) // 5 s granted
			for {
				resp, err := admin.TimeToLive(ctxT(t), id)
				require.NoError(t, err)
				require.Greater(t, resp.TTL, int64(3), "missed the moment")
				if resp.TTL == 4 { // 4 s and some left: the adopter has 2 s and some
					return id
				}
				time.Sleep(50 * time.Millisecond) // polling the server's TTL
			}
		}, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx := ctxT(t)
			id := tc.lease(t)
			cli, p := faults.Proxied(t, c)
			s := session(t, cli, append([]etcdsync.SessionOption{etcdsync.WithLease(id)}, tc.opts...)...)
			ttl, err := admin.TimeToLive(ctx, id)
			require.NoError(t, err)
			t.Logf("granted %ds: TTL %v, slack %v, delay %v, deadline in %v", ttl.GrantedTTL, s.TTL(), s.Slack(), tc.delay, time.Until(s.Deadline()))
			require.Equal(t, time.Duration(ttl.GrantedTTL)*time.Second, s.TTL()+s.Slack()+tc.delay)
			told, got, _ := cutHolder(t, ctx, s, p, admin, "adopted-"+strings.ReplaceAll(tc.name, " ", "-"))
			t.Logf("the contender got the lock %v after the holder was told", got.Sub(told))
			require.GreaterOrEqual(t, got.Sub(told), s.Slack()+tc.delay-200*time.Millisecond)
		})
	}
}

// NewSession started while the cluster has no leader (quorum lost for a
// moment, a leader election) succeeds once a leader is back within its
// bound (the client's DialTimeout, 5 s here): it waits for an answer that
// bound. Today the grant fails with "etcdserver: no leader" after etcd's
// client has spent its retries (about 1.3 s), as it did before the bound.
func TestNewSessionWaitsForLeaderWithinDialTimeout(t *testing.T) {
	t.Parallel()
	etcdtest.SkipSlowInShort(t)
	c := three(t)
	cli := c.Client(t) // DialTimeout 5 s
	c.Stop(c.Member(1))
	c.Stop(c.Member(2))
	back := time.AfterFunc(2*time.Second, func() { // the fault's schedule: a leader again after about 3 s
		assert.NoError(t, c.Restart(c.Member(1)))
	})
	t.Cleanup(func() { back.Stop() })
	began := time.Now()
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	t.Logf("after %v: %v", time.Since(began), err)
	require.NoError(t, err, "NewSession gave up while a leader was being elected")
	s.Close()
}

// Check is ErrNotHeld before a hold, nil while it lasts, and turns to the
// cause as soon as the hold is lost, also when nobody called Done: the key
// deleted by someone, or the session closed.
func TestCheckFollowsTheHold(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	checks := map[string]func() error{}
	m := etcdsync.NewMutex(s, "health-m")
	e := etcdsync.NewElection(s, "health-e")
	rw := etcdsync.NewRWMutex(s, "health-rw")
	sem := etcdsync.NewSemaphore(s, "health-sem", 2)
	checks["Mutex"], checks["Election"], checks["RWMutex"], checks["Semaphore"] = m.Check, e.Check, rw.Check, sem.Check
	for kind, check := range checks {
		require.ErrorIs(t, check(), etcdsync.ErrNotHeld, kind)
	}
	require.NoError(t, s.Check())
	require.NoError(t, m.Lock(ctx))
	require.NoError(t, e.Campaign(ctx, "v"))
	require.NoError(t, rw.RLock(ctx))
	require.NoError(t, sem.Acquire(ctx, 1))
	for kind, check := range checks {
		require.NoError(t, check(), kind)
	}

	// Someone deletes the Mutex's key: its Check (which started the loss
	// watch) turns, the others stay.
	_, err := cli.Delete(ctx, m.Key())
	require.NoError(t, err)
	require.Eventually(t, func() bool { return m.Check() != nil }, testTimeout, 10*time.Millisecond)
	require.ErrorIs(t, m.Check(), etcdsync.ErrNotHeld)
	require.NoError(t, e.Check())

	require.NoError(t, s.Close())
	require.ErrorIs(t, s.Check(), etcdsync.ErrSessionClosed)
	for kind, check := range checks {
		require.Error(t, check(), kind)
	}
}

// Session.Check is ErrSessionExpired once the session is cut off past its
// local deadline, no later than Done closes.
func TestSessionCheckOnLostContact(t *testing.T) {
	t.Parallel()
	c := single(t)
	acli, p := faults.Proxied(t, c)
	s := session(t, acli, etcdsync.WithTTL(2*time.Second))
	e := etcdsync.NewElection(s, "health-lost")
	require.NoError(t, e.Campaign(ctxT(t), "v"))
	require.NoError(t, e.Check())
	p.Blackhole(true)
	defer p.Blackhole(false)
	require.Eventually(t, func() bool { return s.Check() != nil }, testTimeout, 10*time.Millisecond)
	require.ErrorIs(t, s.Check(), etcdsync.ErrSessionExpired)
	require.ErrorIs(t, s.Check(), etcdsync.ErrLostContact)
	require.False(t, time.Now().Before(s.Deadline()), "Check turned before the deadline")
	require.ErrorIs(t, e.Check(), etcdsync.ErrSessionExpired)
}

// A Lock whose context has no deadline waits through a partition longer
// than the library's cleanup bound (5 s) and then acquires.
func TestLockWaitsThroughLongPartition(t *testing.T) {
	t.Parallel()
	if testing.Short() {
		t.Skip("7 s partition skipped in -short")
	}
	c := single(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "nodeadline")
	p.Blackhole(true)
	errc := async(func() error { return m.Lock(context.Background()) })
	notYet(t, errc, 7*time.Second, "Lock(Background) during the partition")
	p.Blackhole(false)
	require.NoError(t, resultWithin(t, errc, testTimeout, "Lock after the partition healed"))
	require.NoError(t, m.Unlock(ctxT(t)))
}

// With etcd unreachable, Unlock and Resign of a live hold return by the
// session's local deadline whatever their context says, and a release of a
// hold that has ended returns at once.
func TestReleaseBoundedWhileEtcdUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	ctx := ctxT(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(2*time.Second))
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
	// etcd is unreachable: a release that sent an RPC would not return.
	released := async(func() error {
		if err := m.Unlock(context.Background()); !errors.Is(err, etcdsync.ErrLockReleased) {
			return fmt.Errorf("Unlock: %v, want ErrLockReleased", err)
		}
		return e.Resign(context.Background())
	})
	require.NoError(t, resultWithin(t, released, 10*time.Second, "a release of an ended hold, with etcd unreachable"))
}

// A release in flight returns at once when its session ends, closed or cut
// off until its local deadline, also while the session's logger is slow to
// record the loss of the session's other holds: the session's end, not each
// hold's turn in it, cancels the release.
func TestReleaseEndsWithTheSessionWhileItsLoggerIsSlow(t *testing.T) {
	t.Parallel()
	for _, end := range []string{"closed", "cut off"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			c := single(t)
			ctx := ctxT(t)
			g := faults.NewDeleteGate()
			cli, p := faults.Proxied(t, c, g.Dial())
			log := &slowLossLog{fast: "slow-log", open: make(chan struct{})}
			s := session(t, cli, etcdsync.WithTTL(2*time.Second), etcdsync.WithLogger(slog.New(log)))
			for i := range 7 {
				require.NoError(t, etcdsync.NewMutex(s, fmt.Sprintf("slow-log-other-%d", i)).Lock(ctx))
			}
			m := etcdsync.NewMutex(s, "slow-log")
			require.NoError(t, m.Lock(ctx))
			defer close(log.open) // before the session's Close in the cleanup
			var unlocked, closed <-chan error
			bound := time.Second
			switch end {
			case "closed":
				g.Hold()
				t.Cleanup(g.Release)
				unlocked = async(func() error { return m.Unlock(context.Background()) })
				within(t, g.Held, testTimeout, "the Unlock's transaction held")
				closed = async(s.Close)
				t.Cleanup(func() { resultWithin(t, closed, testTimeout, "Close") }) // once the logger is let go
			case "cut off":
				p.Blackhole(true)
				defer p.Blackhole(false)
				unlocked = async(func() error { return m.Unlock(context.Background()) })
				bound = s.TTL() + 1500*time.Millisecond
			}
			start := time.Now()
			err := resultWithin(t, unlocked, 20*time.Second, "Unlock")
			t.Logf("Unlock returned after %v: %v", time.Since(start), err)
			require.ErrorIs(t, err, etcdsync.ErrLockReleased)
			require.Less(t, time.Since(start), bound, "Unlock after the session ended")
		})
	}
}

// slowLossLog is a slog handler that takes 2 s (or until open closes) over
// each "hold lost" record of a name other than fast: a logger writing to a
// slow sink.
type slowLossLog struct {
	fast string
	open chan struct{}
}

func (h *slowLossLog) Enabled(context.Context, slog.Level) bool { return true }
func (h *slowLossLog) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *slowLossLog) WithGroup(string) slog.Handler            { return h }
func (h *slowLossLog) Handle(_ context.Context, r slog.Record) error {
	if !strings.Contains(r.Message, "hold lost") {
		return nil
	}
	slow := true
	r.Attrs(func(a slog.Attr) bool {
		slow = slow && !(a.Key == "name" && a.Value.String() == h.fast)
		return true
	})
	if slow {
		select {
		case <-h.open:
		case <-time.After(2 * time.Second):
		}
	}
	return nil
}

// A Lock whose ctx ends while etcd is unreachable keeps its caller past the
// deadline by a bounded time (createGrace for the create, then the cleanup's
// own bound, in the caller's goroutine): less than 2 s past a 300 ms
// deadline.
func TestLockOverrunBoundedWhileUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, p := faults.Proxied(t, c)
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	m := etcdsync.NewMutex(s, "r8-overrun")
	p.Blackhole(true)
	defer p.Blackhole(false)
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := m.Lock(ctx)
	took := time.Since(start)
	t.Logf("Lock(300ms) returned after %v: %v", took, err)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Less(t, took, 300*time.Millisecond+2*time.Second, "the caller waits past its deadline")
}

// A waiting Lock whose context ends while etcd is unreachable returns
// within a bounded time: withdrawing its key is bounded too, and the session
// removes the key once etcd answers again (etcd-io/etcd#18082: etcd's Lock
// withdraws its key under the client's context, which never ends, so it
// blocks for as long as etcd cannot be reached).
func TestCancelledWaitReturnsWhileUnreachable(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	ctx := ctxT(t)
	const name = "wait-unreachable"
	holder := etcdsync.NewMutex(session(t, admin), name)
	require.NoError(t, holder.Lock(ctx))

	p := faults.Proxy(t, c)
	cnt := counter{created: make(chan struct{}, 8)}
	m := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{p.Endpoint()}, cnt.dial()...), etcdsync.WithTTL(30*time.Second)), name)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	got := async(func() error { return m.Lock(lctx) })
	within(t, cnt.created, testTimeout, "the waiter's watch (of the prefix: the holder is all it waits for)")
	p.Blackhole(true)
	defer p.Blackhole(false)
	cancel()
	cut := time.Now()
	require.ErrorIs(t, resultWithin(t, got, 3*time.Second, "the cancelled Lock with etcd unreachable"), context.Canceled)
	t.Logf("the cancelled Lock returned %v after the cancel", time.Since(cut))
	p.Blackhole(false)
	waitCount(t, admin, name+"/", testTimeout, func(n int) bool { return n == 1 }) // the holder's key alone
	require.NoError(t, holder.Unlock(ctx))

	// etcd's Mutex in the same sequence.
	const theirs = "wait-unreachable-etcd"
	eholder := etcdsync.NewMutex(session(t, admin), theirs)
	require.NoError(t, eholder.Lock(ctx))
	ep := faults.Proxy(t, c)
	ecnt := counter{created: make(chan struct{}, 8)}
	es := theirSession(t, etcdtest.NewClient(t, []string{ep.Endpoint()}, ecnt.dial()...))
	em := concurrency.NewMutex(es, theirs)
	ectx, ecancel := context.WithCancel(ctx)
	defer ecancel()
	egot := async(func() error { return em.Lock(ectx) })
	within(t, ecnt.created, testTimeout, "etcd's waiter's watch")
	ep.Blackhole(true)
	defer ep.Blackhole(false)
	ecancel()
	notYet(t, egot, 2*time.Second, "etcd's cancelled Lock with etcd unreachable (#18082: it withdraws under client.Ctx())")
	ep.Blackhole(false)
	require.ErrorIs(t, resultWithin(t, egot, testTimeout, "etcd's cancelled Lock once etcd answers"), context.Canceled)
	require.NoError(t, eholder.Unlock(ctx))
}

// A session ended while one of its waits opens a watch on a silent link.
// Orphan returns at once (it does not wait on etcd: the wait ends with the
// session, and the closing of its stream is stopped); the Lock returns
// ErrSessionClosed within the bounded removal of its key. Close ends the
// wait as soon, and once the link is back (before the TTL) its revoke goes
// through and the wait's stream is closed.
func TestSessionEndsWhileAWaitOpensAWatchOnASilentLink(t *testing.T) {
	t.Parallel()
	c := single(t)
	for _, end := range []string{"Orphan", "Close"} {
		t.Run(end, func(t *testing.T) {
			t.Parallel()
			admin, ctx := c.Client(t), ctxT(t)
			name := "end-silent-" + end
			holder := heldMutex(t, ctx, admin, name)
			rig := newSilentRig(t, c)
			s := session(t, rig.cli, etcdsync.WithTTL(10*time.Second))
			rig.sw.arm("", 0, 1, 0)
			res := async(func() error { return etcdsync.NewMutex(s, name).Lock(ctx) })
			within(t, rig.sw.silenced, testTimeout, "the link going silent at the first Watch")
			start := time.Now()
			ended := async(func() error {
				if end == "Orphan" {
					s.Orphan()
					return nil
				}
				return s.Close()
			})
			lockErr := resultWithin(t, res, testTimeout, "the Lock")
			lockTook := time.Since(start)
			require.ErrorIs(t, lockErr, etcdsync.ErrSessionClosed)
			require.Less(t, lockTook, cleanupBound+time.Second, "the Lock")
			if end == "Orphan" {
				require.NoError(t, resultWithin(t, ended, time.Second, "Orphan"))
				rig.proxy.Blackhole(false)
				closed := time.Now()
				require.NoError(t, s.Close())
				require.Less(t, time.Since(closed), 100*time.Millisecond, "Close after Orphan")
			} else {
				notYet(t, ended, 0, "Close on a silent link")
				rig.proxy.Blackhole(false)
				require.NoError(t, resultWithin(t, ended, s.TTL(), "Close once the link is back"))
				t.Logf("Close returned %v after it began", time.Since(start).Round(time.Millisecond))
				rig.ow.settleTo(t, 0, 5*time.Second, "after the Close")
				waitCount(t, admin, name+"/", testTimeout, func(have int) bool { return have == 1 })
			}
			require.NoError(t, holder.Unlock(ctx))
		})
	}
}

// A session with a lock delay that ended for lost contact while one of its
// waits opened a watch on the silent link: Close has nothing to revoke
// (the delay stands) and nothing it can reach, so it returns at once, as
// it did before waits' streams were closed by the session; the wait's
// stream is the client's to close.
func TestCloseAfterLostContactWithALockDelayReturnsAtOnce(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin, ctx := c.Client(t), ctxT(t)
	const name = "close-delay-silent"
	holder := heldMutex(t, ctx, admin, name)
	rig := newSilentRig(t, c)
	s := session(t, rig.cli, etcdsync.WithTTL(3*time.Second), etcdsync.WithLockDelay(2*time.Second))
	rig.sw.arm("", 0, 1, 0)
	res := async(func() error { return etcdsync.NewMutex(s, name).Lock(ctx) })
	within(t, rig.sw.silenced, testTimeout, "the link going silent at the first Watch")
	require.ErrorIs(t, resultWithin(t, res, testTimeout, "the Lock"), etcdsync.ErrSessionExpired)
	within(t, s.Done(), testTimeout, "the session's end for lost contact")
	start := time.Now()
	closed := async(s.Close)
	err := resultWithin(t, closed, testTimeout, "Close")
	took := time.Since(start)
	t.Logf("Close returned after %v: %v", took.Round(time.Millisecond), err)
	rig.proxy.Blackhole(false)
	require.NoError(t, err)
	require.Less(t, took, 500*time.Millisecond, "Close with nothing to revoke")
	require.NoError(t, holder.Unlock(ctx))
}

// Close or Orphan racing with waits of the session that start, enter their
// watches and end all around it: every call returns (ErrSessionClosed once
// the session ended), Close and Orphan return; after Close no key of the
// session and no Watch stream of a wait is left (Orphan stops the closing
// of waits' streams: its sessions are on a client of their own).
func TestSessionEndRacingWithWaitsEndsThemAll(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin, ctx := c.Client(t), ctxT(t)
	ow := &openWatches{}
	cli := etcdtest.NewClient(t, c.Endpoints(), ow.dial())
	orphans := c.Client(t)
	const names = 6
	for i := range names {
		heldMutex(t, ctx, admin, fmt.Sprintf("end-race/%d", i))
	}
	for round := range 8 {
		on := cli
		if round%2 == 1 {
			on = orphans
		}
		s := session(t, on)
		var wg sync.WaitGroup
		errs := make(chan error, 64)
		for i := range names {
			wg.Go(func() {
				m := etcdsync.NewMutex(s, fmt.Sprintf("end-race/%d", i))
				for j := 0; ; j++ {
					lctx, cancel := context.WithTimeout(ctx, time.Duration(1+(i*7+j*3)%15)*time.Millisecond)
					err := m.Lock(lctx)
					cancel()
					switch {
					case errors.Is(err, etcdsync.ErrSessionClosed):
						return
					case errors.Is(err, context.DeadlineExceeded):
					default:
						errs <- fmt.Errorf("round %d name %d: %v", round, i, err)
						return
					}
				}
			})
		}
		time.Sleep(time.Duration(5+round*7) * time.Millisecond) // the moment of the end, among the waits
		ended := make(chan struct{})
		go func() {
			defer close(ended)
			if round%2 == 0 {
				_ = s.Close()
			} else {
				s.Orphan()
			}
		}()
		within(t, ended, testTimeout, "the session's end")
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		within(t, done, testTimeout, "every Lock")
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		if round%2 == 0 {
			for _, k := range keys(t, admin, "end-race/") {
				require.NotContains(t, k, fmt.Sprintf("%x", int64(s.Lease())), "round %d: a key of the closed session", round)
			}
		}
	}
	ow.settleTo(t, 0, 5*time.Second, "after the sessions' ends")
}
