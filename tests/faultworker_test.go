package tests

// The workers of the fault and robustness runs: each a client (through a
// proxy it can cut, slow or re-route) that takes holds of every primitive
// and writes guarded increments under them.

import (
	"context"
	"net/url"
	"strconv"
	"sync"
	"testing"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
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
