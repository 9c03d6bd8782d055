package tests

// The fault suite (-tags long): workers take turns on one name of a
// 3-member cluster while a fault strikes (member stops and restarts,
// blackholes, a paused holder), with the workers' code beside it.

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
)

// The fault suite: on a 3-member cluster, K workers each make M guarded
// increments of one counter while a fault strikes, and the run checks that the
// count equals the successful increments, fencing tokens never go back, no
// two holds overlap in revision order, every lost hold's Done fired in time,
// and no key is left.

const (
	faultTTL     = 2 * time.Second
	faultSlack   = 2 * time.Second // the default slack (WithSlack) at faultTTL
	faultWorkers = 3
	faultIncs    = 50 // per worker: 14 faults x 3 x 50 = 2100 guarded increments of Mutex and Election
	faultIncsToo = 40 // per worker for RWMutex writers and Semaphore: 9 faults x 3 x 40 = 1080 each
)

type fault struct {
	name string
	// inject starts the fault against victim (worker 0's proxies and
	// session); heal, if any, ends it after dur.
	inject func(t *testing.T, r *faultRun, victim *faultWorker)
	heal   func(t *testing.T, r *faultRun, victim *faultWorker)
	dur    time.Duration
	// onHold: strike while the victim holds the lock.
	onHold bool
	// pause: the victim freezes while holding (ignores Done) until healed,
	// then writes with the guard it took before, as a stopped process would.
	pause bool
	// kind: the primitive the workers take (Mutex by default).
	kind primKind
	// impatient: the victim gives up waiting after 150 ms and tries again,
	// so that it joins the queue at all moments of the fault.
	impatient bool
}

func TestFaults(t *testing.T) {
	t.Parallel()
	long(t)
	cut := func(_ *testing.T, _ *faultRun, v *faultWorker) { v.blackhole(true) }
	mend := func(_ *testing.T, _ *faultRun, v *faultWorker) { v.blackhole(false) }
	restart := func(t *testing.T, r *faultRun, _ *faultWorker) { require.NoError(t, r.c.Restart(r.stopped)) }
	faults := []fault{
		{name: "follower-restart", dur: time.Second, heal: restart, inject: func(t *testing.T, r *faultRun, _ *faultWorker) {
			r.stopped = r.c.Follower()
			r.c.Stop(r.stopped)
		}},
		{name: "leader-restart", dur: time.Second, heal: restart, inject: func(t *testing.T, r *faultRun, _ *faultWorker) {
			r.stopped = r.c.Leader()
			require.NotNil(t, r.stopped)
			r.c.Stop(r.stopped)
		}},
		{name: "leader-transfer", inject: func(t *testing.T, r *faultRun, _ *faultWorker) {
			require.NoError(t, r.c.TransferLeader(r.ctx))
		}},
		{name: "blackhole-short", onHold: true, dur: faultTTL / 3, inject: cut, heal: mend},
		{name: "blackhole-long", onHold: true, dur: faultTTL + 1500*time.Millisecond, inject: cut, heal: mend},
		{name: "lease-revoked", onHold: true, inject: func(t *testing.T, r *faultRun, v *faultWorker) {
			_, err := r.admin.Revoke(r.ctx, v.lease())
			require.NoError(t, err)
		}},
		// Paused past the lease (the TTL and the default slack): its guard is stale by then.
		{name: "process-pause", onHold: true, pause: true, dur: faultTTL + faultSlack + 1500*time.Millisecond, inject: cut, heal: mend},
		// A follower cut off from its peers (not from clients) for less
		// than an election timeout, again and again while the workers
		// unlock and lock: watches it serves lag behind the workers' reads.
		// Meanwhile the victim's watch streams go to that follower (a client
		// balancing its calls sends some there); the other workers watch,
		// and everyone reads and writes, through another member, which is
		// up to date, so the queue moves on while the follower lags.
		{name: "follower-lag", impatient: true, inject: func(t *testing.T, r *faultRun, v *faultWorker) {
			f := r.c.Follower()
			require.NotNil(t, f)
			i := slices.Index(r.c.Members(), f)
			up := (i + 1) % len(r.c.Members())
			for _, w := range r.workers {
				w.route(up, up)
			}
			v.route(i, up)
			for range 8 {
				require.NoError(t, r.c.CutPeers(f))
				time.Sleep(300 * time.Millisecond) // the fault's duration, not a synchronisation
				require.NoError(t, r.c.HealPeers(f))
				time.Sleep(200 * time.Millisecond)
			}
			for _, w := range r.workers {
				w.route(-1, -1)
			}
		}},
		// An admin deletes the holder's and the waiters' keys in one revision.
		{name: "prefix-delete", onHold: true, inject: func(t *testing.T, r *faultRun, _ *faultWorker) {
			waitKeys(t, r.admin, r.name+"/lock/", faultWorkers)
			time.Sleep(100 * time.Millisecond) // the waiters get into their watches
			_, err := r.admin.Delete(r.ctx, r.name+"/lock/", clientv3.WithPrefix())
			require.NoError(t, err)
		}},
	}
	// The same machinery serves Election, RWMutex and Semaphore: the
	// faults again, campaigning, reading and writing, and holding permits.
	mutexFaults := faults
	for _, f := range []fault{faults[1], faults[4], faults[6], faults[7], faults[8]} {
		f.name, f.kind = "election-"+f.name, kindElection
		faults = append(faults, f)
	}
	for _, k := range []primKind{kindRWMutex, kindSemaphore, kindMultiLock} {
		for _, f := range mutexFaults {
			f.name, f.kind = k.String()+"-"+f.name, k
			faults = append(faults, f)
		}
	}
	// Two runs at a time (go test's -parallel, GOMAXPROCS by default): each
	// has a cluster of its own and mostly waits on its fault, so that the
	// suite keeps go test ./... within its default 10 minutes.
	var (
		mu     sync.Mutex
		report []string
		total  = map[primKind]int{}
	)
	t.Run("runs", func(t *testing.T) {
		for _, f := range faults {
			t.Run(f.name, func(t *testing.T) {
				t.Parallel()
				r := runFault(t, f)
				mu.Lock()
				defer mu.Unlock()
				total[f.kind] += r.incs
				report = append(report, r.String())
			})
		}
	})
	t.Logf("fault | increments | violations | Done lead over server delete (min / median) | orphan keys")
	for _, line := range report {
		t.Log(line)
	}
	t.Logf("guarded increments: mutex and election %d, rwmutex (writers) %d, semaphore %d, multilock %d",
		total[kindMutex]+total[kindElection], total[kindRWMutex], total[kindSemaphore], total[kindMultiLock])
	if !t.Failed() && len(report) == len(faults) {
		require.GreaterOrEqual(t, total[kindMutex]+total[kindElection], 1000)
		require.GreaterOrEqual(t, total[kindRWMutex], 1000)
		require.GreaterOrEqual(t, total[kindSemaphore], 1000)
		require.GreaterOrEqual(t, total[kindMultiLock], 1000)
	}
}

// primKind is the primitive a fault run's workers take.
type primKind int

const (
	kindMutex primKind = iota
	kindElection
	kindRWMutex   // writers weigh faultWorkers, readers 1
	kindSemaphore // faultPermits permits; requests of 1 or 2
	kindMultiLock // NAME/lock and NAME/lock2 at once; the checks watch NAME/lock
)

const faultPermits = 2

func (k primKind) String() string {
	return [...]string{"mutex", "election", "rwmutex", "semaphore", "multilock"}[k]
}

// capacity is the weight of holds that may hold at once (checkHolds).
func (k primKind) capacity() int64 {
	switch k {
	case kindRWMutex:
		return faultWorkers
	case kindSemaphore:
		return faultPermits
	}
	return 1
}

type holdRec struct {
	worker     int
	start, rev int64 // revision at which the hold began; create revision of its key
	weight     int64 // of the hold against the check's capacity (checkHolds)
	lost       bool  // ended otherwise than by our Unlock
	contact    bool  // lost with the session's contact (ErrLostContact)
	doneAt     time.Time
	unlocking  time.Time // when the worker's Unlock began, if it did
}

// recordHold returns the record of the hold p has just taken, and a func that
// completes it once the hold was released or lost: when Done fired, whether
// the hold was lost, and with contact. That func reports false when Done did
// not fire within faultTTL+testTimeout.
func recordHold(worker int, p primitive) (holdRec, func(*holdRec) bool) {
	rec := holdRec{worker: worker, start: p.Header().Revision, rev: p.Rev(), weight: p.weight}
	fired := make(chan time.Time, 1)
	go func(done <-chan struct{}) { <-done; fired <- time.Now() }(p.Done()) // ends with the hold
	return rec, func(rec *holdRec) bool {
		select {
		case rec.doneAt = <-fired:
		case <-time.After(faultTTL + testTimeout):
			return false
		}
		rec.lost = !errors.Is(p.Err(), etcdsync.ErrLockReleased)
		rec.contact = errors.Is(p.Err(), etcdsync.ErrLostContact)
		return true
	}
}

type incRec struct {
	token, commit int64
}

type faultRun struct {
	f     fault
	c     *etcdtest.Cluster
	admin *clientv3.Client
	ctx   context.Context
	name  string

	mu       sync.Mutex
	holds    []holdRec
	incs     []incRec
	log      *deleteLog
	armed    atomic.Bool   // the victim should report its next hold
	holding  chan struct{} // closed when it holds, armed
	injected chan struct{} // closed when the fault has started
	healed   chan struct{} // closed when it is over

	stopped     *etcdtest.Member // by a restart fault
	staleWrites int              // writes by the paused victim that got through
	halfDone    []int64          // revisions at which a reader saw a writer's work half done
	workers     []*faultWorker
}

type deleteRec struct {
	rev  int64
	seen time.Time
}

// deleteLog records, from an admin's watch, every delete under a prefix:
// the deleted key's create revision, the delete's revision and when the
// watch delivered it.
type deleteLog struct {
	mu         sync.Mutex
	deletes    map[int64]deleteRec // create revision -> its delete
	cli        *clientv3.Client
	rev        atomic.Int64 // every event up to it has been recorded
	progressed chan struct{}
	cancel     context.CancelFunc
	stopped    chan struct{}
}

func watchDeletes(ctx context.Context, cli *clientv3.Client, prefix string, from int64) *deleteLog {
	ctx, cancel := context.WithCancel(ctx)
	d := &deleteLog{deletes: make(map[int64]deleteRec), cli: cli, progressed: make(chan struct{}, 1), cancel: cancel, stopped: make(chan struct{})}
	go func() {
		defer close(d.stopped)
		for wr := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithPrevKV(), clientv3.WithRev(from)) {
			now := time.Now()
			d.mu.Lock()
			for _, ev := range wr.Events {
				if ev.Type == clientv3.EventTypeDelete && ev.PrevKv != nil {
					d.deletes[ev.PrevKv.CreateRevision] = deleteRec{rev: ev.Kv.ModRevision, seen: now}
				}
			}
			d.mu.Unlock()
			d.rev.Store(max(d.rev.Load(), wr.Header.Revision))
			select {
			case d.progressed <- struct{}{}:
			default:
			}
		}
	}()
	return d
}

func (d *deleteLog) get(create int64) (deleteRec, bool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	rec, ok := d.deletes[create]
	return rec, ok
}

// stop ends the watch once it has delivered every event up to rev (it may
// be served by another member than the caller's read, or simply be behind).
func (d *deleteLog) stop(t *testing.T, rev int64) {
	t.Helper()
	defer func() {
		d.cancel()
		<-d.stopped
	}()
	caughtUp := time.After(testTimeout)
	for d.rev.Load() < rev {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		err := d.cli.RequestProgress(ctx)
		cancel()
		require.NoError(t, err)
		select {
		case <-d.progressed:
		case <-time.After(100 * time.Millisecond):
		case <-caughtUp:
			t.Fatalf("the admin watch did not reach revision %d", rev)
		}
	}
}

// checkHolds checks holds against the server's deletes of their keys: each
// began before its key was deleted; at no revision do the holds whose key
// existed (from the revision they began to their key's delete) weigh more
// than capacity (a Mutex: weight 1 of 1, so none began before the previous
// one's key was deleted); and a lost hold's Done fired no later than the
// server deleted its key when it lost contact, else within slack (also when
// it lost contact but an admin's delete or revoke took its key, at a
// revision byAdmin reports: the promise is about the server's expiry, and a
// revoke behind a cut link is learnt at the deadline). Holds that
// share a key (read holds of one session) are one hold. It returns the
// violations and, per lost hold, how long Done fired before the delete was
// seen.
func checkHolds(holds []holdRec, log *deleteLog, slack time.Duration, capacity int64, byAdmin func(rev int64) bool) (problems []string, leads []time.Duration) {
	type edge struct {
		rev    int64
		weight int64 // + at a start, - at a delete
		h      holdRec
	}
	var edges []edge
	seen := map[int64]bool{} // key create revisions
	for _, h := range holds {
		del, ok := log.get(h.rev)
		if !ok {
			problems = append(problems, fmt.Sprintf("hold at %d: its key's delete was not seen", h.rev))
			continue
		}
		if del.rev <= h.start {
			problems = append(problems, fmt.Sprintf("hold at %d (worker %d) began at %d, but its key was deleted at %d: granted with no key", h.rev, h.worker, h.start, del.rev))
		}
		if !seen[h.rev] {
			seen[h.rev] = true
			edges = append(edges, edge{h.start, h.weight, h}, edge{del.rev, -h.weight, h})
		}
	}
	// Deletes at a revision come before holds that began at it.
	sort.Slice(edges, func(i, j int) bool {
		if edges[i].rev != edges[j].rev {
			return edges[i].rev < edges[j].rev
		}
		return edges[i].weight < edges[j].weight
	})
	var in int64
	var inside []holdRec
	for _, e := range edges {
		in += e.weight
		if e.weight < 0 {
			inside = slices.DeleteFunc(inside, func(h holdRec) bool { return h.rev == e.h.rev })
			continue
		}
		inside = append(inside, e.h)
		if in > capacity {
			var who []string
			for _, h := range inside {
				who = append(who, fmt.Sprintf("%d (worker %d, weight %d, began %d)", h.rev, h.worker, h.weight, h.start))
			}
			problems = append(problems, fmt.Sprintf("holds overlap at revision %d, weight %d of %d: %s", e.rev, in, capacity, strings.Join(who, ", ")))
		}
	}
	for _, h := range holds {
		del, ok := log.get(h.rev)
		if !ok || !h.lost {
			continue
		}
		lead := del.seen.Sub(h.doneAt)
		leads = append(leads, lead)
		// A delete seen after the worker's Unlock began may be that
		// Unlock's, committed while its reply was lost to the fault: its
		// Done then fires when the session's deadline passes, after it.
		ownRelease := !h.unlocking.IsZero() && h.unlocking.Before(del.seen)
		contact := h.contact && (byAdmin == nil || !byAdmin(del.rev))
		if contact && lead < 0 && !ownRelease {
			problems = append(problems, fmt.Sprintf("hold %d lost contact: Done fired %v after the server deleted its key", h.rev, -lead))
		}
		if !contact && lead < -slack {
			problems = append(problems, fmt.Sprintf("hold %d: Done fired %v after its key was deleted", h.rev, -lead))
		}
	}
	return problems, leads
}

// A hold that lost contact while an admin's revoke or delete took its key
// is judged within the slack, not against the server's expiry: checked as a
// robustness round checks it, with the history's lock held and its byAdmin.
func TestCheckHoldsJudgesAdminDeletesWithinSlack(t *testing.T) {
	t.Parallel()
	at := time.Now()
	log := &deleteLog{deletes: map[int64]deleteRec{10: {rev: 20, seen: at}}}
	lost := []holdRec{{start: 10, rev: 10, weight: 1, lost: true, contact: true, doneAt: at.Add(1500 * time.Millisecond)}}
	problems, _ := checkHolds(lost, log, 2*time.Second, 1, nil)
	require.Len(t, problems, 1, "Done after the delete, with contact and no admin")
	h := &history{admin: map[int64]bool{20: true}}
	judged := make(chan []string, 1)
	go func() {
		h.mu.Lock()
		defer h.mu.Unlock()
		problems, _ := checkHolds(lost, log, 2*time.Second, 1, h.byAdmin)
		judged <- problems
	}()
	select {
	case problems := <-judged:
		require.Empty(t, problems, "the admin's delete, Done within the slack")
	case <-time.After(testTimeout):
		t.Fatal("checkHolds did not return with the history's lock held")
	}
	lost[0].doneAt = at.Add(3 * time.Second)
	h.mu.Lock()
	problems, _ = checkHolds(lost, log, 2*time.Second, 1, h.byAdmin)
	h.mu.Unlock()
	require.Len(t, problems, 1, "the admin's delete, Done past the slack")
}

type faultResult struct {
	name       string
	incs       int
	violations int
	leads      []time.Duration
	orphans    int
}

func (r faultResult) String() string {
	lead := "no lost holds"
	if len(r.leads) > 0 {
		slices.Sort(r.leads)
		lead = fmt.Sprintf("%v / %v (%d lost)", r.leads[0].Round(time.Millisecond), r.leads[len(r.leads)/2].Round(time.Millisecond), len(r.leads))
	}
	return fmt.Sprintf("%s | %d | %d | %s | %d", r.name, r.incs, r.violations, lead, r.orphans)
}

func runFault(t *testing.T, f fault) faultResult {
	c := etcdtest.Start(t, etcdtest.Options{Members: 3, PeerProxies: true})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	r := &faultRun{f: f, c: c, admin: c.Client(t), ctx: ctx, name: "fault/" + f.name,
		holding: make(chan struct{}), injected: make(chan struct{}), healed: make(chan struct{})}
	counter := r.name + "/counter"
	put, err := r.admin.Put(ctx, counter, "0")
	require.NoError(t, err)

	// The admin watches every delete under the lock's name, from the
	// revision of the counter's put.
	r.log = watchDeletes(ctx, r.admin, r.name+"/lock/", put.Header.Revision+1)

	workers := make([]*faultWorker, faultWorkers)
	for i := range workers {
		workers[i] = newFaultWorker(t, c, i)
		workers[i].r = r
	}
	r.workers = workers
	var wg sync.WaitGroup
	progress := make(chan struct{}, faultWorkers*faultIncs)
	for _, w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			w.run(t, progress)
		}()
	}
	// Strike once the workers are busy, then heal.
	for i := 0; i < 10; i++ {
		select {
		case <-progress:
		case <-ctx.Done():
			t.Fatal("no progress before the fault")
		}
	}
	if f.onHold {
		r.armed.Store(true)
		select {
		case <-r.holding:
		case <-ctx.Done():
			t.Fatal("the victim never held")
		}
	}
	f.inject(t, r, workers[0])
	close(r.injected)
	if f.heal != nil {
		time.Sleep(f.dur) // the fault's duration, not a synchronisation
		f.heal(t, r, workers[0])
	}
	close(r.healed)
	wg.Wait()
	for _, w := range workers {
		w.close()
	}

	// Every key goes with its session. The admin's watch may be served by
	// another member than its read, or simply be behind it: before it
	// stops, it must have delivered every event up to the read's revision.
	res := faultResult{name: f.name}
	resp, err := r.admin.Get(ctx, r.name+"/lock/", clientv3.WithPrefix(), clientv3.WithKeysOnly())
	require.NoError(t, err)
	var left []string
	for _, kv := range resp.Kvs {
		left = append(left, string(kv.Key))
	}
	res.orphans = len(left)
	r.log.stop(t, resp.Header.Revision)

	resp, err = r.admin.Get(ctx, counter)
	require.NoError(t, err)
	got, err := strconv.Atoi(string(resp.Kvs[0].Value))
	require.NoError(t, err)
	r.mu.Lock()
	defer r.mu.Unlock()
	res.incs = len(r.incs)
	violate := func(format string, args ...any) {
		res.violations++
		t.Errorf(format, args...)
	}
	if got != len(r.incs) {
		violate("counter %d, but %d guarded increments succeeded", got, len(r.incs))
	}
	sort.Slice(r.incs, func(i, j int) bool { return r.incs[i].commit < r.incs[j].commit })
	for i := 1; i < len(r.incs) && f.kind != kindSemaphore; i++ { // permit holders overlap
		if r.incs[i].token < r.incs[i-1].token {
			violate("fencing token went back: %d after %d", r.incs[i].token, r.incs[i-1].token)
		}
	}
	for _, at := range r.halfDone {
		for _, h := range r.holds {
			if del, ok := r.log.get(h.rev); ok && h.weight == faultWorkers && h.start <= at && at < del.rev {
				violate("a reader saw a writer's work half done at revision %d while the writer (hold %d) held", at, h.rev)
			}
		}
	}
	var problems []string
	problems, res.leads = checkHolds(r.holds, r.log, time.Second, f.kind.capacity(), nil)
	for _, p := range problems {
		violate("%s", p)
	}
	if r.staleWrites > 0 {
		violate("%d writes of a paused holder got through its stale guard", r.staleWrites)
	}
	if res.violations > 0 {
		r.logHistory(t, put.Header.Revision+1)
	}
	if res.orphans > 0 {
		violate("keys left: %v", left)
	}
	return res
}

// logHistory logs every change under the run's prefix from revision from,
// and the holds: what a violation is read against.
func (r *faultRun) logHistory(t *testing.T, from int64) {
	t.Helper()
	ctx, cancel := context.WithTimeout(r.ctx, testTimeout)
	defer cancel()
	now, err := r.admin.Get(ctx, r.name+"/counter")
	if err != nil {
		t.Logf("history: %v", err)
		return
	}
	for wr := range r.admin.Watch(ctx, r.name+"/", clientv3.WithPrefix(), clientv3.WithRev(from), clientv3.WithPrevKV()) {
		for _, ev := range wr.Events {
			kv := ev.Kv
			if ev.Type == clientv3.EventTypeDelete && ev.PrevKv != nil {
				kv = ev.PrevKv
			}
			t.Logf("history: rev %d %s %s (create %d, lease %x) %q", ev.Kv.ModRevision, ev.Type, ev.Kv.Key, kv.CreateRevision, kv.Lease, kv.Value)
		}
		if wr.Err() != nil || wr.Header.Revision >= now.Header.Revision {
			break
		}
	}
	for _, h := range r.holds {
		t.Logf("history: hold %d worker %d weight %d began %d lost %v", h.rev, h.worker, h.weight, h.start, h.lost)
	}
}

const (
	incRole    role = iota // increment the counter
	writeRole              // increment the counter, then copy it to counter/b
	readRole               // read both
	permitRole             // increment the counter if nobody wrote since the read
)

// faultWorker is one client with proxies to every member, so that its
// connection can be cut on its own.
type faultWorker struct {
	id      int
	r       *faultRun // in the fault suite
	proxies []*etcdtest.Proxy
	cli     *clientv3.Client
	members []*grpc.ClientConn // one connection per member, through proxies
	router  faults.Router

	mu sync.Mutex
	s  *etcdsync.Session
}

func newFaultWorker(t *testing.T, c *etcdtest.Cluster, id int) *faultWorker {
	w := &faultWorker{id: id}
	var eps []string
	for _, m := range c.Members() {
		u, err := url.Parse(m.Endpoint())
		require.NoError(t, err)
		p := etcdtest.NewProxy(t, u.Host)
		w.proxies = append(w.proxies, p)
		eps = append(eps, p.Endpoint())
	}
	// Its watch streams and unary calls go where route says, if anywhere:
	// through this worker's own proxy to one member.
	w.cli = etcdtest.NewClient(t, eps, w.router.Dial()...)
	for _, p := range w.proxies {
		w.members = append(w.members, etcdtest.Conn(t, p.Endpoint()))
	}
	return w
}

// route sends this worker's watch streams to member watch and its unary
// calls to member unary, or (-1) lets them be balanced again.
func (w *faultWorker) route(watch, unary int) {
	conn := func(i int) *grpc.ClientConn {
		if i < 0 {
			return nil
		}
		return w.members[i]
	}
	w.router.Route(conn(watch), conn(unary))
}

func (w *faultWorker) blackhole(on bool) {
	for _, p := range w.proxies {
		p.Blackhole(on)
	}
}

// latency delays every reply to this worker by d.
func (w *faultWorker) latency(d time.Duration) {
	for _, p := range w.proxies {
		p.SetLatency(d)
	}
}

// lease returns the current session's lease, 0 if none.
func (w *faultWorker) lease() clientv3.LeaseID {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.s == nil {
		return 0
	}
	return w.s.Lease()
}

func (w *faultWorker) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.s != nil {
		w.s.Close()
	}
}

// session returns a live session, replacing an ended one.
func (w *faultWorker) session(ctx context.Context) (*etcdsync.Session, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.s != nil && w.s.Err() == nil {
		return w.s, nil
	}
	if w.s != nil {
		w.s.Close()
	}
	// Without WithContext, NewSession is bounded by the TTL.
	s, err := etcdsync.NewSession(w.cli, etcdsync.WithTTL(faultTTL))
	if err != nil {
		return nil, err
	}
	w.s = s
	return s, nil
}

func (w *faultWorker) run(t *testing.T, progress chan<- struct{}) {
	r := w.r
	counter := r.name + "/counter"
	incs := faultIncs
	if r.f.kind >= kindRWMutex {
		incs = faultIncsToo
	}
	for done, iter := 0, 0; done < incs; iter++ {
		if r.ctx.Err() != nil {
			t.Errorf("worker %d: %d of %d increments before the deadline", w.id, done, incs)
			return
		}
		s, err := w.session(r.ctx)
		if err != nil {
			continue
		}
		m := newPrimitive(r.f.kind, s, r.name+"/lock", w.id+iter)
		patience := 5 * time.Second
		if r.f.impatient && w.id == 0 {
			patience = 150 * time.Millisecond
		}
		lctx, cancel := context.WithTimeout(r.ctx, patience)
		err = m.acquire(lctx)
		cancel()
		if err != nil {
			continue
		}
		rec, ended := recordHold(w.id, m)
		guard := m.guard()

		ok := w.increment(t, m, guard, counter, rec.rev)
		if ok && m.role != readRole {
			done++
			progress <- struct{}{}
		}
		rec.unlocking = time.Now()
		w.unlock(r.ctx, m)
		if !ended(&rec) {
			t.Errorf("worker %d: hold %d: Done never fired", w.id, rec.rev)
		}
		r.mu.Lock()
		r.holds = append(r.holds, rec)
		r.mu.Unlock()
	}
}

// increment does the hold's work, guarded by the hold: it reads the counter
// and writes it plus one (a writer then copies it to counter/b, so that a
// reader sees the work half done if it runs meanwhile; a permit holder
// writes only if nobody wrote since its read); a reader reads both. The
// paused victim freezes while holding and then writes with the guard it
// took before the pause, as a process waking from a stop would.
func (w *faultWorker) increment(t *testing.T, m primitive, guard clientv3.Cmp, counter string, token int64) bool {
	r := w.r
	paused := false
	if w.id == 0 && r.armed.CompareAndSwap(true, false) {
		close(r.holding)
		<-r.injected
		if r.f.pause {
			<-r.healed // frozen while holding: Done is not looked at
			paused = true
		}
	}
	ctx, cancel := context.WithTimeout(r.ctx, 5*time.Second)
	defer cancel()
	if m.role == readRole && !paused {
		resp, err := m.Do(ctx, clientv3.OpGet(counter), clientv3.OpGet(counter+"/b"))
		if err != nil {
			return false
		}
		if value(resp.Responses[0]) != value(resp.Responses[1]) {
			r.mu.Lock()
			r.halfDone = append(r.halfDone, resp.Header.Revision)
			r.mu.Unlock()
		}
		return true
	}
	resp, err := w.cli.Get(ctx, counter)
	if err != nil {
		return false
	}
	if len(resp.Kvs) == 0 { // put before the workers start: a read that misses it is a finding
		t.Errorf("worker %d: a linearizable read at revision %d (member %x) does not find %s", w.id, resp.Header.Revision, resp.Header.MemberId, counter)
		return false
	}
	n, _ := strconv.Atoi(string(resp.Kvs[0].Value))
	put := clientv3.OpPut(counter, strconv.Itoa(n+1))
	if paused {
		tr, err := w.cli.Txn(ctx).If(guard).Then(put).Commit()
		if err == nil && tr.Succeeded {
			r.mu.Lock()
			r.staleWrites++
			r.mu.Unlock()
		}
		return false
	}
	if m.role == permitRole { // others may hold: write only over what was read
		put = clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(counter), "=", resp.Kvs[0].ModRevision)}, []clientv3.Op{put}, nil)
	}
	tr, err := m.Do(ctx, put)
	if err != nil || m.role == permitRole && !tr.Responses[0].GetResponseTxn().Succeeded {
		return false
	}
	r.mu.Lock()
	r.incs = append(r.incs, incRec{token: token, commit: tr.Header.Revision})
	r.mu.Unlock()
	if m.role == writeRole {
		m.Do(ctx, clientv3.OpPut(counter+"/b", strconv.Itoa(n+1))) // lost meanwhile: the next writer writes both
	}
	return true
}

// value is the value a Get in a transaction read, "0" when absent.
func value(op *pb.ResponseOp) string {
	if kvs := op.GetResponseRange().GetKvs(); len(kvs) > 0 {
		return string(kvs[0].Value)
	}
	return "0"
}

// unlock releases the hold, retrying while it is held and the release fails
// (cut off from etcd), as a careful user does.
func (w *faultWorker) unlock(ctx context.Context, m primitive) {
	for ctx.Err() == nil && m.Err() == nil {
		ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		m.release(ctx) // an error wrapping ErrLockReleased: the hold was gone
		cancel()
	}
}

// primitive is one contender for the name (a Mutex, an Election, a reader
// or a writer of an RWMutex, a holder of semaphore permits) seen through
// what the suite needs of any.
type primitive struct {
	held
	acquire func(context.Context) error
	release func(context.Context) error
	guard   func() clientv3.Cmp
	weight  int64 // see checkHolds
	role    role
}

// role is what a hold's work is (faultWorker.increment).
type role int

type held interface {
	Do(ctx context.Context, ops ...clientv3.Op) (*clientv3.TxnResponse, error)
	Rev() int64
	Header() *pb.ResponseHeader
	Done() <-chan struct{}
	Err() error
}

// newPrimitive returns a contender of kind; i chooses between a reader and
// a writer, or between requests of 1 and 2 permits.
func newPrimitive(kind primKind, s *etcdsync.Session, name string, i int) primitive {
	switch kind {
	case kindElection:
		e := etcdsync.NewElection(s, name)
		return primitive{held: e, guard: e.IsLeader, release: e.Resign, weight: 1,
			acquire: func(ctx context.Context) error { return e.Campaign(ctx, "candidate") }}
	case kindRWMutex:
		rw := etcdsync.NewRWMutex(s, name)
		if i%2 == 0 {
			return primitive{held: rw, acquire: rw.Lock, release: rw.Unlock, guard: rw.IsOwner, weight: faultWorkers, role: writeRole}
		}
		return primitive{held: rw, acquire: rw.RLock, release: rw.RUnlock, guard: rw.IsOwner, weight: 1, role: readRole}
	case kindSemaphore:
		sm := etcdsync.NewSemaphore(s, name, faultPermits)
		n := int64(i%2 + 1)
		return primitive{held: sm, release: sm.Release, guard: sm.IsOwner, weight: n, role: permitRole,
			acquire: func(ctx context.Context) error { return sm.Acquire(ctx, n) }}
	case kindMultiLock:
		ml := etcdsync.NewMultiLock(s, name, name+"2")
		guard := func() clientv3.Cmp { // the first name's key, for a paused holder's stale write
			return clientv3.Compare(clientv3.CreateRevision(ml.Key(name)), "=", ml.Rev(name))
		}
		return primitive{held: firstOf{ml, name}, acquire: ml.Lock, release: ml.Unlock, guard: guard, weight: 1}
	}
	m := etcdsync.NewMutex(s, name)
	return primitive{held: m, acquire: m.Lock, release: m.Unlock, guard: m.IsOwner, weight: 1}
}

// firstOf is a MultiLock whose Rev is its first name's.
type firstOf struct {
	*etcdsync.MultiLock
	first string
}

func (f firstOf) Rev() int64 { return f.MultiLock.Rev(f.first) }
