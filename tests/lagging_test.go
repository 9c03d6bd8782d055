package tests

// Lagging followers, late replays and late-applied requests: a waiter
// served by a member behind the others neither holds early nor stays stuck;
// writes applied late never make a second holder; events reordered across
// streams do not confuse a wait.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// A waiter whose acquire is served by an up-to-date member but whose
// watches land on a follower lagging behind its read gets replayed deletes of
// older incarnations of the keys it watches (the same sessions unlock and
// lock again). Neither the predecessor's old delete (two holders: Invariant
// "Exclusion") nor its own key's old delete (a spurious ErrSessionExpired)
// may count.
func TestWaiterIgnoresLaggingFollowerReplays(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	viaF := etcdtest.Conn(t, f.Endpoint())
	created := make(chan struct{}, 16)
	a := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()})), "lag")
	b := etcdsync.NewMutex(session(t, etcdtest.NewClient(t, []string{u.Endpoint()}, faults.WatchVia(viaF, created))), "lag")
	cut := func() { require.NoError(t, c.CutPeers(f)) }
	// b queues behind a while f lags; f heals and replays what it missed to
	// b's watches; b must still wait for a's real release.
	queueBehindThenHeal := func(trial int, what string) {
		require.Less(t, f.Rev(), a.Rev(), "f does not lag")
		errc := async(func() error { return b.Lock(ctx) })
		within(t, created, testTimeout, "b's watch of the prefix created on f")
		require.NoError(t, c.HealPeers(f))
		faults.CaughtUp(t, f, a.Rev())
		notYet(t, errc, 500*time.Millisecond, fmt.Sprintf("trial %d: b's Lock while a holds (%s counted)", trial, what))
		require.NoError(t, a.Unlock(ctx))
		require.NoError(t, resultWithin(t, errc, testTimeout, "b's Lock after a's release"))
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

// A reader whose watch stream is served by a follower cut off from its
// peers (lagging): its nearest writer withdraws, and (second case) the
// older writer releases too, while the follower lags. After the heal the
// reader must not hold while W1 holds, and must hold once W1 is gone.
func TestExactReaderWaitsThroughLaggingFollower(t *testing.T) {
	t.Parallel()
	etcdtest.SkipClusterInShort(t, 3)
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
			w1, r, rgot := readerBehindWithdrawnWriter(t, ctx, c, name, f, unary, 64)
			if tc.releaseW1 {
				require.NoError(t, w1.Unlock(ctx))
			}
			time.Sleep(300 * time.Millisecond) // the fault's duration (below the election timeout)
			require.NoError(t, c.HealPeers(f))
			if tc.releaseW1 {
				require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after both writers went, follower healed"))
			} else {
				notYet(t, rgot, 700*time.Millisecond, "reader while W1 holds (after W2 withdrew behind a lagging follower)")
				require.NoError(t, w1.Unlock(ctx))
				require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1"))
			}
			require.NoError(t, r.RUnlock(ctx))
			waitCount(t, admin, name+"/", 5*time.Second, func(n int) bool { return n == 0 })
		})
	}
}

// readerBehindWithdrawnWriter sets up both lagging-follower tests: W1
// holds and W2 waits on name (their calls go to the leader, so that the cut
// follower's proposals do not block them); a reader R waits with its watch
// stream on follower f (its unary calls to member unary, or balanced with
// -1; created sizes its watch counter); then f is cut off from its peers
// and W2 gives up. It returns W1, R and R's RLock result.
func readerBehindWithdrawnWriter(t *testing.T, ctx context.Context, c *etcdtest.Cluster, name string, f *etcdtest.Member, unary, created int) (w1, r *etcdsync.RWMutex, rgot <-chan error) {
	t.Helper()
	fi := slices.Index(c.Members(), f)
	li := slices.Index(c.Members(), c.Leader())
	require.GreaterOrEqual(t, li, 0)
	cnt := counter{created: make(chan struct{}, created)}
	cli := faults.RoutedClient(t, c, fi, unary, cnt.dial()...)
	wcli := etcdtest.NewClient(t, []string{c.Member(li).Endpoint()})
	w2ctx, w2cancel := context.WithCancel(ctx)
	defer w2cancel()
	w1, _, w2got := writerAndWaiter(t, ctx, w2ctx, wcli, name)
	r = etcdsync.NewRWMutex(session(t, cli, etcdsync.WithTTL(10*time.Second)), name)
	rgot = async(func() error { return r.RLock(ctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "reader's watches on the follower")
	require.NoError(t, c.CutPeers(f))
	w2cancel()
	require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2 cancelled"), context.Canceled)
	return w1, r, rgot
}

// Same, with a cut longer than the election timeout: the follower loses
// its leader, the reader's stream (WithRequireLeader) breaks again and
// again, and the reader must neither hold early nor stay stuck.
func TestExactReaderWaitsThroughLeaderlessFollower(t *testing.T) {
	t.Parallel()
	etcdtest.SkipClusterInShort(t, 3)
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx := ctxT(t)
	name := "r12blost"
	f := c.Follower()
	require.NotNil(t, f)
	li := slices.Index(c.Members(), c.Leader())
	w1, r, rgot := readerBehindWithdrawnWriter(t, ctx, c, name, f, li, 256)
	notYet(t, rgot, 2*time.Second, "reader while W1 holds (follower cut)")
	require.NoError(t, c.HealPeers(f))
	notYet(t, rgot, time.Second, "reader while W1 holds (healed)")
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1"))
	require.NoError(t, r.RUnlock(ctx))
}

// lateTxns holds back the Txns that put a chosen value: the caller's call
// fails when its ctx ends, and the request is sent, as it was, only when
// the test lets it go (as a server that applies a request late would).
type lateTxns struct {
	mu     sync.Mutex
	value  string // the put value to hold back; "" none
	held   []func() error
	caught chan struct{}
}

func newLateTxns() *lateTxns { return &lateTxns{caught: make(chan struct{}, 16)} }

func (l *lateTxns) hold(value string) {
	l.mu.Lock()
	l.value = value
	l.mu.Unlock()
}

func putsValue(req *pb.TxnRequest, value string) bool {
	for _, op := range req.Success {
		if p := op.GetRequestPut(); p != nil && string(p.Value) == value {
			return true
		}
	}
	return false
}

func (l *lateTxns) dial() grpc.DialOption {
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		treq, ok := req.(*pb.TxnRequest)
		l.mu.Lock()
		catch := ok && l.value != "" && putsValue(treq, l.value)
		if catch {
			l.value = ""
			l.held = append(l.held, func() error {
				return invoker(context.Background(), method, req, &pb.TxnResponse{}, cc, opts...)
			})
		}
		l.mu.Unlock()
		if !catch {
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		l.caught <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	})
}

// release sends the held requests now, in order.
func (l *lateTxns) release(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	held := l.held
	l.held = nil
	l.mu.Unlock()
	require.NotEmpty(t, held, "no request was held back")
	for _, send := range held {
		require.NoError(t, send())
	}
}

func lateTxnClient(t *testing.T, c *etcdtest.Cluster) (*clientv3.Client, *lateTxns) {
	l := newLateTxns()
	return c.Client(t, l.dial()), l
}

func valueOf(t *testing.T, cli *clientv3.Client, key string) (string, bool) {
	t.Helper()
	resp, err := cli.Get(ctxT(t), key)
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return "", false
	}
	return string(resp.Kvs[0].Value), true
}

// proclaimedLate makes a leader of name (value v0) whose Proclaim of v1
// failed on the client (its ctx ended) while the request is held back: late
// sends it on when the test says. It returns the leader, an admin client,
// late and a test context.
func proclaimedLate(t *testing.T, name string) (*etcdsync.Election, *clientv3.Client, *lateTxns, context.Context) {
	t.Helper()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	ctx := ctxT(t)
	e := etcdsync.NewElection(session(t, cli), name)
	require.NoError(t, e.Campaign(ctx, "v0"))
	late.hold("v1")
	pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	require.ErrorIs(t, e.Proclaim(pctx, "v1"), context.DeadlineExceeded)
	return e, c.Client(t), late, ctx
}

// A Proclaim that failed on the client and lands after a newer one writes
// nothing: the newer value stays.
func TestProclaimAppliedLateAfterNewerWritesNothing(t *testing.T) {
	t.Parallel()
	e, admin, late, ctx := proclaimedLate(t, "late-proclaim")
	require.NoError(t, e.Proclaim(ctx, "v2"))
	late.release(t)
	v, ok := valueOf(t, admin, e.Key())
	require.True(t, ok)
	require.Equal(t, "v2", v, "the late Proclaim overwrote the newer one")
	require.NoError(t, e.Proclaim(ctx, "v3"), "the term goes on")
	v, _ = valueOf(t, admin, e.Key())
	require.Equal(t, "v3", v)
}

// A Proclaim that failed on the client and lands before the next one: the
// next one still writes its value over it.
func TestProclaimAfterLateOneLandedWins(t *testing.T) {
	t.Parallel()
	e, admin, late, ctx := proclaimedLate(t, "late-proclaim-first")
	late.release(t)
	v, _ := valueOf(t, admin, e.Key())
	require.Equal(t, "v1", v, "the late one landed")
	require.NoError(t, e.Proclaim(ctx, "v2"))
	v, _ = valueOf(t, admin, e.Key())
	require.Equal(t, "v2", v)
	resp, err := admin.Get(ctx, e.Key())
	require.NoError(t, err)
	require.Equal(t, e.Rev(), resp.Kvs[0].CreateRevision)
}

// A late Proclaim of a term that was resigned, and of a term after which the
// same session campaigned again (the same key, a new create revision),
// writes nothing: it never creates the key, nor sets the new term's value.
func TestProclaimAppliedLateAcrossTermsWritesNothing(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "late-proclaim-terms")
	require.NoError(t, e.Campaign(ctx, "t1"))
	late.hold("stale")
	pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	require.Error(t, e.Proclaim(pctx, "stale"))
	cancel()
	require.NoError(t, e.Resign(ctx))
	late.release(t)
	_, ok := valueOf(t, admin, keyOf("late-proclaim-terms", s))
	require.False(t, ok, "a late Proclaim recreated a resigned key")

	require.NoError(t, e.Campaign(ctx, "t2"))
	late.hold("stale2")
	pctx, cancel = context.WithTimeout(ctx, 200*time.Millisecond)
	require.Error(t, e.Proclaim(pctx, "stale2"))
	cancel()
	require.NoError(t, e.Resign(ctx))
	f := etcdsync.NewElection(s, "late-proclaim-terms") // another value of the session, same key
	require.NoError(t, f.Campaign(ctx, "t3"))
	late.release(t)
	v, _ := valueOf(t, admin, f.Key())
	require.Equal(t, "t3", v, "a late Proclaim of the last term wrote over the new one")
	require.NoError(t, f.Proclaim(ctx, "t4"))
	require.ErrorIs(t, e.Proclaim(ctx, "x"), etcdsync.ErrElectionNotLeader)
}

// Proclaims from many goroutines through two handles of one term
// (ResumeElection): each returns nil, the key's value is the one of the
// Proclaim that returned last, and the term is intact.
func TestConcurrentProclaimsThroughTwoHandles(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e1 := etcdsync.NewElection(s, "proclaim-many")
	require.NoError(t, e1.Campaign(ctx, "start"))
	e2 := etcdsync.ResumeElection(s, "proclaim-many", e1.Key(), e1.Rev())
	require.NoError(t, e2.Err())
	var mu sync.Mutex
	var lastVal string
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			e := e1
			if g%2 == 1 {
				e = e2
			}
			for i := range 20 {
				v := fmt.Sprintf("g%d-%d", g, i)
				// Lock around the call: the value written last is the one
				// whose Proclaim returned last under mu.
				mu.Lock()
				err := e.Proclaim(ctx, v)
				if err == nil {
					lastVal = v
				}
				mu.Unlock()
				if err != nil {
					t.Errorf("Proclaim %s: %v", v, err)
					return
				}
			}
		})
	}
	wg.Wait()
	v, _ := valueOf(t, cli, e1.Key())
	require.Equal(t, lastVal, v)
	require.Equal(t, e1.Rev(), e2.Rev())
	require.NoError(t, e1.Check())
	require.NoError(t, e2.Check())

	// Unsynchronised, racing a Resign: every Proclaim returns nil or
	// ErrElectionNotLeader, and none recreates the key.
	for g := range 6 {
		wg.Go(func() {
			e := e1
			if g%2 == 1 {
				e = e2
			}
			for i := range 20 {
				if err := e.Proclaim(ctx, fmt.Sprintf("r%d-%d", g, i)); err != nil && !errors.Is(err, etcdsync.ErrElectionNotLeader) {
					t.Errorf("Proclaim: %v", err)
				}
			}
		})
	}
	time.Sleep(5 * time.Millisecond)
	require.NoError(t, e2.Resign(ctx))
	wg.Wait()
	require.Empty(t, keys(t, cli, "proclaim-many/"))
}

// A TryCampaign whose create the server applies after the caller gave up
// leaves no key once the session learns of it (the session sweeps it);
// the next candidate leads.
func TestTryCampaignCreateAppliedLateLeavesNoKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli, late := lateTxnClient(t, c)
	admin := c.Client(t)
	ctx := ctxT(t)
	s := session(t, cli)
	e := etcdsync.NewElection(s, "late-try")
	late.hold("try")
	tctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	err := e.TryCampaign(tctx, "try")
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Zero(t, e.Rev())
	late.release(t)
	waitNoKeys(t, admin, "late-try/")
	b := etcdsync.NewElection(session(t, admin), "late-try")
	require.NoError(t, b.TryCampaign(ctx, "b"), "nobody leads")
	require.ErrorIs(t, e.Check(), etcdsync.ErrNotHeld, "not leading")
	require.Equal(t, "b", leaderValue(t, b))
}

// semLock is a Semaphore's one-permit hold as a lock.
type semLock struct{ *etcdsync.Semaphore }

func (l semLock) Lock(ctx context.Context) error { return l.Acquire(ctx, 1) }

// TestTurnAfterEveryDeleteSeen: a waiter with two keys ahead watches the
// whole prefix (it lists and watches all it waits for). The newer goes
// first, then the older. The hold begins at the later delete, and Header
// says so: never at the earlier one, while the older key still existed.
// Mutex (the newer key a waiter that gives up) and RWMutex (a writer behind
// two readers); and a Semaphore, where a hold from the earlier delete would
// make three permits of two. (When a waiter watched each key on a watch of
// its own, the server could deliver the older's delete first: the rows
// still run through faults.LateClient, which swaps the deletes of two
// watches of a stream, and a waiter that went back to one watch per key
// would be caught by it.)
func TestTurnAfterEveryDeleteSeen(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	type lock interface {
		Lock(context.Context) error
		Header() *pb.ResponseHeader
	}
	cases := []struct {
		name string
		// ahead makes the two keys ahead (older first) and returns the
		// calls that delete them.
		ahead  func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (older, newer func())
		waiter func(s *etcdsync.Session, name string) lock
		// early, late: the watches whose deletes the stream swaps, by the
		// IDs the server gives them (a waiter that watched its own key and
		// each key ahead created them one at a time: watch 0 its own key,
		// 1 up the keys ahead, oldest first); watches: how many the waiter
		// opens (one, of the prefix).
		early, late, watches int64
	}{
		{name: "mutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			m1, m2 := etcdsync.NewMutex(s1, name), etcdsync.NewMutex(s2, name)
			require.NoError(t, m1.Lock(ctx))
			wctx, cancel := context.WithCancel(ctx)
			gaveUp := async(func() error { return m2.Lock(wctx) })
			waitKeys(t, admin, name+"/", 2)
			return func() { require.NoError(t, m1.Unlock(ctx)) },
				func() { cancel(); require.ErrorIs(t, <-gaveUp, context.Canceled) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewMutex(s, name) }, early: 1, late: 2, watches: 1},
		{name: "rwmutex", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			r1, r2 := etcdsync.NewRWMutex(s1, name), etcdsync.NewRWMutex(s2, name)
			require.NoError(t, r1.RLock(ctx))
			require.NoError(t, r2.RLock(ctx))
			return func() { require.NoError(t, r1.RUnlock(ctx)) }, func() { require.NoError(t, r2.RUnlock(ctx)) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return etcdsync.NewRWMutex(s, name) }, early: 1, late: 2, watches: 1},
		// Two permits: A and B hold one each, C waits for one; the waiter
		// for one watches A, B and C. B goes (C holds from then), then C:
		// the waiter's turn is C's delete, which the stream delivers first.
		// A hold from B's delete would make three permits of two.
		{name: "semaphore", ahead: func(t *testing.T, ctx context.Context, s1, s2 *etcdsync.Session, name string) (func(), func()) {
			a := etcdsync.NewSemaphore(s1, name, 2)
			b := etcdsync.NewSemaphore(s2, name, 2)
			c := etcdsync.NewSemaphore(session(t, admin), name, 2)
			require.NoError(t, a.Acquire(ctx, 1))
			require.NoError(t, b.Acquire(ctx, 1))
			got := async(func() error { return c.Acquire(ctx, 1) })
			waitKeys(t, admin, name+"/", 3)
			return func() { require.NoError(t, <-got); require.NoError(t, c.Release(ctx)) },
				func() { require.NoError(t, b.Release(ctx)) }
		}, waiter: func(s *etcdsync.Session, name string) lock { return semLock{etcdsync.NewSemaphore(s, name, 2)} }, early: 1, late: 2, watches: 1},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			ctx := ctxT(t)
			name := "reorder/" + tc.name
			created := make(chan int64, 16)
			cli, arm := faults.LateClient(t, c.Endpoints(), tc.early, tc.late, created)
			older, newer := tc.ahead(t, ctx, session(t, admin), session(t, admin), name)
			w := tc.waiter(session(t, cli), name)
			arm()
			locked := async(func() error { return w.Lock(ctx) })
			awaitCreated(t, created, int(tc.watches), testTimeout, "the waiter's watches")
			newer()
			older()
			resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
			require.NoError(t, err)
			last := resp.Header.Revision // the older key's delete
			require.NoError(t, <-locked)
			require.GreaterOrEqual(t, w.Header().Revision, last, "the hold began before the older key's delete")
		})
	}
}

// TestTurnAfterLaggingReplay: the waiter's only endpoint is a follower cut
// off from its peers while the newer key ahead and then the older go; once
// healed, it replays both deletes, the older's first. The waiter does not
// hold while its member lags, and its hold begins at the older's delete.
func TestTurnAfterLaggingReplay(t *testing.T) {
	t.Parallel()
	etcdtest.SkipClusterInShort(t, 3)
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx := ctxT(t)
	f := c.Follower()
	require.NotNil(t, f)
	up := c.Members()[(slices.Index(c.Members(), f)+1)%3]
	admin := etcdtest.NewClient(t, []string{up.Endpoint()})
	name := "reorder/lag"
	created := make(chan int64, 16)
	cli, arm := faults.LateClient(t, []string{f.Endpoint()}, 1, 2, created)
	m1, m2 := etcdsync.NewMutex(session(t, admin), name), etcdsync.NewMutex(session(t, admin), name)
	require.NoError(t, m1.Lock(ctx))
	wctx, cancel := context.WithCancel(ctx)
	gaveUp := async(func() error { return m2.Lock(wctx) })
	waitKeys(t, admin, name+"/", 2)
	w := etcdsync.NewMutex(session(t, cli), name)
	arm()
	locked := async(func() error { return w.Lock(ctx) })
	awaitCreated(t, created, 1, testTimeout, "the waiter's watch") // of the prefix
	require.NoError(t, c.CutPeers(f))
	t.Cleanup(func() { c.HealPeers(f) })
	cancel()
	require.ErrorIs(t, <-gaveUp, context.Canceled)
	require.NoError(t, m1.Unlock(ctx))
	resp, err := admin.Get(ctx, name+"/", clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	last := resp.Header.Revision // the older key's delete
	notYet(t, locked, 200*time.Millisecond, "the waiter while its member lagged")
	require.NoError(t, c.HealPeers(f))
	require.NoError(t, <-locked)
	require.GreaterOrEqual(t, w.Header().Revision, last, "the hold began before the older key's delete")
}

// A waiter's prefix watch is served by a follower f cut off from its peers
// (its Created revision below the waiter's read, which u served). While f
// lags, the waiter's own key is deleted, then (or before) the holder's; f
// heals and replays both. Own key first: ErrSessionExpired, never the
// turn. Holder first: the turn is legitimate (the key lived at the turn's
// revision) but Done must close. The waiter behind both must hold.
func TestLaggingPrefixWatchSeesOwnKeyAndHolderInOrder(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.Conn(t, f.Endpoint())
	for round, ownFirst := range []bool{true, false, true, false} {
		name := fmt.Sprintf("lagown%d", round)
		h := heldMutex(t, ctx, admin, name)
		created := make(chan struct{}, 16)
		cli := etcdtest.NewClient(t, []string{u.Endpoint()}, faults.WatchVia(viaF, created))
		s1 := session(t, cli, etcdsync.WithTTL(30*time.Second))
		w1 := etcdsync.NewMutex(s1, name)
		require.NoError(t, c.CutPeers(f))
		g1 := async(func() error { return w1.Lock(ctx) })
		within(t, created, testTimeout, "w1's prefix watch created on f")
		waitKeys(t, admin, name+"/", 2)
		w2 := etcdsync.NewMutex(session(t, admin), name)
		g2 := async(func() error { return w2.Lock(ctx) })
		waitKeys(t, admin, name+"/", 3)
		del := []string{keyOf(name, s1), h.Key()}
		if !ownFirst {
			del[0], del[1] = del[1], del[0]
		}
		var last int64
		for _, k := range del {
			resp, err := admin.Delete(ctx, k)
			require.NoError(t, err)
			last = resp.Header.Revision
		}
		notYet(t, g1, 200*time.Millisecond, "w1 while f lags")
		require.NoError(t, c.HealPeers(f))
		faults.CaughtUp(t, f, last)
		err := resultWithin(t, g1, testTimeout, "w1 after the heal")
		if ownFirst {
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "round %d: own key deleted before the holder's", round)
		} else if err == nil {
			within(t, w1.Done(), testTimeout, "w1's Done, its key gone after its turn")
		} else {
			require.ErrorIs(t, err, etcdsync.ErrSessionExpired, "round %d", round)
		}
		require.NoError(t, resultWithin(t, g2, testTimeout, "w2 behind both"))
		require.NoError(t, w2.Unlock(ctx))
		waitNoKeys(t, admin, name+"/")
	}
}

// A waiter whose reads go to a follower f that is cut off (lagging: its
// serializable answers are behind, its linearizable ones fail) and whose
// prefix watch is on an up-to-date member, under a steady write load (so
// the watch's Created revision is above its read): it must not hold while
// the holder holds, and must hold once the holder went and f healed.
func TestWaiterReadingALaggingFollowerWaitsForItsTurn(t *testing.T) {
	t.Parallel()
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	name := "lagread"
	h := heldMutex(t, ctx, admin, name)
	via := &faults.UnaryVia{Conn: etcdtest.Conn(t, f.Endpoint())}
	cli := etcdtest.NewClient(t, []string{u.Endpoint()}, via.Dial())
	s := session(t, cli, etcdsync.WithTTL(30*time.Second))
	w := etcdsync.NewMutex(s, name)
	lctx, lcancel := context.WithCancel(ctx)
	load := doneAsync(t, "load", func() error {
		for i := 0; lctx.Err() == nil; i++ {
			if _, err := admin.Put(lctx, "load", fmt.Sprint(i)); err != nil && lctx.Err() == nil {
				return err
			}
			time.Sleep(2 * time.Millisecond)
		}
		return nil
	})
	require.NoError(t, c.CutPeers(f))
	via.Arm("/etcdserverpb.KV/Range", 1000)
	g := async(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, name+"/", 2)
	notYet(t, g, 1500*time.Millisecond, "w while h holds (f cut)")
	require.NoError(t, h.Unlock(ctx))
	require.NoError(t, c.HealPeers(f))
	require.NoError(t, resultWithin(t, g, testTimeout, "w once h went and f healed"))
	lcancel()
	within(t, load, testTimeout, "load")
	resp, err := admin.Get(ctx, w.Key())
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "w holds with its key")
	require.NoError(t, w.Unlock(ctx))
}
