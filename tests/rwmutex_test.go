package tests

// RWMutex: readers together, writers alone, FIFO between them, and read
// holds shared by the values of one session.

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/etcdsync/etcdsync/internal/etcdtest/faults"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
	recipe "go.etcd.io/etcd/client/v3/experimental/recipes"
)

// rwCheck records read and write holds and fails when a writer overlaps
// anyone or a write fencing token does not increase.
type rwCheck struct {
	readers, writers atomic.Int32
	maxReaders       atomic.Int32
	mu               sync.Mutex
	lastWriteRev     int64
}

func (x *rwCheck) read(t *testing.T) {
	if w := x.writers.Load(); w != 0 {
		t.Errorf("a reader holds with %d writers", w)
	}
	n := x.readers.Add(1)
	for m := x.maxReaders.Load(); n > m && !x.maxReaders.CompareAndSwap(m, n); m = x.maxReaders.Load() {
	}
}

func (x *rwCheck) write(t *testing.T, rev int64) {
	if w := x.writers.Add(1); w != 1 {
		t.Errorf("%d writers at once", w)
	}
	if r := x.readers.Load(); r != 0 {
		t.Errorf("a writer holds with %d readers", r)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if rev <= x.lastWriteRev {
		t.Errorf("write fencing token %d after %d", rev, x.lastWriteRev)
	}
	x.lastWriteRev = rev
}

// Readers hold together, a writer alone; sessions, values on one session
// and goroutines sharing a value all take part.
func TestRWMutexExclusion(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		var x rwCheck
		const rounds = 6
		work := func(rw *etcdsync.RWMutex, id int) {
			for i := 0; i < rounds; i++ {
				if (i+id)%3 == 0 {
					if err := rw.Lock(ctx); err != nil {
						t.Errorf("Lock: %v", err)
						return
					}
					x.write(t, rw.Rev())
					time.Sleep(time.Millisecond)
					x.writers.Add(-1)
					if err := rw.Unlock(ctx); err != nil {
						t.Errorf("Unlock: %v", err)
						return
					}
					continue
				}
				if err := rw.RLock(ctx); err != nil {
					t.Errorf("RLock: %v", err)
					return
				}
				x.read(t)
				time.Sleep(3 * time.Millisecond)
				x.readers.Add(-1)
				if err := rw.RUnlock(ctx); err != nil {
					t.Errorf("RUnlock: %v", err)
					return
				}
			}
		}
		contendEveryWay(t, func() *clientv3.Client { return c.Client(t) },
			func(s *etcdsync.Session) *etcdsync.RWMutex { return etcdsync.NewRWMutex(s, "rwx") }, work)
		require.Empty(t, keys(t, c.Client(t), "rwx/"))
	})
}

// Readers really hold at once: two readers of different sessions each wait,
// holding, until the other holds too.
func TestRWMutexReadersTogether(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	ctx := ctxT(t)
	holdTogether(t, 2, func() (func() error, func() error) {
		rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "rwtogether")
		return func() error { return rw.RLock(ctx) }, func() error { return rw.RUnlock(ctx) }
	})
}

// holdTogether runs n holders (made by hold: take and release), each of
// which takes its hold and waits until all n hold before it releases: it
// fails t unless all n hold at once within testTimeout.
func holdTogether(t *testing.T, n int, hold func() (take, release func() error)) {
	var all, wg sync.WaitGroup
	all.Add(n)
	for i := 0; i < n; i++ {
		take, release := hold()
		wg.Add(1)
		go func() {
			defer wg.Done()
			require.NoError(t, take())
			all.Done()
			all.Wait() // never returns (the test times out) unless all hold
			require.NoError(t, release())
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	within(t, done, testTimeout, fmt.Sprintf("%d holders at once", n))
}

// FIFO: a waiting writer holds back readers that come after it, and TryRLock
// fails then in one RPC without writing.
func TestRWMutexWriterNotStarved(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		r1 := etcdsync.NewRWMutex(session(t, admin), "rwfifo")
		require.NoError(t, r1.RLock(ctx))
		w := etcdsync.NewRWMutex(session(t, admin), "rwfifo")
		wgot := doneAsync(t, "Lock", func() error { return w.Lock(ctx) })
		waitKeys(t, admin, "rwfifo/", 2)

		var cnt counter
		r2 := etcdsync.NewRWMutex(session(t, kitClient(t, c, cnt.dial()...)), "rwfifo")
		cnt.take()
		revBefore := storeRev(t, admin)
		require.ErrorIs(t, r2.TryRLock(ctx), etcdsync.ErrLocked)
		n, methods := cnt.take()
		require.Equal(t, int64(1), n, "TryRLock behind a waiting writer: %v", methods)
		require.ErrorIs(t, r2.TryLock(ctx), etcdsync.ErrLocked)
		n, methods = cnt.take()
		require.Equal(t, int64(1), n, "TryLock behind a reader and a writer: %v", methods)
		require.Equal(t, revBefore, storeRev(t, admin), "TryRLock or TryLock wrote")

		r2got := doneAsync(t, "RLock", func() error { return r2.RLock(ctx) })
		waitKeys(t, admin, "rwfifo/", 3)
		notWithin(t, r2got, 300*time.Millisecond, "reader behind a waiting writer")
		require.NoError(t, r1.RUnlock(ctx))
		within(t, wgot, testTimeout, "writer after the first reader")
		notWithin(t, r2got, 200*time.Millisecond, "reader while the writer holds")
		require.NoError(t, w.Unlock(ctx))
		within(t, r2got, testTimeout, "reader after the writer")
		require.NoError(t, r2.RUnlock(ctx))
		require.Empty(t, keys(t, admin, "rwfifo/"))
	})
}

// writerAndWaiter has W1, on a session of cli, hold name and W2, on
// another, wait behind it under w2ctx; it returns both and W2's Lock
// result.
func writerAndWaiter(t *testing.T, ctx, w2ctx context.Context, cli *clientv3.Client, name string) (w1, w2 *etcdsync.RWMutex, w2got <-chan error) {
	t.Helper()
	w1 = etcdsync.NewRWMutex(session(t, cli), name)
	require.NoError(t, w1.Lock(ctx))
	w2 = etcdsync.NewRWMutex(session(t, cli), name)
	w2got = async(func() error { return w2.Lock(w2ctx) })
	waitKeys(t, cli, name+"/", 2)
	return w1, w2, w2got
}

// Read holds of one session share one key, counted, whichever values and
// goroutines take them; the last RUnlock deletes it. A write hold of the
// same session waits for them.
func TestRWMutexSessionSharesReadKey(t *testing.T) {
	t.Parallel()
	c, admin, ctx := kitSingleClient(t)
	var cnt counter
	s, a, b := sharers(t, kitClient(t, c, cnt.dial()...), "rwshare")
	require.NoError(t, a.RLock(ctx))
	cnt.take()
	require.NoError(t, b.RLock(ctx))
	require.NoError(t, a.RLock(ctx)) // a second read hold of one value
	require.NoError(t, b.TryRLock(ctx))
	n, methods := cnt.take()
	require.Equal(t, int64(3), n, "3 joins of the session's read hold, one read each: %v", methods)
	require.Len(t, keys(t, admin, "rwshare/"), 1)
	require.Equal(t, a.Key(), b.Key())
	require.Equal(t, a.Rev(), b.Rev())

	w := etcdsync.NewRWMutex(s, "rwshare")
	wgot := doneAsync(t, "Lock", func() error { return w.Lock(ctx) })

	require.NoError(t, b.RUnlock(ctx))
	require.NoError(t, a.RUnlock(ctx))
	require.NoError(t, a.RUnlock(ctx))
	require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased, "a has no read hold left")
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	require.NotEmpty(t, b.Key(), "b still holds a share")
	notWithin(t, wgot, 200*time.Millisecond, "writer of the session while a read share is held")
	require.NoError(t, b.RUnlock(ctx))
	within(t, wgot, testTimeout, "writer after the session's last read share")
	require.Len(t, keys(t, admin, "rwshare/write/"), 1)
	require.Empty(t, keys(t, admin, "rwshare/read/"))
	require.NoError(t, w.Unlock(ctx))
}

// etcd's experimental recipe RWMutex and ours exclude each other on one name,
// both ways.
func TestRWMutexInteropWithRecipe(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	ctx := ctxT(t)
	es := theirSession(t, c.Client(t))
	theirs := recipe.NewRWMutex(es, "rwinterop")
	ours := etcdsync.NewRWMutex(session(t, c.Client(t)), "rwinterop")

	// Their writer holds: our reader and writer wait.
	require.NoError(t, theirs.Lock())
	require.ErrorIs(t, ours.TryRLock(ctx), etcdsync.ErrLocked)
	got := doneAsync(t, "RLock", func() error { return ours.RLock(ctx) })
	notWithin(t, got, 300*time.Millisecond, "our reader while their writer holds")
	require.NoError(t, theirs.Unlock())
	within(t, got, testTimeout, "our reader after their writer")

	// Our reader holds: their reader joins, their writer waits.
	theirReader := recipe.NewRWMutex(es, "rwinterop")
	require.NoError(t, theirReader.RLock())
	twgot := doneAsync(t, "Lock", func() error { return theirs.Lock() })
	notWithin(t, twgot, 300*time.Millisecond, "their writer while readers hold")
	require.NoError(t, theirReader.RUnlock())
	notWithin(t, twgot, 200*time.Millisecond, "their writer while our reader holds")
	require.NoError(t, ours.RUnlock(ctx))
	within(t, twgot, testTimeout, "their writer after our reader")

	// Their writer holds: our writer waits, then holds.
	wgot := doneAsync(t, "Lock", func() error { return ours.Lock(ctx) })
	notWithin(t, wgot, 300*time.Millisecond, "our writer while theirs holds")
	require.NoError(t, theirs.Unlock())
	within(t, wgot, testTimeout, "our writer after theirs")
	require.NoError(t, ours.Unlock(ctx))
}

// A writer's release reaches exactly the readers behind it: the first two
// hold with no RPC, the others with one read each; the readers behind the
// next writer hold only when it goes. N = 10 and 100 readers.
func TestRWMutexHerd(t *testing.T) {
	t.Parallel()
	for _, group := range []int{5, 50} {
		t.Run(fmt.Sprintf("N=%d", 2*group), func(t *testing.T) {
			t.Parallel() // each on its own member
			testRWMutexHerd(t, group)
		})
	}
}

func testRWMutexHerd(t *testing.T, group int) {
	c, admin, ctx := kitSingleClient(t)
	w1 := etcdsync.NewRWMutex(session(t, admin), "rwherd")
	require.NoError(t, w1.Lock(ctx))
	cnt := counter{created: make(chan struct{}, 5*group+16)}
	cli := kitClient(t, c, cnt.dial()...)
	var wg sync.WaitGroup
	readersIn := make(chan *etcdsync.RWMutex, 2*group)
	startReader := func() {
		rw := etcdsync.NewRWMutex(session(t, cli), "rwherd")
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := rw.RLock(ctx); err != nil {
				t.Errorf("RLock: %v", err)
				return
			}
			readersIn <- rw
		}()
	}
	// Each reader queues, and its watches are created, before the next
	// one writes: none is created past the reader's enqueue (which would
	// make it read the gap, at any moment, the release's included). The
	// first two readers behind the first writer watch the prefix (the
	// front of the queue); each other one its own key and its nearest
	// writer's.
	queued := 1
	readers := func(front int) {
		for i := range group {
			startReader()
			queued++
			waitKeys(t, admin, "rwherd/", queued)
			watches := 2 // its own key and its nearest writer's
			if i < front {
				watches = 1 // the prefix
			}
			for range watches {
				within(t, cnt.created, testTimeout, "reader's watch created")
			}
		}
	}
	readers(2)
	w2 := etcdsync.NewRWMutex(session(t, admin), "rwherd")
	w2got := doneAsync(t, "Lock", func() error { return w2.Lock(ctx) })
	queued++
	waitKeys(t, admin, "rwherd/", queued)
	readers(0)
	cnt.take()
	events := cnt.events.Load()
	require.NoError(t, w1.Unlock(ctx))
	var first []*etcdsync.RWMutex
	for range group {
		select {
		case rw := <-readersIn:
			first = append(first, rw)
		case <-time.After(testTimeout):
			t.Fatal("readers behind the first writer did not all hold")
		}
	}
	time.Sleep(50 * time.Millisecond) // an event to the second group would have come with the first's
	// The release reaches the readers it lets in, no other.
	require.Equal(t, int64(group), cnt.events.Load()-events, "events of the first writer's release")
	// The first two take their turn on the event; each other one reads its
	// key once (one transaction), twice when its serializable read came
	// back from before the delete (etcd sends a write's events before its
	// revision is visible to reads; a loaded machine widens that window),
	// then linearizable.
	n, methods := cnt.take()
	require.GreaterOrEqual(t, n, int64(group-2), "RPCs of readers after the first writer's release: %v", methods)
	require.LessOrEqual(t, n, int64(2*(group-2)), "RPCs of readers after the first writer's release: %v", methods)
	for _, m := range methods {
		require.Equal(t, "/etcdserverpb.KV/Txn", m)
	}
	for _, rw := range first {
		require.NoError(t, rw.RUnlock(ctx))
	}
	within(t, w2got, testTimeout, "second writer after the first readers")
	time.Sleep(100 * time.Millisecond) // a reader behind the second writer would be in by now
	require.Zero(t, len(readersIn), "readers behind the second writer hold while it does")
	require.NoError(t, w2.Unlock(ctx))
	wg.Wait()
	close(readersIn)
	for rw := range readersIn {
		require.NoError(t, rw.RUnlock(ctx))
	}
	require.Empty(t, keys(t, admin, "rwherd/"))
}

// Readers queued behind a held writer hear of waiters that come and go
// behind them only at the front (design, "No herd behind a writer"): the
// first two readers watch the whole prefix, every other one its own key
// and the writer, so a give-up behind them (its key's delete) reaches two
// readers, not all 20 (before, every reader behind one writer watched the
// prefix: 20 events per give-up). Fifteen waiters (ten writers, five
// readers) queue behind the readers on another client, and give up newest
// first; then the writer's release lets the 20 in, and no key is left.
func TestRWMutexGiveUpsBehindQueuedReadersReachOnlyTheFrontTwo(t *testing.T) {
	t.Parallel()
	c, admin, ctx := kitSingleClient(t)
	const name, prefix = "rwgiveup", "rwgiveup/"
	const readers, quitters = 20, 15
	w := etcdsync.NewRWMutex(session(t, admin), name)
	require.NoError(t, w.Lock(ctx))
	cnt := counter{created: make(chan struct{}, 2*readers+16)}
	cli := kitClient(t, c, cnt.dial()...)
	in := make(chan *etcdsync.RWMutex, readers)
	for i := range readers {
		rw := etcdsync.NewRWMutex(session(t, cli), name)
		go func() {
			if err := rw.RLock(ctx); err != nil {
				t.Errorf("reader %d: %v", i, err)
				return
			}
			in <- rw
		}()
		// Queued, and in its watches, before the next key is written.
		waitKeys(t, admin, prefix, 2+i)
		for range 1 + min(1, i/2) { // the prefix, or its own key and the writer's
			within(t, cnt.created, testTimeout, fmt.Sprintf("reader %d's watch created", i))
		}
	}
	queued := 1 + readers
	giveUps := make([]func(), quitters)
	for j := range giveUps {
		q := etcdsync.NewRWMutex(session(t, admin), name)
		acquire := q.Lock
		if j%3 == 2 {
			acquire = q.RLock
		}
		giveUps[j] = queueToGiveUp(t, admin, prefix, queued+j+1, acquire)
	}
	events := cnt.events.Load()
	giveUpNewestFirst(t, admin, prefix, queued, giveUps)
	// Nothing else is deleted under the name meanwhile, and a reader's
	// watch of the prefix sees deletes alone: no slack.
	heardAtMost(t, &cnt, events, 2*quitters, 2*quitters,
		fmt.Sprintf("%d give-ups behind %d readers, heard by the first two alone", quitters, readers))

	require.NoError(t, w.Unlock(ctx))
	for i := range readers {
		select {
		case rw := <-in:
			require.NoError(t, rw.RUnlock(ctx))
		case <-time.After(testTimeout):
			t.Fatalf("%d of %d readers hold after the writer's release", i, readers)
		}
	}
	require.Empty(t, keys(t, admin, prefix))
}

// A writer behind readers that hold together, and release in any order:
// it must learn where it stands before the last of them releases, so that
// the last release hands it the lock with no RPC (as the handoff between
// writers does). Here the readers release newest first: a writer that
// watches only its third key ahead (the oldest reader, a Mutex's rule:
// keys ahead go oldest first) hears nothing until the last release, and
// then reads on the critical path.
func TestWriterBehindReadersReleasingInAnyOrderTakesItsTurnWithNoRPC(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "rwanyorder"
	rs := make([]*etcdsync.RWMutex, 3)
	for i := range rs {
		rs[i] = etcdsync.NewRWMutex(session(t, admin), name)
		require.NoError(t, rs[i].RLock(ctx))
	}
	cnt := counter{created: make(chan struct{}, 16)}
	w := etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
	wgot := async(func() error { return w.Lock(ctx) })
	awaitCreated(t, cnt.created, 3, testTimeout, "the writer's watches (its own key, the two oldest readers')")
	var releases []func() error
	for _, r := range rs {
		releases = append(releases, func() error { return r.RUnlock(ctx) })
	}
	releasedInAnyOrder(t, &cnt, releases, wgot, "the writer")
	require.NoError(t, w.Unlock(ctx))
}

// Bad input is an error wrapping a sentinel, and leaves nothing in etcd;
// cancels at any moment leave no key; a waiter whose key vanishes returns
// ErrSessionExpired at once.
func TestRWMutexErrorsAndLeftovers(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	require.ErrorIs(t, etcdsync.NewRWMutex(nil, "x").RLock(ctx), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "").Lock(ctx), etcdsync.ErrInvalidName)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "a\x00b").TryRLock(ctx), etcdsync.ErrInvalidName)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "rwerr").RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, etcdsync.NewRWMutex(s, "rwerr").Unlock(ctx), etcdsync.ErrLockReleased)
	resp, err := cli.Get(ctx, "", clientv3.WithFromKey(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)

	w := etcdsync.NewRWMutex(session(t, cli), "rwleft")
	require.NoError(t, w.Lock(ctx))
	held := w.Key()
	rw := etcdsync.NewRWMutex(s, "rwleft")
	cancelsLeaveOnly(t, ctx, cli, "rwleft/", held, 60, 12, func(rctx context.Context, i int) error {
		if i%2 == 0 {
			return rw.RLock(rctx)
		}
		return rw.Lock(rctx)
	})

	waiterLosesOwnKey(t, ctx, cli, "rwleft/", held, func() error { return rw.RLock(ctx) }, "a reader")
	require.NoError(t, w.Unlock(ctx))
	require.Empty(t, keys(t, cli, "rwleft/"))
}

// A writer's release wakes exactly the readers that may now hold (design,
// "Herd-free in the queue length"): the readers behind the next writer get
// no event from it. (They used to watch the first writer too, the "one
// more" key, so each writer's release reached every reader behind the next
// one; readers now watch only their nearest writer.)
func TestReadersWakeOnlyForNearestWriter(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "r12herd"
	w1, w2, w2got := writerAndWaiter(t, ctx, ctx, admin, name)
	cnt := counter{created: make(chan struct{}, 256)}
	cli := c.Client(t, cnt.dial()...)
	const k = 12
	got := make(chan *etcdsync.RWMutex, k)
	for i := 0; i < k; i++ {
		rw := etcdsync.NewRWMutex(session(t, cli), name)
		go func() {
			if err := rw.RLock(ctx); err != nil {
				t.Errorf("RLock: %v", err)
				return
			}
			got <- rw
		}()
		waitKeys(t, admin, name+"/", 3+i)
	}
	for range 2 * k { // own key, W2
		within(t, cnt.created, testTimeout, "reader's watch created")
	}
	require.NoError(t, w1.Unlock(ctx))
	require.NoError(t, resultWithin(t, w2got, testTimeout, "second writer"))
	require.NoError(t, w2.Unlock(ctx))
	for range k {
		select {
		case rw := <-got:
			defer rw.RUnlock(ctx)
		case <-time.After(testTimeout):
			t.Fatal("readers did not hold")
		}
	}
	ev := cnt.events.Load()
	t.Logf("events delivered to %d readers behind the second writer over two writer releases: %d", k, ev)
	require.LessOrEqual(t, ev, int64(k+2), "the first writer's release reached the readers behind the second")
}

// An exact reader watches only its nearest writer W2. When W2 withdraws
// (cancelled Lock) or is deleted by an admin while the older writer W1
// still holds, the reader must keep waiting (no early hold), move to W1,
// and hold once W1 goes (no stuck reader).
func TestExactReaderMovesToOlderWriter(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		for _, how := range []string{"cancel", "admin-delete"} {
			t.Run(how, func(t *testing.T) {
				admin := c.Client(t)
				ctx := ctxT(t)
				name := "r12bwd-" + how
				w2ctx, w2cancel := context.WithCancel(ctx)
				defer w2cancel()
				w1, _, w2got := writerAndWaiter(t, ctx, w2ctx, admin, name)
				resp, err := admin.Get(ctx, name+"/write/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
				require.NoError(t, err)
				require.Len(t, resp.Kvs, 2)
				w2key := string(resp.Kvs[1].Key)

				cnt := counter{created: make(chan struct{}, 64)}
				r := etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
				rgot := async(func() error { return r.RLock(ctx) })
				awaitCreated(t, cnt.created, 2, testTimeout, "reader's watches (own key, W2)")

				if how == "cancel" {
					w2cancel()
					require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2's cancelled Lock"), context.Canceled)
				} else {
					_, err := admin.Delete(ctx, w2key)
					require.NoError(t, err)
					require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2's deleted Lock"), etcdsync.ErrSessionExpired)
				}
				// The reader reads once and watches W1.
				within(t, cnt.created, testTimeout, "reader's watch of W1 after W2 went")
				notYet(t, rgot, 500*time.Millisecond, "reader while W1 holds")
				require.NoError(t, w1.Unlock(ctx))
				require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1"))
				require.NoError(t, r.RUnlock(ctx))
				require.Empty(t, keys(t, admin, name+"/"))
			})
		}
	})
}

// The first reader behind a writer W2 that gives up while the older writer
// W1 holds is then the first reader behind W1 (no reader lies between
// them): it is at the front, and W1's release hands it its turn with no
// RPC. It used to take W2's going as leaving unknown how many readers lie
// between W1 and it (they were listed), and reread its key on W1's release.
func TestReaderBehindAWithdrawnWriterTakesItsTurnWithNoRPC(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "rwwithdrawn"
	w2ctx, w2cancel := context.WithCancel(ctx)
	defer w2cancel()
	w1, _, w2got := writerAndWaiter(t, ctx, w2ctx, admin, name)
	cnt := counter{created: make(chan struct{}, 64)}
	r := etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
	rgot := async(func() error { return r.RLock(ctx) })
	awaitCreated(t, cnt.created, 2, testTimeout, "reader's watches (own key, W2)")
	w2cancel()
	require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2's cancelled Lock"), context.Canceled)
	within(t, cnt.created, testTimeout, "reader's watch after W2 went")
	notYet(t, rgot, 200*time.Millisecond, "reader while W1 holds") // and the reads W2's going causes are done
	turnWithNoRPC(t, &cnt, func() error { return w1.Unlock(ctx) }, rgot, "reader after W1")
	require.NoError(t, r.RUnlock(ctx))
}

// Writers ahead of a waiting reader removed in one revision (a prefix
// delete of NAME/write/, or a transaction deleting both): the reader holds
// and a writer behind it waits for it. And the older writer deleted alone
// (the reader does not watch it): the reader keeps waiting for W2, which now
// holds, then holds after W2.
func TestExactReaderHoldsWhenWritersGoTogether(t *testing.T) {
	t.Parallel()
	clusters(t, func(t *testing.T, c *etcdtest.Cluster) {
		admin := c.Client(t)
		setup := func(t *testing.T, name string) (w1, w2 *etcdsync.RWMutex, w2got <-chan error, r *etcdsync.RWMutex, rgot <-chan error) {
			ctx := ctxT(t)
			w1, w2, w2got = writerAndWaiter(t, ctx, ctx, admin, name)
			cnt := counter{created: make(chan struct{}, 64)}
			r = etcdsync.NewRWMutex(session(t, c.Client(t, cnt.dial()...)), name)
			rgot = async(func() error { return r.RLock(ctx) })
			awaitCreated(t, cnt.created, 2, testTimeout, "reader's watches")
			return
		}
		t.Run("prefix", func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12bpfx"
			_, _, w2got, r, rgot := setup(t, name)
			w3 := etcdsync.NewRWMutex(session(t, admin), name)
			w3got := async(func() error { return w3.Lock(ctx) })
			waitKeys(t, admin, name+"/", 4)
			// W1, W2 and W3 in one revision: the reader holds.
			_, err := admin.Delete(ctx, name+"/write/", clientv3.WithPrefix())
			require.NoError(t, err)
			require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2"), etcdsync.ErrSessionExpired)
			require.ErrorIs(t, resultWithin(t, w3got, testTimeout, "W3"), etcdsync.ErrSessionExpired)
			require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after its writers went in one revision"))
			require.NoError(t, r.RUnlock(ctx))
		})
		t.Run("txn-both-and-writer-behind", func(t *testing.T) {
			ctx := ctxT(t)
			name := "r12btxn"
			w1, _, w2got, r, rgot := setup(t, name)
			w3 := etcdsync.NewRWMutex(session(t, admin), name)
			w3got := async(func() error { return w3.Lock(ctx) })
			waitKeys(t, admin, name+"/", 4)
			// delete W1 and W2 only (the writers before the reader)
			resp, err := admin.Get(ctx, name+"/write/", clientv3.WithPrefix(), clientv3.WithSort(clientv3.SortByCreateRevision, clientv3.SortAscend))
			require.NoError(t, err)
			_, err = admin.Txn(ctx).Then(clientv3.OpDelete(string(resp.Kvs[0].Key)), clientv3.OpDelete(string(resp.Kvs[1].Key))).Commit()
			require.NoError(t, err)
			require.ErrorIs(t, resultWithin(t, w2got, testTimeout, "W2"), etcdsync.ErrSessionExpired)
			require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W1 and W2 went in one revision"))
			notYet(t, w3got, 300*time.Millisecond, "W3 while the reader holds")
			require.NoError(t, r.RUnlock(ctx))
			require.NoError(t, resultWithin(t, w3got, testTimeout, "W3 after the reader"))
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
			require.NoError(t, resultWithin(t, w2got, testTimeout, "W2 after W1's key went"))
			notYet(t, rgot, 500*time.Millisecond, "reader while W2 holds")
			require.NoError(t, w2.Unlock(ctx))
			require.NoError(t, resultWithin(t, rgot, testTimeout, "reader after W2"))
			require.NoError(t, r.RUnlock(ctx))
			require.Empty(t, keys(t, admin, name+"/"))
		})
	})
}

// No expired waiter is served: a writer and a reader whose leases end while
// they wait, the holder releasing right after, return ErrSessionExpired and
// never hold; the writer queued behind them holds alone (etcd-io/etcd#16221:
// etcd's recipe RWMutex, in the same sequence, returns from the expired
// writer's Lock with no error and no key, and from the next writer's too:
// two writers "hold" at once).
func TestRWMutexExpiredWaiterNeverHolds(t *testing.T) {
	t.Parallel()
	c := single(t)
	cli := c.Client(t)
	ctx := ctxT(t)
	const name = "rw-expired"
	holder := etcdsync.NewRWMutex(session(t, cli), name)
	require.NoError(t, holder.Lock(ctx))
	ws, rs := session(t, cli), session(t, cli)
	w, r := etcdsync.NewRWMutex(ws, name), etcdsync.NewRWMutex(rs, name)
	wgot := async(func() error { return w.Lock(ctx) })
	waitKeys(t, cli, name+"/", 2)
	rgot := async(func() error { return r.RLock(ctx) })
	waitKeys(t, cli, name+"/", 3)
	next := etcdsync.NewRWMutex(session(t, cli), name)
	ngot := async(func() error { return next.Lock(ctx) })
	waitKeys(t, cli, name+"/", 4)

	for _, s := range []*etcdsync.Session{ws, rs} { // their leases end (expired, or revoked)
		_, err := cli.Revoke(ctx, s.Lease())
		require.NoError(t, err)
	}
	require.NoError(t, holder.Unlock(ctx)) // and the holder goes right after
	require.ErrorIs(t, resultWithin(t, wgot, testTimeout, "the writer whose lease ended"), etcdsync.ErrSessionExpired)
	require.ErrorIs(t, resultWithin(t, rgot, testTimeout, "the reader whose lease ended"), etcdsync.ErrSessionExpired)
	require.NoError(t, resultWithin(t, ngot, testTimeout, "the writer behind them"))
	require.Equal(t, []string{next.Key()}, keys(t, cli, name+"/"))
	require.NoError(t, next.Unlock(ctx))

	// etcd's recipe RWMutex in the same sequence (writers only).
	const theirs = "rw-expired-etcd"
	eholder := recipe.NewRWMutex(theirSession(t, cli), theirs)
	require.NoError(t, eholder.Lock())
	es := theirSession(t, cli)
	ew := recipe.NewRWMutex(es, theirs)
	ewgot := async(ew.Lock)
	waitKeys(t, cli, theirs+"/", 2)
	enext := recipe.NewRWMutex(theirSession(t, cli), theirs)
	engot := async(enext.Lock)
	waitKeys(t, cli, theirs+"/", 3)
	_, err := cli.Revoke(ctx, es.Lease())
	require.NoError(t, err)
	require.NoError(t, eholder.Unlock())
	require.NoError(t, resultWithin(t, ewgot, testTimeout, "etcd's writer whose lease ended"), "etcd's recipe: the expired writer 'holds'")
	require.NoError(t, resultWithin(t, engot, testTimeout, "etcd's writer behind it"), "etcd's recipe: the next writer holds too")
	require.Len(t, keys(t, cli, theirs+"/"), 1, "two writers returned from Lock, one key")
	require.NoError(t, enext.Unlock())
}

// sharers returns a new session of cli and two RWMutex values of it on
// name: values that share the session's read hold.
func sharers(t *testing.T, cli *clientv3.Client, name string, opts ...etcdsync.SessionOption) (*etcdsync.Session, *etcdsync.RWMutex, *etcdsync.RWMutex) {
	s := session(t, cli, opts...)
	return s, etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
}

// A value that joins the session's read hold trusts it without an RPC:
// when that key was deleted (by an admin, say) and a writer now holds, a
// new RLock must not return as if it held a read beside the writer.
func TestRLockDoesNotJoinDeletedReadHold(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	_, a, b := sharers(t, c.Client(t), "r12join")
	require.NoError(t, a.RLock(ctx))
	_, err := admin.Delete(ctx, a.Key())
	require.NoError(t, err)
	w := etcdsync.NewRWMutex(session(t, admin), "r12join")
	wctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	require.NoError(t, w.Lock(wctx), "the writer, once the read key is gone")
	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	err = b.RLock(rctx)
	if err == nil {
		t.Errorf("RLock returned nil (joined %s at %d, deleted) while writer %s holds", b.Key(), b.Rev(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// TryRLock with no writer anywhere returns ErrLocked while the session's
// own read acquire or last RUnlock is in flight, as documented (it sends
// nothing then), and succeeds once that call has returned.
func TestTryRLockRefusedWhileShareInFlight(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	_, a, b := sharers(t, cli, "r12tryfl")

	t.Run("acquire", func(t *testing.T) {
		p.SetLatency(time.Second)
		agot := async(func() error { return a.RLock(ctx) })
		waitKeys(t, admin, "r12tryfl/read/", 1) // applied; its reply is on the way
		err := b.TryRLock(ctx)
		require.NoError(t, resultWithin(t, agot, testTimeout, "RLock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's RLock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	t.Run("release", func(t *testing.T) {
		p.SetLatency(time.Second)
		ugot := async(func() error { return a.RUnlock(ctx) })
		waitNoKeys(t, admin, "r12tryfl/")
		err := b.TryRLock(ctx)
		require.NoError(t, resultWithin(t, ugot, testTimeout, "RUnlock"))
		p.SetLatency(0)
		require.ErrorIs(t, err, etcdsync.ErrLocked, "TryRLock while the session's last RUnlock is in flight")
		require.NoError(t, b.TryRLock(ctx), "TryRLock once it has returned")
		require.NoError(t, b.RUnlock(ctx))
	})
	p.SetLatency(0)
}

// An RUnlock whose reply is lost (its deadline ends after the server
// applied the delete) keeps the hold, as documented, and lets the session's
// other values join it again. The key is gone and a writer of another
// session holds, yet a new RLock of the session returns at once, without an
// RPC, as if it held a read: a reader and a writer hold together, and the
// reader's call said nothing was wrong.
func TestRLockDoesNotJoinAfterLostRUnlockReply(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	defer p.SetLatency(0)
	_, a, b := sharers(t, cli, "r12rejoin", etcdsync.WithTTL(30*time.Second))
	require.NoError(t, a.RLock(ctx))
	w := etcdsync.NewRWMutex(session(t, admin), "r12rejoin")
	wgot := async(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12rejoin/", 2)

	p.SetLatency(time.Second) // replies only: the delete is applied
	uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	err := a.RUnlock(uctx)
	cancel()
	require.Error(t, err, "RUnlock whose reply came after its deadline")
	require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the read key's delete"))
	p.SetLatency(0)

	rctx, rcancel := context.WithTimeout(ctx, time.Second)
	defer rcancel()
	if err := b.RLock(rctx); err == nil {
		t.Errorf("RLock returned nil (joined %s, deleted) while writer %s holds", b.Key(), w.Key())
	}
	require.NoError(t, w.Unlock(ctx))
}

// A join while the session's last read share is releasing waits for the
// release, and then queues a new key behind the writer that was waiting.
func TestRLockJoinWaitsForReleasingShare(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	cli, p := faults.Proxied(t, c)
	defer p.SetLatency(0)
	_, a, b := sharers(t, cli, "r12closing", etcdsync.WithTTL(30*time.Second))
	require.NoError(t, a.RLock(ctx))
	oldRev := a.Rev()
	w := etcdsync.NewRWMutex(session(t, admin), "r12closing")
	wgot := async(func() error { return w.Lock(ctx) })
	waitKeys(t, admin, "r12closing/", 2)

	p.SetLatency(time.Second)
	ugot := async(func() error { return a.RUnlock(ctx) })
	waitNoKeys(t, admin, "r12closing/read/")
	bgot := async(func() error { return b.RLock(ctx) })
	require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the read key's delete"))
	require.NoError(t, resultWithin(t, ugot, testTimeout, "RUnlock"))
	p.SetLatency(0)
	notYet(t, bgot, 500*time.Millisecond, "RLock joined while the writer holds")
	require.NoError(t, w.Unlock(ctx))
	require.NoError(t, resultWithin(t, bgot, testTimeout, "RLock after the writer"))
	require.Greater(t, b.Rev(), oldRev, "a new read key")
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	require.NoError(t, b.RUnlock(ctx))
	require.Empty(t, keys(t, admin, "r12closing/"))
}

// The session ends while two values share its read hold: both see it
// (Done closed, Err wraps ErrSessionClosed), and RUnlock says not held.
func TestSessionEndEndsEveryReadShare(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	s, a, b := sharers(t, c.Client(t), "r12end")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	ad := a.Done()
	require.NoError(t, s.Close())
	within(t, ad, testTimeout, "a's Done")
	within(t, b.Done(), testTimeout, "b's Done")
	require.ErrorIs(t, a.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, b.Err(), etcdsync.ErrSessionClosed)
	require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RUnlock(ctx), etcdsync.ErrLockReleased)
	require.ErrorIs(t, b.RLock(ctx), etcdsync.ErrSessionClosed)
	require.Empty(t, keys(t, admin, "r12end/"))
}

// Shares of one value and of two values released in every order, an
// RUnlock that fails before sending (ended ctx) keeps the share; Done and
// Err follow each value's own shares.
func TestReadSharesCountedPerValue(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	_, a, b := sharers(t, c.Client(t), "r12count")
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, a.RLock(ctx))
	require.NoError(t, b.RLock(ctx))
	bd := b.Done()
	require.NoError(t, a.RUnlock(ctx))
	require.NoError(t, a.RUnlock(ctx))
	require.ErrorIs(t, a.Err(), etcdsync.ErrLockReleased)
	select {
	case <-a.Done():
	default:
		t.Error("a's Done open after its last share")
	}
	require.NoError(t, b.Err())
	select {
	case <-bd:
		t.Fatal("b's Done closed while it holds")
	default:
	}
	dead, cancel := context.WithCancel(ctx)
	cancel()
	require.Error(t, b.RUnlock(dead))
	require.NoError(t, b.Err(), "a release that sent nothing keeps the share")
	require.Len(t, keys(t, admin, "r12count/read/"), 1)
	require.NoError(t, b.RUnlock(ctx))
	within(t, bd, testTimeout, "b's Done after its release")
	require.ErrorIs(t, b.Err(), etcdsync.ErrLockReleased)
	require.Empty(t, keys(t, admin, "r12count/"))
}

// Many goroutines on two values of one session take and release read
// holds while writers of other sessions come and go: no overlap, nothing
// left.
func TestSharedReadHoldsUnderStress(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var x rwCheck
	s := session(t, c.Client(t))
	vals := []*etcdsync.RWMutex{etcdsync.NewRWMutex(s, "r12stress"), etcdsync.NewRWMutex(s, "r12stress")}
	var wg sync.WaitGroup
	for g := 0; g < 6; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := vals[g%2]
			for i := 0; i < 8; i++ {
				if err := rw.RLock(ctx); err != nil {
					t.Errorf("RLock: %v", err)
					return
				}
				x.read(t)
				time.Sleep(time.Millisecond)
				x.readers.Add(-1)
				if err := rw.RUnlock(ctx); err != nil {
					t.Errorf("RUnlock: %v", err)
					return
				}
			}
		}()
	}
	for g := 0; g < 2; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "r12stress")
			for i := 0; i < 5; i++ {
				if err := rw.Lock(ctx); err != nil {
					t.Errorf("Lock: %v", err)
					return
				}
				x.write(t, rw.Rev())
				time.Sleep(time.Millisecond)
				x.writers.Add(-1)
				if err := rw.Unlock(ctx); err != nil {
					t.Errorf("Unlock: %v", err)
					return
				}
			}
		}()
	}
	wg.Wait()
	require.Empty(t, keys(t, admin, "r12stress/"))
}

// A last RUnlock whose request is stalled (a partition) fails on its
// deadline; the stalled delete may be applied when the link heals, or not.
// Either way: another value of the session must not join the kept hold,
// must not hold while a writer of another session holds, and gets a fresh
// key once the old hold is gone (by the late delete, or by a retry of the
// RUnlock); a third value then joins that fresh hold.
func TestKeptReadHoldNotJoinedUntilGone(t *testing.T) {
	etcdtest.SkipSlowInShort(t)
	t.Parallel()
	for i := range 3 {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			c, admin, ctx := singleClient(t)
			cli, p := faults.Proxied(t, c)
			defer p.Blackhole(false)
			name := "r12bkept"
			s := session(t, cli, etcdsync.WithTTL(30*time.Second))
			a, b, d := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			old := a.Rev()
			w := etcdsync.NewRWMutex(session(t, admin), name)
			wgot := async(func() error { return w.Lock(ctx) })
			waitKeys(t, admin, name+"/", 2)

			p.Blackhole(true)
			uctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			err := a.RUnlock(uctx)
			cancel()
			require.Error(t, err, "RUnlock through a partition")
			require.NoError(t, a.Err(), "a failed RUnlock keeps the hold")
			bgot := async(func() error { return b.RLock(ctx) })
			notYet(t, bgot, 300*time.Millisecond, "RLock joined a hold whose release may commit")
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
				notYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
				require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased, "retry after a delete that committed")
			} else {
				// the retry deletes the key, or finds it deleted by a delete applied later still
				if err := a.RUnlock(ctx); err != nil {
					require.ErrorIs(t, err, etcdsync.ErrLockReleased, "retry of the RUnlock")
				}
				require.NoError(t, resultWithin(t, wgot, testTimeout, "writer after the retry"))
				notYet(t, bgot, 500*time.Millisecond, "b's RLock while the writer holds")
			}
			require.NoError(t, w.Unlock(ctx))
			require.NoError(t, resultWithin(t, bgot, testTimeout, "b's RLock after the writer"))
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
func TestRLockJoinSeesDeletedReadKey(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for i := range 8 {
		ctx := ctxT(t)
		name := fmt.Sprintf("r12bjrace%d", i)
		_, a, b := sharers(t, c.Client(t), name)
		require.NoError(t, a.RLock(ctx))
		old := a.Rev()
		ad := a.Done()
		w := etcdsync.NewRWMutex(session(t, admin), name)
		wgot := async(func() error { return w.Lock(ctx) })
		waitKeys(t, admin, name+"/", 2)
		_, err := admin.Delete(ctx, a.Key())
		require.NoError(t, err)
		bgot := async(func() error { return b.RLock(ctx) })
		require.NoError(t, resultWithin(t, wgot, testTimeout, "writer"))
		within(t, ad, testTimeout, "a's Done after its key's delete")
		notYet(t, bgot, 200*time.Millisecond, "b joined a deleted read key")
		require.NoError(t, w.Unlock(ctx))
		require.NoError(t, resultWithin(t, bgot, testTimeout, "b after the writer"))
		require.Greater(t, b.Rev(), old)
		require.NoError(t, b.RUnlock(ctx))
		require.ErrorIs(t, a.RUnlock(ctx), etcdsync.ErrLockReleased)
		require.Empty(t, keys(t, admin, name+"/"))
	}
}

// The session ends while a value waits in shareKey: (1) behind the
// session's last RUnlock in flight (stalled by a partition), (2) while its
// join read is in flight on a slow link, (3) while its join read is stalled
// by a partition (the session ends as a partitioned one does, here by
// Orphan). RLock's contract: it returns when ctx ends or the session ends
// (ErrSessionExpired); so within a bound, with an error, never nil.
func TestRLockJoinEndsWithSession(t *testing.T) {
	t.Parallel()
	c := single(t)
	admin := c.Client(t)
	for _, tc := range []string{"waiting", "reading-slow", "reading-partitioned"} {
		t.Run(tc, func(t *testing.T) {
			ctx := ctxT(t)
			cli, p, sent := faults.SentClient(t, c)
			defer p.Blackhole(false)
			defer p.SetLatency(0)
			s, err := etcdsync.NewSession(cli, etcdsync.WithTTL(30*time.Second))
			require.NoError(t, err)
			name := "r12bsend-" + tc
			a, b := etcdsync.NewRWMutex(s, name), etcdsync.NewRWMutex(s, name)
			require.NoError(t, a.RLock(ctx))
			faults.DrainSent(sent)
			var bgot <-chan error
			switch tc {
			case "waiting":
				p.Blackhole(true)
				async(func() error { return a.RUnlock(ctx) })
				faults.AwaitSent(t, sent, faults.TxnMethod)
				bgot = async(func() error { return b.RLock(ctx) })
				notYet(t, bgot, 200*time.Millisecond, "b joined a closing hold")
			case "reading-slow":
				p.SetLatency(time.Second)
				bgot = async(func() error { return b.RLock(ctx) })
				faults.AwaitSent(t, sent, faults.RangeMethod)
			case "reading-partitioned":
				p.Blackhole(true)
				bgot = async(func() error { return b.RLock(ctx) })
				faults.AwaitSent(t, sent, faults.RangeMethod)
			}
			orphaned := make(chan struct{})
			go func() { s.Orphan(); close(orphaned) }()
			within(t, orphaned, testTimeout, "Orphan")
			require.ErrorIs(t, resultWithin(t, bgot, 3*time.Second, "b's RLock after the session ended"), etcdsync.ErrSessionClosed)
			p.Blackhole(false)
			p.SetLatency(0)
			_, err = admin.Revoke(ctx, s.Lease())
			require.NoError(t, err)
		})
	}
}

// A Mutex on NAME/read of a session writes NAME/read/<lease>: the very key
// of that session's RWMutex read holds on NAME. An RLock of the session
// must not join the Mutex's hold as if it were a shared read hold: its
// RUnlock would then delete the Mutex's key (the Mutex silently loses its
// lock). Keys of one session are claimed locally, so the RLock must wait
// for the Mutex (or fail), and the Mutex must keep its hold.
func TestRLockDoesNotJoinMutexHold(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
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

// Readers and writers under contention: never a writer with anyone else.
func TestRWMutexMixedContentionExcludes(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	var readers, writers atomic.Int32
	var wg sync.WaitGroup
	for i := range 6 {
		rw := etcdsync.NewRWMutex(session(t, c.Client(t)), "rwc")
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range 12 {
				if (i+r)%3 == 0 {
					if err := rw.Lock(ctx); err != nil {
						t.Errorf("Lock: %v", err)
						return
					}
					if w := writers.Add(1); w != 1 || readers.Load() != 0 {
						t.Errorf("writer %d round %d with %d writers and %d readers", i, r, w, readers.Load())
					}
					time.Sleep(time.Millisecond)
					writers.Add(-1)
					if err := rw.Unlock(ctx); err != nil {
						t.Errorf("Unlock: %v", err)
						return
					}
				} else {
					if err := rw.RLock(ctx); err != nil {
						t.Errorf("RLock: %v", err)
						return
					}
					readers.Add(1)
					if writers.Load() != 0 {
						t.Errorf("reader %d round %d with a writer", i, r)
					}
					time.Sleep(time.Millisecond)
					readers.Add(-1)
					if err := rw.RUnlock(ctx); err != nil {
						t.Errorf("RUnlock: %v", err)
						return
					}
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	within(t, done, testTimeout, "rw participants")
	waitNoKeys(t, admin, "rwc/")
}
