package tests

// The compatibility matrix (issue 24): every primitive, through every way a
// user's *clientv3.Client reaches etcd (namespace, etcd's gRPC proxy, the
// in-process client, wrapped interfaces, TLS and auth, the etcd binaries of
// other server lines), and leadership under each deployment. A deployment
// gives the library its clients and gives the test an admin client straight
// to a member (a delete or a revoke made there is one the deployment's
// client did not make: the proxy's cache does not see it) and the prefix
// under which the library's keys live in etcd's keyspace.

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/namespace"
	"go.etcd.io/etcd/server/v3/etcdserver/api/v3client"
	"google.golang.org/grpc"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
)

// cellTimeout bounds one cell: a cell that hangs fails within it.
const cellTimeout = 15 * time.Second

// blockedFor is how long a call must still wait for a cell to call it blocked.
const blockedFor = 300 * time.Millisecond

// deployment is how the library's clients reach etcd.
type deployment struct {
	// newClient returns a new client of the deployment, closed in t's cleanup.
	newClient func(t *testing.T) *clientv3.Client
	admin     *clientv3.Client // straight to a member, no wrapper
	prefix    string           // of the library's keys in etcd's keyspace
	// after checks what the deployment promises once a cell has run.
	after func(t *testing.T)
}

type compatRig struct {
	name     string
	short    bool // runs in -short
	external bool // an etcd binary named by an environment variable (see etcdBinaries)
	start    func(t *testing.T) *deployment
}

func compatRigs() []compatRig {
	rigs := []compatRig{
		{"plain", true, false, func(t *testing.T) *deployment {
			c := single(t)
			return &deployment{newClient: func(t *testing.T) *clientv3.Client { return c.Client(t) }, admin: c.Client(t)}
		}},
		{"namespace", true, false, func(t *testing.T) *deployment {
			c := single(t)
			return &deployment{
				newClient: func(t *testing.T) *clientv3.Client {
					cli := c.Client(t)
					cli.KV = namespace.NewKV(cli.KV, "tenant/")
					cli.Watcher = namespace.NewWatcher(cli.Watcher, "tenant/")
					cli.Lease = namespace.NewLease(cli.Lease, "tenant/")
					return cli
				},
				admin:  c.Client(t),
				prefix: "tenant/",
			}
		}},
		{"grpcproxy", false, false, func(t *testing.T) *deployment {
			c := single(t)
			addr := etcdtest.StartGRPCProxy(t, c.Endpoints())
			return &deployment{newClient: func(t *testing.T) *clientv3.Client { return etcdtest.NewClient(t, []string{addr}) }, admin: c.Client(t)}
		}},
		{"v3client", false, false, func(t *testing.T) *deployment {
			c := single(t)
			srv := c.Member(0).Server()
			return &deployment{
				newClient: func(t *testing.T) *clientv3.Client {
					cli := v3client.New(srv)
					t.Cleanup(func() { cli.Close() })
					return cli
				},
				admin: c.Client(t),
			}
		}},
		{"wrapped", false, false, func(t *testing.T) *deployment {
			c := single(t)
			calls := &wrapCalls{}
			return &deployment{
				newClient: func(t *testing.T) *clientv3.Client { return calls.wrap(c.Client(t, calls.dial()...)) },
				admin:     c.Client(t),
				after:     calls.check,
			}
		}},
	}
	for _, b := range etcdBinaries {
		rigs = append(rigs, compatRig{name: b.rig, external: true, start: b.start})
	}
	return rigs
}

// etcdBinaries are the etcd servers, besides the embedded one (3.7), that
// the matrix runs against: each a binary named by an environment variable,
// its rig skipped with a message when the variable is unset. CI sets them
// all (.ci/run).
var etcdBinaries = []etcdBinary{
	{"etcd34", "ETCDSYNC_ETCD34", "3.4", ".ci/etcd34.sh fetches Debian's"},
	{"etcd35", "ETCDSYNC_ETCD35", "3.5", ".ci/etcdbin.sh v3.5.x DIR builds one from etcd's module"},
	{"etcd36", "ETCDSYNC_ETCD36", "3.6", ".ci/etcdbin.sh v3.6.x DIR builds one from etcd's module"},
}

// etcdBinary is an etcd server binary of one minor line.
type etcdBinary struct {
	rig, env, line, how string
}

// start runs the binary on 127.0.0.1 until t's cleanup (see runEtcdBinary)
// and returns its deployment: plain clients straight to it. Without the
// binary t is skipped.
func (b etcdBinary) start(t *testing.T) *deployment {
	ep := runEtcdBinary(t, b.path(t))
	return &deployment{newClient: func(t *testing.T) *clientv3.Client { return etcdtest.NewClient(t, []string{ep}) }, admin: etcdtest.NewClient(t, []string{ep})}
}

// path returns the binary's path, or skips t when it is not given.
func (b etcdBinary) path(t testing.TB) string {
	t.Helper()
	bin := os.Getenv(b.env)
	if bin == "" {
		t.Skipf("%s is not set: no etcd %s binary to test against (%s)", b.env, b.line, b.how)
	}
	return bin
}

// compatCell is one behaviour checked under every deployment.
type compatCell struct {
	name string
	run  func(t *testing.T, d *deployment, name string)
}

func compatCells() []compatCell {
	return []compatCell{
		{"MutexContention", cellMutexContention},
		{"TryLock", cellTryLock},
		{"RWMutex", cellRWMutex},
		{"Semaphore", cellSemaphore},
		{"ElectionObserveResign", cellElection},
		{"RunLossOnAdminDelete", cellRunLoss},
		{"LeaseGoneWhileWaiting", cellLeaseGoneWaiting},
		{"LeaseGoneWhileHolding", cellLeaseGoneHolding},
		{"LeaseExpiresWhileHolding", cellLeaseExpires},
		{"LeaseExpiresWhileWaiting", cellLeaseExpiresWaiting},
		{"HoldOutlivesTTLs", cellHoldOutlivesTTLs},
		{"OwnKeyDeletedByAdmin", cellOwnKeyDeleted},
		{"OwnKeyDeletedWithPredecessor", cellOwnKeyWithPredecessor},
		{"PrefixDeletedWhileWaiting", cellPrefixDeleted},
	}
}

// TestCompat runs every cell under every deployment, the deployments and
// the cells of one deployment side by side (each cell has a name of its
// own). Each cell ends by checking that no key is left under its name; the
// deployment's promise is checked once its cells have all run.
func TestCompat(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		t.Run(rig.name, func(t *testing.T) {
			if testing.Short() && !rig.short {
				t.Skip("skipped in -short")
			}
			t.Parallel() // each deployment has a cluster of its own
			d := rig.start(t)
			t.Run("cells", func(t *testing.T) {
				for _, cell := range compatCells() {
					t.Run(cell.name, func(t *testing.T) {
						t.Parallel()
						name := "compat/" + cell.name
						cell.run(t, d, name)
						require.Empty(t, rawKeys(t, d, name), "keys left under %s", name)
					})
				}
			})
			if d.after != nil {
				d.after(t)
			}
		})
	}
}

// ctxCell is a context bounded by cellTimeout.
func ctxCell(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), cellTimeout)
	t.Cleanup(cancel)
	return ctx
}

// sessions returns n sessions, each on a client of its own.
func (d *deployment) sessions(t *testing.T, n int, opts ...etcdsync.SessionOption) []*etcdsync.Session {
	t.Helper()
	var out []*etcdsync.Session
	for range n {
		out = append(out, session(t, d.newClient(t), opts...))
	}
	return out
}

// rawKeys returns the keys under name/ in etcd's keyspace.
func rawKeys(t *testing.T, d *deployment, name string) []string {
	t.Helper()
	return keys(t, d.admin, d.prefix+name+"/")
}

func cellMutexContention(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	const contenders, rounds = 3, 4
	var inside, most, total atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, contenders)
	for _, s := range d.sessions(t, contenders) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			m := etcdsync.NewMutex(s, name)
			for range rounds {
				if err := m.Lock(ctx); err != nil {
					errs <- fmt.Errorf("lock: %w", err)
					return
				}
				n := inside.Add(1)
				for cur := most.Load(); n > cur && !most.CompareAndSwap(cur, n); cur = most.Load() {
				}
				total.Add(1)
				time.Sleep(5 * time.Millisecond) // hold it a moment: overlaps would show
				inside.Add(-1)
				if err := m.Unlock(ctx); err != nil {
					errs <- fmt.Errorf("unlock: %w", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	require.EqualValues(t, 1, most.Load(), "holders at once")
	require.EqualValues(t, contenders*rounds, total.Load())
}

func cellTryLock(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 2)
	a, b := etcdsync.NewMutex(ss[0], name), etcdsync.NewMutex(ss[1], name)
	require.NoError(t, a.Lock(ctx))
	require.ErrorIs(t, b.TryLock(ctx), etcdsync.ErrLocked)
	require.Len(t, rawKeys(t, d, name), 1, "a failed TryLock leaves no key")
	require.NoError(t, a.Unlock(ctx))
	require.NoError(t, b.TryLock(ctx))
	require.ErrorIs(t, a.TryLock(ctx), etcdsync.ErrLocked)
	require.NoError(t, b.Unlock(ctx))
}

func cellRWMutex(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 4)
	r1, r2, w, r3 := etcdsync.NewRWMutex(ss[0], name), etcdsync.NewRWMutex(ss[1], name), etcdsync.NewRWMutex(ss[2], name), etcdsync.NewRWMutex(ss[3], name)
	require.NoError(t, r1.RLock(ctx))
	require.NoError(t, r2.RLock(ctx), "readers share")
	wl := async(func() error { return w.Lock(ctx) })
	notYet(t, wl, blockedFor, "writer behind readers")
	require.NoError(t, r1.RUnlock(ctx))
	notYet(t, wl, blockedFor, "writer behind one reader")
	require.NoError(t, r2.RUnlock(ctx))
	require.NoError(t, resultWithin(t, wl, cellTimeout, "writer after the readers left"))
	rl := async(func() error { return r3.RLock(ctx) })
	notYet(t, rl, blockedFor, "reader behind a writer")
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, resultWithin(t, rl, cellTimeout, "reader after the writer left"))
	require.NoError(t, r3.RUnlock(ctx))
}

func cellSemaphore(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 3)
	a, b, c := etcdsync.NewSemaphore(ss[0], name, 2), etcdsync.NewSemaphore(ss[1], name, 2), etcdsync.NewSemaphore(ss[2], name, 2)
	require.NoError(t, a.Acquire(ctx, 1))
	require.NoError(t, b.Acquire(ctx, 1))
	ca := async(func() error { return c.Acquire(ctx, 1) })
	notYet(t, ca, blockedFor, "third acquire of a capacity of two")
	require.NoError(t, a.Release(ctx))
	require.NoError(t, resultWithin(t, ca, cellTimeout, "acquire after a release"))
	require.NoError(t, b.Release(ctx))
	require.NoError(t, c.Release(ctx))
}

func cellElection(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 2)
	e1, e2 := etcdsync.NewElection(ss[0], name), etcdsync.NewElection(ss[1], name)
	require.NoError(t, e1.Campaign(ctx, "one"))
	octx, stop := context.WithCancel(ctx)
	defer stop()
	obs := etcdsync.NewObserver(d.newClient(t), name).Observe(octx)
	next := func(what string) string {
		t.Helper()
		select {
		case resp, ok := <-obs:
			require.True(t, ok, "observe closed before %s", what)
			return string(resp.Kvs[0].Value)
		case <-ctx.Done():
			t.Fatalf("observe: no %s within %v", what, cellTimeout)
			return ""
		}
	}
	require.Equal(t, "one", next("first leader"))
	c2 := async(func() error { return e2.Campaign(ctx, "two") })
	notYet(t, c2, blockedFor, "second candidate")
	require.NoError(t, e1.Proclaim(ctx, "one again"))
	require.Equal(t, "one again", next("proclamation"))
	require.NoError(t, e1.Resign(ctx))
	require.NoError(t, resultWithin(t, c2, cellTimeout, "campaign after the leader resigned"))
	require.Equal(t, "two", next("second leader"))
	resp, err := e1.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "two", string(resp.Kvs[0].Value))
	require.NoError(t, e2.Resign(ctx))
}

func cellRunLoss(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 2)
	m, next := etcdsync.NewMutex(ss[0], name), etcdsync.NewMutex(ss[1], name)
	started := make(chan string, 1)
	run := async(func() error {
		return m.Run(ctx, func(fctx context.Context) error {
			started <- m.Key()
			<-fctx.Done()
			return context.Cause(fctx)
		})
	})
	var key string
	select {
	case key = <-started:
	case <-ctx.Done():
		t.Fatal("Run did not start")
	}
	waiter := async(func() error { return next.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 2 })
	_, err := d.admin.Delete(ctx, d.prefix+key)
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, run, cellTimeout, "Run after an admin deleted its key"), etcdsync.ErrNotHeld)
	require.NoError(t, resultWithin(t, waiter, cellTimeout, "the waiter after the holder's key was deleted"))
	require.NoError(t, ss[0].Err(), "the session of a hold whose key was deleted lives on")
	require.NoError(t, next.Unlock(ctx))
}

func cellLeaseGoneWaiting(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 3)
	holder, waiter, behind := etcdsync.NewMutex(ss[0], name), etcdsync.NewMutex(ss[1], name), etcdsync.NewMutex(ss[2], name)
	require.NoError(t, holder.Lock(ctx))
	w := async(func() error { return waiter.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 2 })
	b := async(func() error { return behind.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 3 })
	_, err := d.admin.Revoke(ctx, ss[1].Lease())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, w, cellTimeout, "a waiter whose lease was revoked"), etcdsync.ErrSessionExpired)
	behindWaitsForHolder(t, ctx, holder, behind, b)
}

// behindWaitsForHolder checks the end of a cell where a waiter between
// holder and behind went: behind (whose Lock's result comes on b) still
// waits while holder holds, and gets the lock once holder unlocks.
func behindWaitsForHolder(t *testing.T, ctx context.Context, holder, behind *etcdsync.Mutex, b <-chan error) {
	t.Helper()
	notYet(t, b, blockedFor, "the one behind the waiter that went, while the holder holds")
	require.NoError(t, holder.Unlock(ctx))
	require.NoError(t, resultWithin(t, b, cellTimeout, "the one behind, after the holder left"))
	require.NoError(t, behind.Unlock(ctx))
}

func cellLeaseGoneHolding(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 2)
	holder, waiter := etcdsync.NewMutex(ss[0], name), etcdsync.NewMutex(ss[1], name)
	require.NoError(t, holder.Lock(ctx))
	done := holder.Done()
	w := async(func() error { return waiter.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 2 })
	_, err := d.admin.Revoke(ctx, ss[0].Lease())
	require.NoError(t, err)
	within(t, done, cellTimeout, "Done of a hold whose lease was revoked")
	within(t, ss[0].Done(), cellTimeout, "Done of a session whose lease was revoked")
	require.ErrorIs(t, ss[0].Err(), etcdsync.ErrSessionExpired)
	require.NoError(t, resultWithin(t, w, cellTimeout, "the waiter after the holder's lease went"))
	require.NoError(t, waiter.Unlock(ctx))
}

// cellLeaseExpires lets a holder's lease expire on the server: its
// session's client stops reaching etcd (closed), so nothing keeps the lease
// alive; the waiter gets the lock once the server expires it.
func cellLeaseExpires(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	doomed := d.newClient(t)
	s, err := etcdsync.NewSession(doomed, etcdsync.WithTTL(2*time.Second))
	require.NoError(t, err)
	holder := etcdsync.NewMutex(s, name)
	require.NoError(t, holder.Lock(ctx))
	s.Orphan() // keepalives stop; the lease is left to expire
	waiter := etcdsync.NewMutex(d.sessions(t, 1)[0], name)
	require.NoError(t, waiter.Lock(ctx), "the waiter once the holder's lease expired")
	require.NoError(t, waiter.Unlock(ctx))
}

// cellLeaseExpiresWaiting lets a waiter's lease expire on the server while
// it waits between a holder and another waiter. The waiter is a crashed
// process: its key and lease written straight to etcd, never kept alive.
// The one behind it keeps waiting while the holder holds, and gets the lock
// once the holder leaves.
func cellLeaseExpiresWaiting(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 2)
	holder, behind := etcdsync.NewMutex(ss[0], name), etcdsync.NewMutex(ss[1], name)
	require.NoError(t, holder.Lock(ctx))
	lease, err := d.admin.Grant(ctx, 2)
	require.NoError(t, err)
	crashed := fmt.Sprintf("%s%s/%x", d.prefix, name, int64(lease.ID))
	_, err = d.admin.Put(ctx, crashed, "", clientv3.WithLease(lease.ID))
	require.NoError(t, err)
	b := async(func() error { return behind.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 3 })
	waitCount(t, d.admin, crashed, cellTimeout, func(n int) bool { return n == 0 }) // the crashed key gone (a prefix of no other: a member's lease IDs have one length)
	ttl, err := d.admin.TimeToLive(ctx, lease.ID)
	require.NoError(t, err)
	require.EqualValues(t, -1, ttl.TTL, "the crashed waiter's key went with its lease")
	behindWaitsForHolder(t, ctx, holder, behind, b)
}

// cellHoldOutlivesTTLs holds a lock for several TTLs: while keepalives are
// acknowledged (through the deployment's Lease), neither the hold nor the
// session ends, and the lease's TTL on the server keeps being renewed.
func cellHoldOutlivesTTLs(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	const ttl = 2 * time.Second
	s, err := etcdsync.NewSession(d.newClient(t), etcdsync.WithTTL(ttl))
	require.NoError(t, err)
	defer s.Close()
	m := etcdsync.NewMutex(s, name)
	require.NoError(t, m.Lock(ctx))
	select {
	case <-m.Done():
		t.Fatalf("the hold ended while keepalives were acknowledged: %v", m.Err())
	case <-s.Done():
		t.Fatalf("the session ended while keepalives were acknowledged: %v", s.Err())
	case <-time.After(3 * ttl):
	}
	resp, err := d.admin.TimeToLive(ctx, s.Lease())
	require.NoError(t, err)
	require.Positive(t, resp.TTL, "the lease on the server")
	require.Len(t, rawKeys(t, d, name), 1, "the held key")
	require.NoError(t, m.Unlock(ctx))
}

// watchedSession returns a session on a new client of the deployment whose
// Watcher signals on the returned channel each time a watch of the
// library's is created (its Created response has come).
func watchedSession(t *testing.T, d *deployment) (*etcdsync.Session, <-chan struct{}) {
	t.Helper()
	cli := d.newClient(t)
	w := &createdWatcher{Watcher: cli.Watcher, created: make(chan struct{}, 64)}
	cli.Watcher = w
	return session(t, cli), w.created
}

// createdWatcher is a Watcher that signals each watch's creation.
type createdWatcher struct {
	clientv3.Watcher
	created chan struct{}
}

func (w *createdWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	in := w.Watcher.Watch(ctx, key, opts...)
	out := make(chan clientv3.WatchResponse)
	go func() {
		defer close(out)
		for wr := range in {
			if wr.Created {
				w.created <- struct{}{}
			}
			select {
			case out <- wr:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}

// cellOwnKeyDeleted: an admin deletes a waiter's key straight on a member
// (through etcd's gRPC proxy, its cache does not see it). The waiter returns
// ErrSessionExpired while its predecessor still holds; the one behind it
// waits for the holder, then gets the lock.
func cellOwnKeyDeleted(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	hs := d.sessions(t, 2)
	ws, created := watchedSession(t, d)
	holder, waiter, behind := etcdsync.NewMutex(hs[0], name), etcdsync.NewMutex(ws, name), etcdsync.NewMutex(hs[1], name)
	require.NoError(t, holder.Lock(ctx))
	w := async(func() error { return waiter.Lock(ctx) })
	awaitCreated(t, created, 1, cellTimeout, "watch") // of the prefix: the holder is all it waits for
	b := async(func() error { return behind.Lock(ctx) })
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 3 })
	_, err := d.admin.Delete(ctx, fmt.Sprintf("%s%s/%x", d.prefix, name, int64(ws.Lease())))
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, w, cellTimeout, "a waiter whose key an admin deleted"), etcdsync.ErrSessionExpired)
	behindWaitsForHolder(t, ctx, holder, behind, b)
}

// cellOwnKeyWithPredecessor: one transaction deletes a waiter's key and its
// predecessor's (the holder's), so the waiter's key is gone at the revision
// its turn would have come: it returns ErrSessionExpired, never the lock.
// The first wait on a client (the version check and the probe; through
// etcd's gRPC proxy, the unanswered progress request) and a later one.
func cellOwnKeyWithPredecessor(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ws, created := watchedSession(t, d)
	hs := d.sessions(t, 1)[0]
	for round := range 2 {
		holder, waiter := etcdsync.NewMutex(hs, name), etcdsync.NewMutex(ws, name)
		require.NoError(t, holder.Lock(ctx))
		w := async(func() error { return waiter.Lock(ctx) })
		awaitCreated(t, created, 1, cellTimeout, "watch") // of the prefix
		own := fmt.Sprintf("%s%s/%x", d.prefix, name, int64(ws.Lease()))
		_, err := d.admin.Txn(ctx).Then(clientv3.OpDelete(d.prefix+holder.Key()), clientv3.OpDelete(own)).Commit()
		require.NoError(t, err)
		require.ErrorIs(t, resultWithin(t, w, cellTimeout, "a waiter whose key went with its predecessor's"), etcdsync.ErrSessionExpired, "round %d", round)
		within(t, holder.Done(), cellTimeout, "Done of the hold whose key was deleted")
	}
}

// cellPrefixDeleted: an admin deletes the whole name (every key at one
// revision) while one holds and two wait: both waiters return
// ErrSessionExpired, the hold's Done closes.
func cellPrefixDeleted(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	holder := etcdsync.NewMutex(d.sessions(t, 1)[0], name)
	s1, created1 := watchedSession(t, d)
	s2, created2 := watchedSession(t, d)
	require.NoError(t, holder.Lock(ctx))
	w1 := async(func() error { return etcdsync.NewMutex(s1, name).Lock(ctx) })
	awaitCreated(t, created1, 1, cellTimeout, "watch") // of the prefix
	w2 := async(func() error { return etcdsync.NewMutex(s2, name).Lock(ctx) })
	awaitCreated(t, created2, 1, cellTimeout, "watch") // of the prefix: the first waiter and the holder are all it waits for
	_, err := d.admin.Delete(ctx, d.prefix+name+"/", clientv3.WithPrefix())
	require.NoError(t, err)
	require.ErrorIs(t, resultWithin(t, w1, cellTimeout, "the first waiter"), etcdsync.ErrSessionExpired)
	require.ErrorIs(t, resultWithin(t, w2, cellTimeout, "the second waiter"), etcdsync.ErrSessionExpired)
	within(t, holder.Done(), cellTimeout, "Done of the hold whose key was deleted")
}

// runEtcdBinary starts a single etcd member from bin on free ports of
// 127.0.0.1 (with extra flags after the usual ones), waits until it answers,
// stops it in tb's cleanup and returns its client URL.
func runEtcdBinary(tb testing.TB, bin string, extra ...string) string {
	var ports [2]int
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(tb, err)
		ports[i] = ln.Addr().(*net.TCPAddr).Port
		require.NoError(tb, ln.Close())
	}
	client := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[0])}
	peer := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", ports[1])}
	var out strings.Builder
	cmd := exec.Command(bin, append([]string{
		"--name", "m0", "--data-dir", tb.TempDir(),
		"--listen-client-urls", client.String(), "--advertise-client-urls", client.String(),
		"--listen-peer-urls", peer.String(), "--initial-advertise-peer-urls", peer.String(),
		"--initial-cluster", "m0=" + peer.String(),
		"--heartbeat-interval", "50", "--election-timeout", "500",
		"--logger", "zap", "--log-level", "error"}, extra...)...)
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(tb, cmd.Start())
	exited := async(func() error { return cmd.Wait() })
	tb.Cleanup(func() {
		cmd.Process.Kill()
		<-exited
	})
	cli := etcdtest.NewClient(tb, []string{client.String()})
	ctx, cancel := context.WithTimeout(context.Background(), cellTimeout)
	defer cancel()
	for {
		if _, err := cli.Get(ctx, "health", clientv3.WithCountOnly()); err == nil {
			return client.String()
		}
		select {
		case err := <-exited:
			tb.Fatalf("etcd %s exited: %v\n%s", bin, err, out.String())
		case <-ctx.Done():
			tb.Fatalf("etcd %s: no answer within %v\n%s", bin, cellTimeout, out.String())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// wrapCalls wraps a client's KV, Watcher, Lease and Maintenance with user
// interceptors that mark each call's context, and checks at the gRPC layer
// (unary and stream interceptors) that every RPC the client sends carries
// the mark: a request the library sends around the client's interfaces
// does not.
type wrapCalls struct {
	mu       sync.Mutex
	calls    map[string]int // through the interfaces, by method
	bypassed []string       // RPCs without the mark
}

type wrapMark struct{}

func (w *wrapCalls) mark(ctx context.Context, method string) context.Context {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.calls == nil {
		w.calls = make(map[string]int)
	}
	w.calls[method]++
	return context.WithValue(ctx, wrapMark{}, true)
}

func (w *wrapCalls) seen(ctx context.Context, method string) {
	if ctx.Value(wrapMark{}) != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	w.bypassed = append(w.bypassed, method)
}

func (w *wrapCalls) dial() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			w.seen(ctx, method)
			return invoker(ctx, method, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			w.seen(ctx, method)
			return streamer(ctx, desc, cc, method, opts...)
		}),
	}
}

// count returns how many calls of method went through the interfaces.
func (w *wrapCalls) count(method string) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.calls[method]
}

// wrappedClient returns a client of endpoints whose interfaces are wrapped
// (calls sees what goes through them) and whose RPCs cnt counts (each
// watch created: cnt.created, with room for 16).
func wrappedClient(t *testing.T, endpoints []string) (*clientv3.Client, *wrapCalls, *counter) {
	calls := &wrapCalls{}
	cnt := &counter{created: make(chan struct{}, 16)}
	return calls.wrap(etcdtest.NewClient(t, endpoints, append(calls.dial(), cnt.dial()...)...)), calls, cnt
}

// check fails t when an RPC went around the interfaces, and resets.
func (w *wrapCalls) check(t *testing.T) {
	t.Helper()
	w.mu.Lock()
	bypassed, calls := w.bypassed, w.calls
	w.bypassed, w.calls = nil, nil
	w.mu.Unlock()
	require.Empty(t, bypassed, "RPCs that went around the client's interfaces (calls through them: %v)", calls)
	require.NotEmpty(t, calls)
}

func (w *wrapCalls) wrap(cli *clientv3.Client) *clientv3.Client {
	cli.KV = wrapKV{cli.KV, w}
	cli.Watcher = wrapWatcher{cli.Watcher, w}
	cli.Lease = wrapLease{cli.Lease, w}
	cli.Maintenance = wrapMaintenance{cli.Maintenance, w}
	return cli
}

type wrapKV struct {
	clientv3.KV
	w *wrapCalls
}

func (k wrapKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	return k.KV.Get(k.w.mark(ctx, "Get"), key, opts...)
}

func (k wrapKV) Put(ctx context.Context, key, val string, opts ...clientv3.OpOption) (*clientv3.PutResponse, error) {
	return k.KV.Put(k.w.mark(ctx, "Put"), key, val, opts...)
}

func (k wrapKV) Delete(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.DeleteResponse, error) {
	return k.KV.Delete(k.w.mark(ctx, "Delete"), key, opts...)
}

func (k wrapKV) Do(ctx context.Context, op clientv3.Op) (clientv3.OpResponse, error) {
	return k.KV.Do(k.w.mark(ctx, "Do"), op)
}

func (k wrapKV) Txn(ctx context.Context) clientv3.Txn { return k.KV.Txn(k.w.mark(ctx, "Txn")) }

type wrapWatcher struct {
	clientv3.Watcher
	w *wrapCalls
}

func (ww wrapWatcher) Watch(ctx context.Context, key string, opts ...clientv3.OpOption) clientv3.WatchChan {
	return ww.Watcher.Watch(ww.w.mark(ctx, "Watch"), key, opts...)
}

func (ww wrapWatcher) RequestProgress(ctx context.Context) error {
	return ww.Watcher.RequestProgress(ww.w.mark(ctx, "RequestProgress"))
}

type wrapLease struct {
	clientv3.Lease
	w *wrapCalls
}

func (l wrapLease) Grant(ctx context.Context, ttl int64) (*clientv3.LeaseGrantResponse, error) {
	return l.Lease.Grant(l.w.mark(ctx, "Grant"), ttl)
}

func (l wrapLease) Revoke(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseRevokeResponse, error) {
	return l.Lease.Revoke(l.w.mark(ctx, "Revoke"), id)
}

func (l wrapLease) TimeToLive(ctx context.Context, id clientv3.LeaseID, opts ...clientv3.LeaseOption) (*clientv3.LeaseTimeToLiveResponse, error) {
	return l.Lease.TimeToLive(l.w.mark(ctx, "TimeToLive"), id, opts...)
}

func (l wrapLease) KeepAlive(ctx context.Context, id clientv3.LeaseID) (<-chan *clientv3.LeaseKeepAliveResponse, error) {
	return l.Lease.KeepAlive(l.w.mark(ctx, "KeepAlive"), id)
}

func (l wrapLease) KeepAliveOnce(ctx context.Context, id clientv3.LeaseID) (*clientv3.LeaseKeepAliveResponse, error) {
	return l.Lease.KeepAliveOnce(l.w.mark(ctx, "KeepAliveOnce"), id)
}

type wrapMaintenance struct {
	clientv3.Maintenance
	w *wrapCalls
}

func (m wrapMaintenance) Status(ctx context.Context, endpoint string) (*clientv3.StatusResponse, error) {
	return m.Maintenance.Status(m.w.mark(ctx, "Status"), endpoint)
}

func TestLeadershipThroughDeployments(t *testing.T) {
	t.Parallel()
	for _, rig := range compatRigs() {
		t.Run(rig.name, func(t *testing.T) {
			if testing.Short() && !rig.short {
				t.Skip("skipped in -short")
			}
			t.Parallel()
			d := rig.start(t)
			name := "deploy/leadership"
			leadershipCell(t, d, name)
			require.Empty(t, rawKeys(t, d, name), "keys left under %s", name)
			if d.after != nil {
				d.after(t)
			}
		})
	}
}

func leadershipCell(t *testing.T, d *deployment, name string) {
	ctx := ctxCell(t)
	ss := d.sessions(t, 3)
	a, b, c := etcdsync.NewElection(ss[0], name), etcdsync.NewElection(ss[1], name), etcdsync.NewElection(ss[2], name)
	octx, stop := context.WithCancel(ctx)
	defer stop()
	terms := etcdsync.NewObserver(d.newClient(t), name).Terms(octx)
	next := func(what string) string {
		t.Helper()
		select {
		case tm, ok := <-terms:
			require.True(t, ok, "Terms closed before %s", what)
			if tm.Leader == nil {
				return ""
			}
			return string(tm.Leader.Value)
		case <-ctx.Done():
			t.Fatalf("Terms: no %s within %v", what, cellTimeout)
			return ""
		}
	}
	require.Equal(t, "", next("no leader at first"))

	var aWorking atomic.Bool
	started := make(chan struct{})
	aRun := async(func() error {
		return a.Run(ctx, "a", func(ctx context.Context) error {
			aWorking.Store(true)
			defer aWorking.Store(false)
			close(started)
			<-ctx.Done()
			time.Sleep(30 * time.Millisecond)
			return nil
		})
	})
	<-started
	require.Equal(t, "a", next("a leads"))
	require.ErrorIs(t, c.TryCampaign(ctx, "c"), etcdsync.ErrLocked)
	require.Len(t, rawKeys(t, d, name), 1, "a failed TryCampaign leaves no key")
	bLeads := async(func() error {
		if err := b.Campaign(ctx, "b"); err != nil {
			return err
		}
		if aWorking.Load() {
			return errors.New("b leads while a's Run works")
		}
		return nil
	})
	waitCount(t, d.admin, d.prefix+name+"/", cellTimeout, func(n int) bool { return n >= 2 })
	require.ErrorIs(t, c.TryCampaign(ctx, "c"), etcdsync.ErrLocked)
	require.NoError(t, a.Handover(ctx))
	require.NoError(t, resultWithin(t, aRun, cellTimeout, "a's Run returns"))
	require.NoError(t, resultWithin(t, bLeads, cellTimeout, "b leads"))
	require.Equal(t, "b", next("b leads, with no gap"))
	require.NoError(t, b.Proclaim(ctx, "b2"))
	require.Equal(t, "b2", next("b's proclamation"))
	require.NoError(t, b.Handover(ctx))
	require.Equal(t, "", next("no leader"))
	require.NoError(t, c.TryCampaign(ctx, "c"))
	require.Equal(t, "c", next("c leads by a try"))
	require.NoError(t, c.Resign(ctx))
	require.Equal(t, "", next("no leader again"))
}

// secureCluster starts a member serving clients over TLS (certificates made
// here) with auth enabled: root, "rw" (read-write on locks/), "ro" (read on
// locks/) and "none" (no permission). It returns a client factory.
func secureCluster(t *testing.T) func(user string, dial ...grpc.DialOption) *clientv3.Client {
	certs, err := etcdtest.MakeCerts(t.TempDir())
	require.NoError(t, err)
	c := etcdtest.Start(t, etcdtest.Options{TLS: certs})
	connect := authClients(t, c.Endpoints(), certs.ClientTLS())
	etcdtest.EnableAuth(t, ctxT(t), connect(""), map[string]string{"root": "root", "rw": "locks-rw", "ro": "locks-ro", "none": ""})
	return connect
}

// authClients returns a factory of clients of endpoints (over TLS with
// tlsConfig, if non-nil) that log in as user (none if "") with its
// etcdtest.EnableAuth password; each is closed in t's cleanup.
func authClients(t *testing.T, endpoints []string, tlsConfig *tls.Config) func(user string, dial ...grpc.DialOption) *clientv3.Client {
	return func(user string, dial ...grpc.DialOption) *clientv3.Client {
		cfg := etcdtest.ClientConfig(endpoints, dial...)
		cfg.TLS = tlsConfig
		if user != "" {
			cfg.Username, cfg.Password = user, etcdtest.Password(user)
		}
		cli, err := clientv3.New(cfg)
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		return cli
	}
}

func TestAuthAndTLS(t *testing.T) {
	t.Parallel()
	connect := secureCluster(t)
	ctx := ctxT(t)
	root, rw, ro, none := connect("root"), connect("rw"), connect("ro"), connect("none")

	// A read-write user locks, waits in the queue (the watch stream carries
	// its credentials), elects and releases.
	holder := heldMutex(t, ctx, rw, "locks/job")
	cnt := counter{created: make(chan struct{}, 4)}
	waiter := etcdsync.NewMutex(session(t, connect("rw", cnt.dial()...)), "locks/job")
	got := lockAsync(t, ctx, waiter)
	within(t, cnt.created, testTimeout, "waiter's watch of the prefix created, with credentials")
	cnt.take()
	require.NoError(t, holder.Unlock(ctx))
	within(t, got, testTimeout, "rw waiter after the release")
	n, methods := cnt.take()
	require.Zero(t, n, "the handoff fell back to reads: %v", methods)
	e := etcdsync.NewElection(session(t, rw), "locks/elect")
	require.NoError(t, e.Campaign(ctx, "rw"))
	resp, err := e.Leader(ctx)
	require.NoError(t, err)
	require.Equal(t, "rw", string(resp.Kvs[0].Value))

	// A read-only user gets a permission error and leaves no key.
	roSession := session(t, ro)
	require.ErrorIs(t, etcdsync.NewMutex(roSession, "locks/ro").Lock(ctx), rpctypes.ErrPermissionDenied)
	require.ErrorIs(t, etcdsync.NewElection(roSession, "locks/ro").Campaign(ctx, "x"), rpctypes.ErrPermissionDenied)
	require.Empty(t, keys(t, root, "locks/ro/"))

	// A user with no access can neither delete nor take over a hold.
	_, err = none.Delete(ctx, waiter.Key())
	require.ErrorIs(t, err, rpctypes.ErrPermissionDenied)
	noneSession := session(t, none)
	tctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.ErrorIs(t, etcdsync.NewMutex(noneSession, "locks/job").TryLock(tctx), rpctypes.ErrPermissionDenied)
	require.ErrorIs(t, etcdsync.NewMutex(noneSession, "locks/job").Lock(tctx), rpctypes.ErrPermissionDenied)
	_, err = waiter.Do(ctx, clientv3.OpPut("locks/job-state", "still mine"))
	require.NoError(t, err, "the hold survives")
	require.NoError(t, waiter.Unlock(ctx))
	require.NoError(t, e.Resign(ctx))
	require.Empty(t, keys(t, root, "locks/job/"))
	require.Empty(t, keys(t, root, "locks/elect/"))
}
