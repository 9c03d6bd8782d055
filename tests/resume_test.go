package tests

// Resumed holds: a restarted process (WithLease) keeps and resumes what its
// previous incarnation held, whatever fails while it resumes.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A restarted process (WithLease) whose first create fails with an RPC error
// keeps the hold it came to resume, and resumes it on the next try; the
// waiter behind never gets the lock meanwhile. Invariant "Exclusion".
func TestResumedHoldSurvivesFailedCreate(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var inj faults.Injector
	cli := c.Client(t, inj.Dial())
	r := restartBehind(t, cli, admin, "resume")
	inj.Arm(faults.TxnMethod, 1)
	err := r.m.Lock(ctx)
	require.Error(t, err)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	r.keptHold(t, ctx, admin, "the failed resume deleted the hold")
}

// restarted is a process that held name at rev and died (Orphan), restarted
// on its lease, with a waiter queued behind the hold.
type restarted struct {
	name   string
	m      *etcdsync.Mutex // the restarted process's, on the adopted lease; not locked yet
	rev    int64           // the hold it comes to resume
	waiter *etcdsync.Mutex
	got    <-chan struct{} // closed when the waiter's Lock returns
}

// restartBehind has a process hold name through cli and die (Orphan), a
// waiter queue behind it through admin, and a restarted process adopt the
// lease (WithLease).
func restartBehind(t *testing.T, cli, admin *clientv3.Client, name string) *restarted {
	t.Helper()
	ctx := ctxT(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m1 := etcdsync.NewMutex(s1, name)
	require.NoError(t, m1.Lock(ctx))
	r := &restarted{name: name, rev: m1.Rev()}
	s1.Orphan()
	r.queueWaiter(t, ctx, admin)
	r.m = etcdsync.NewMutex(session(t, cli, etcdsync.WithLease(s1.Lease())), name)
	return r
}

// queueWaiter queues the waiter, on a session of admin, behind the hold.
func (r *restarted) queueWaiter(t *testing.T, ctx context.Context, admin *clientv3.Client) {
	t.Helper()
	r.waiter = etcdsync.NewMutex(session(t, admin), r.name)
	r.got = lockAsync(t, ctx, r.waiter)
	waitKeys(t, admin, r.name+"/", 2)
}

// keptHold checks that the hold survived a failed resume (else why): the
// waiter does not get the lock, both keys stay, and the next Lock resumes
// the hold at its revision; then it hands the lock over to the waiter.
func (r *restarted) keptHold(t *testing.T, ctx context.Context, admin *clientv3.Client, why string) {
	t.Helper()
	notWithin(t, r.got, 500*time.Millisecond, "the waiter acquired: "+why)
	require.Len(t, keys(t, admin, r.name+"/"), 2)
	require.NoError(t, r.m.Lock(ctx))
	require.Equal(t, r.rev, r.m.Rev(), "the resumed hold keeps its revision")
	handOver(t, ctx, r.m, r.waiter, r.got)
}

// A restarted process (WithLease) whose Lock's context ends while the
// resuming Txn is in flight keeps the hold it came to resume: the Txn reports
// "the key exists with our lease" (a resumed hold, created before this call),
// and the acquire that then sees its context ended must not withdraw the key
// at its revision. TestResumedHoldSurvivesFailedCreate covers the RPC-error
// path.
func TestResumedHoldSurvivesCancelledResume(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var sc faults.Script
	cli := c.Client(t, sc.Dial())
	r := restartBehind(t, cli, admin, "r8-resume")
	lctx, cancel := context.WithCancel(ctx)
	// The caller gives up while the resuming Txn is on its way.
	sc.Arm(faults.TxnMethod, func(c faults.Call) error { cancel(); return c.Invoke() })
	err := r.m.Lock(lctx)
	require.ErrorIs(t, err, context.Canceled)
	r.keptHold(t, ctx, admin, "the cancelled resume deleted the hold it came to resume")
}

// The same through Campaign: a restarted process campaigns with a new value
// on the leadership it resumes; the Proclaim of the new value fails with an
// RPC error (one Unavailable, not sent), and the leadership created before
// this call must stay: the candidate behind must not lead.
func TestResumedLeadershipSurvivesFailedProclaim(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var sc faults.Script
	cli := c.Client(t, sc.Dial())
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	e1 := etcdsync.NewElection(s1, "r8-elect")
	require.NoError(t, e1.Campaign(ctx, "old"))
	s1.Orphan()

	other := etcdsync.NewElection(session(t, admin), "r8-elect")
	elected := campaignAsync(ctx, other, "other")
	waitKeys(t, admin, "r8-elect/", 2)

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	e2 := etcdsync.NewElection(s2, "r8-elect")
	sc.Arm(faults.TxnMethod, faults.Pass, faults.Fail) // the resuming Txn goes, the Proclaim fails unsent
	err = e2.Campaign(ctx, "new")
	require.Error(t, err)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	notYet(t, elected, 500*time.Millisecond, "the other candidate (elected: the failed Proclaim deleted the resumed leadership)")
	require.Len(t, keys(t, admin, "r8-elect/"), 2)
	require.NoError(t, e2.Campaign(ctx, "new"))
	require.NoError(t, e2.Resign(ctx))
	require.NoError(t, resultWithin(t, elected, testTimeout, "the other candidate after the Resign"))
	require.NoError(t, other.Resign(ctx))
}

// A resumed hold survives a failed create also when the lease was adopted
// through a lagging member. The startRev floor ("never withdraw a key created
// before the session started") comes from the header of the TimeToLive that
// adopts the lease; etcd fills that header with the serving member's own
// revision, and a follower answers TimeToLive by forwarding it to the leader:
// a follower lagging behind the resumed key's create gives a floor below it.
// A resume whose create then fails with an RPC error must still not withdraw
// the resumed hold (TestResumedHoldSurvivesFailedCreate).
func TestResumedHoldSurvivesAdoptionViaLaggingMember(t *testing.T) {
	t.Parallel() // slow and independent (own etcd): see TestFaults
	// "via-u" is the control: the same steps with TimeToLive served by an
	// up-to-date member pass.
	for _, via := range []string{"via-lagging-f", "via-u"} {
		t.Run(via, func(t *testing.T) { resumeAdoptedViaLaggingMember(t, via == "via-lagging-f") })
	}
}

func resumeAdoptedViaLaggingMember(t *testing.T, lagging bool) {
	c, f, u := faults.PeerRig(t)
	ctx := ctxT(t)
	admin := etcdtest.NewClient(t, []string{u.Endpoint()})
	viaF := etcdtest.Conn(t, f.Endpoint())
	var sc faults.Script
	var inj faults.Injector
	cli := etcdtest.NewClient(t, []string{u.Endpoint()}, sc.Dial(), inj.Dial())
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	r := &restarted{name: "r8-floor"}
	m1 := etcdsync.NewMutex(s1, r.name)

	require.NoError(t, c.CutPeers(f))
	healed := false
	defer func() {
		if !healed {
			c.HealPeers(f)
		}
	}()
	require.NoError(t, m1.Lock(ctx))
	r.rev = m1.Rev()
	s1.Orphan()
	require.Less(t, f.Rev(), r.rev, "f does not lag")
	// The restarted process adopts its lease; its TimeToLive is served by f.
	if lagging {
		sc.Arm("/etcdserverpb.Lease/LeaseTimeToLive", faults.Via(viaF))
	}
	start := time.Now()
	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	t.Logf("adopted in %v", time.Since(start))
	require.NoError(t, c.HealPeers(f))
	healed = true
	faults.CaughtUp(t, f, r.rev)

	r.queueWaiter(t, ctx, admin)
	r.m = etcdsync.NewMutex(s2, r.name)
	inj.Arm(faults.TxnMethod, 1)
	err = r.m.Lock(ctx)
	require.Error(t, err)
	require.Equal(t, codes.Unavailable, status.Code(err), "%v", err)
	r.keptHold(t, ctx, admin, "the failed resume deleted the hold (stale startRev)")
}

// A restarted process (WithLease) whose previous incarnation held a read:
// TryRLock must resume that key (its create revision is the fencing token)
// as RLock does, not overwrite it and record the put's revision; else the
// RUnlock's fenced delete fails and the read key stays, blocking every
// writer for as long as the session lives.
func TestTryRLockResumesReadKey(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	rw1 := etcdsync.NewRWMutex(s1, "r12tryres")
	require.NoError(t, rw1.RLock(ctx))
	rev := rw1.Rev()
	s1.Orphan()

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	rw2 := etcdsync.NewRWMutex(s2, "r12tryres")
	require.NoError(t, rw2.TryRLock(ctx))
	if rw2.Rev() != rev {
		t.Errorf("TryRLock on the resumed read key: fencing token %d, the key's create revision is %d", rw2.Rev(), rev)
	}
	if _, err := rw2.Do(ctx, clientv3.OpGet("r12tryres-x")); err != nil {
		t.Errorf("Do under the resumed read hold: %v", err)
	}
	if err := rw2.RUnlock(ctx); err != nil {
		t.Errorf("RUnlock: %v", err)
	}
	require.Empty(t, keys(t, cli, "r12tryres/"), "the read key outlives RUnlock (writers wait until the session ends)")
}

// A restarted process (WithLease) whose previous incarnation held 1 of 3
// permits asks for 3: it must not hold 3 while its key says 1 (the others
// then grant themselves 2 more: 5 of 3 permits held).
func TestSemaphoreResumeRefusesMorePermits(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s1, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	require.NoError(t, etcdsync.NewSemaphore(s1, "r12semres", 3).Acquire(ctx, 1))
	s1.Orphan()

	s2 := session(t, cli, etcdsync.WithLease(s1.Lease()))
	sm2 := etcdsync.NewSemaphore(s2, "r12semres", 3)
	actx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := sm2.Acquire(actx, 3); err != nil {
		t.Logf("Acquire(3) on the resumed 1-permit key: %v (refusing is fine)", err)
		return
	}
	other := etcdsync.NewSemaphore(session(t, cli), "r12semres", 3)
	err = other.TryAcquire(ctx, 2)
	if err == nil {
		_ = other.Release(ctx)
	}
	require.ErrorIs(t, err, etcdsync.ErrLocked, "3 of 3 permits held by the resumed hold, and 2 more granted")
	require.NoError(t, sm2.Release(ctx))
}

// A Semaphore resumed (WithLease) with the value its key has keeps working:
// Acquire and TryAcquire of the held key resume it at its revision; a key
// that still waits is resumed and holds in its turn; another n is refused
// and leaves the key alone, after which the same n resumes.
func TestSemaphoreResumesSameValue(t *testing.T) {
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
		got := async(func() error { return sm2.Acquire(ctx, 2) })
		notYet(t, got, 300*time.Millisecond, "resumed waiter while 2 of 3 are held")
		require.NoError(t, h.Release(ctx))
		require.NoError(t, resultWithin(t, got, testTimeout, "resumed waiter"))
		require.Equal(t, resp.Header.Revision, sm2.Rev())
		require.NoError(t, sm2.Release(ctx))
		require.Empty(t, keys(t, admin, name+"/"))
	})
}

// Close after Orphan changes nothing in etcd: the lease and its keys stay
// for the process that adopts them.
func TestCloseAfterOrphanKeepsLease(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
	require.NoError(t, err)
	m := etcdsync.NewMutex(s, "orphan-close")
	require.NoError(t, m.Lock(ctx))
	s.Orphan()
	require.NoError(t, s.Close())
	ttl, err := cli.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.Greater(t, ttl.TTL, int64(0), "Close after Orphan revoked the lease")
	require.Len(t, keys(t, cli, "orphan-close/"), 1)
	_, err = cli.Revoke(ctx, s.Lease())
	require.NoError(t, err)
}
