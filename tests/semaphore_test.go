package tests

import (
	"context"
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/etcdsync/etcdsync"
	"github.com/etcdsync/etcdsync/etcdsynctest"
	"github.com/etcdsync/etcdsync/internal/etcdtest"
	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// Never more permits held than the capacity, with weighted requests from
// sessions, values on one session and goroutines sharing a value; several
// holders at once do happen.
func TestSemaphoreExclusion(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		const capacity, rounds = 3, 5
		var inUse, most atomic.Int64
		var mu sync.Mutex
		var lastRev int64
		var wg sync.WaitGroup
		work := func(sm *etcdsync.Semaphore, id int) {
			defer wg.Done()
			for i := 0; i < rounds; i++ {
				n := int64((i+id)%capacity + 1)
				if err := sm.Acquire(ctx, n); err != nil {
					t.Errorf("Acquire(%d): %v", n, err)
					return
				}
				mu.Lock()
				if sm.Rev() <= lastRev && n == capacity {
					t.Errorf("a full hold's token %d after %d", sm.Rev(), lastRev)
				}
				lastRev = max(lastRev, sm.Rev())
				mu.Unlock()
				u := inUse.Add(n)
				if u > capacity {
					t.Errorf("%d permits in use, capacity %d", u, capacity)
				}
				for m := most.Load(); u > m && !most.CompareAndSwap(m, u); m = most.Load() {
				}
				time.Sleep(2 * time.Millisecond)
				inUse.Add(-n)
				if err := sm.Release(ctx); err != nil {
					t.Errorf("Release: %v", err)
					return
				}
			}
		}
		shared := session(t, c.Client(t))
		sharedValue := etcdsync.NewSemaphore(shared, "semx", capacity)
		for i := 0; i < 3; i++ {
			wg.Add(3)
			go work(etcdsync.NewSemaphore(session(t, c.Client(t)), "semx", capacity), 3*i)
			go work(etcdsync.NewSemaphore(shared, "semx", capacity), 3*i+1)
			go work(sharedValue, 3*i+2)
		}
		wg.Wait()
		require.Empty(t, keys(t, c.Client(t), "semx/"))
		t.Logf("most permits in use at once: %d", most.Load())
	})
}

// Holders of 1 permit each hold at once up to the capacity.
func TestSemaphoreHoldersTogether(t *testing.T) {
	t.Parallel()
	c := kitSingle(t)
	ctx := ctxT(t)
	const capacity = 3
	holdTogether(t, capacity, func() (func() error, func() error) {
		sm := etcdsync.NewSemaphore(session(t, c.Client(t)), "semtogether", capacity)
		return func() error { return sm.Acquire(ctx, 1) }, func() error { return sm.Release(ctx) }
	})
}

// FIFO: a large request blocks later small ones although permits are free;
// TryAcquire then fails in one RPC without writing.
func TestSemaphoreFIFO(t *testing.T) {
	t.Parallel()
	kitClusters(t, func(t *testing.T, c *etcdsynctest.Cluster) {
		ctx := ctxT(t)
		admin := c.Client(t)
		a := etcdsync.NewSemaphore(session(t, admin), "semfifo", 3)
		require.NoError(t, a.Acquire(ctx, 1))
		big := etcdsync.NewSemaphore(session(t, admin), "semfifo", 3)
		bigGot := doneAsync(t, "Acquire", func() error { return big.Acquire(ctx, 3) })
		waitKeys(t, admin, "semfifo/", 2)

		var cnt counter
		small := etcdsync.NewSemaphore(session(t, kitClient(t, c, cnt.dial()...)), "semfifo", 3)
		cnt.take()
		before := storeRev(t, admin)
		require.ErrorIs(t, small.TryAcquire(ctx, 1), etcdsync.ErrLocked)
		n, methods := cnt.take()
		require.Equal(t, int64(1), n, "TryAcquire behind a waiter: %v", methods)
		require.Equal(t, before, storeRev(t, admin), "TryAcquire wrote")

		smallGot := doneAsync(t, "Acquire", func() error { return small.Acquire(ctx, 1) })
		waitKeys(t, admin, "semfifo/", 3)
		notWithin(t, smallGot, 300*time.Millisecond, "a small request behind a waiting large one")
		require.NoError(t, a.Release(ctx))
		within(t, bigGot, testTimeout, "the large request once all permits are free")
		notWithin(t, smallGot, 200*time.Millisecond, "a small request while the large one holds all")
		require.NoError(t, big.Release(ctx))
		within(t, smallGot, testTimeout, "the small request after the large one")
		require.NoError(t, small.Release(ctx))

		// TryAcquire with permits free and nobody waiting: two RPCs.
		require.NoError(t, a.Acquire(ctx, 1))
		cnt.take()
		require.NoError(t, small.TryAcquire(ctx, 2))
		n, methods = cnt.take()
		require.Equal(t, int64(2), n, "TryAcquire of free permits beside a holder: %v", methods)
		require.ErrorIs(t, big.TryAcquire(ctx, 1), etcdsync.ErrLocked)
		require.NoError(t, small.Release(ctx))
		require.NoError(t, a.Release(ctx))
		require.Empty(t, keys(t, admin, "semfifo/"))
	})
}

// Whatever order holders release in, waiters hold as soon as the permits
// allow, and a release reaches O(capacity) waiters, not all of them. N = 10
// and 100 waiters.
func TestSemaphoreReleaseOrderAndHerd(t *testing.T) {
	t.Parallel()
	for _, n := range []int{10, 100} {
		t.Run(fmt.Sprintf("N=%d", n), func(t *testing.T) { testSemaphoreHerd(t, n) })
	}
}

func testSemaphoreHerd(t *testing.T, waiters int) {
	c, admin, ctx := kitSingleClient(t)
	const capacity = 3
	holders, ws, got, cnt := semaphoreQueue(t, ctx, c, admin, "semherd", capacity, waiters)
	events := cnt.events.Load()
	// Release the holders newest first: the first waiter holds at the
	// first release although it does not wait for that key alone.
	releaseNewestFirst(t, ctx, holders, got)
	require.LessOrEqual(t, cnt.events.Load()-events, int64(capacity*(capacity+1)), "events for %d releases", capacity)
	// The rest hand over one by one, in order.
	releaseInOrder(t, ctx, ws, got, capacity)
	require.Empty(t, keys(t, admin, "semherd/"))
}

// semaphoreQueue has capacity holders on admin take one permit each of a
// Semaphore on name, then queues n waiters for one permit each on a
// counted client, in order, each in its watches before the next queues:
// the prefix at the front (at most capacity+1 keys ahead), else its own
// key and a run of capacity keys past the nearest two (their permits
// exceed its room of capacity-1). got delivers the number of each waiter
// that holds.
func semaphoreQueue(t *testing.T, ctx context.Context, c *etcdsynctest.Cluster, admin *clientv3.Client, name string, capacity, n int) (holders, ws []*etcdsync.Semaphore, got chan int, cnt *counter) {
	t.Helper()
	holders = make([]*etcdsync.Semaphore, capacity)
	for i := range holders {
		holders[i] = etcdsync.NewSemaphore(session(t, admin), name, int64(capacity))
		require.NoError(t, holders[i].Acquire(ctx, 1))
	}
	cnt = &counter{created: make(chan struct{}, (capacity+1)*n+16)}
	cli := kitClient(t, c, cnt.dial()...)
	got = make(chan int, n)
	ws = make([]*etcdsync.Semaphore, n)
	for i := range ws {
		ws[i] = etcdsync.NewSemaphore(session(t, cli), name, int64(capacity))
		go func() {
			if err := ws[i].Acquire(ctx, 1); err != nil {
				t.Errorf("waiter %d: %v", i, err)
				return
			}
			got <- i
		}()
		waitKeys(t, admin, name+"/", capacity+i+1) // queue in order
		for range waits(capacity+i, capacity) {
			within(t, cnt.created, testTimeout, fmt.Sprintf("waiter %d's watch created", i))
		}
	}
	return holders, ws, got, cnt
}

// releaseInOrder releases the waiters ws in queue order, holding; each
// release lets in the waiter capacity places behind (got), in FIFO order.
func releaseInOrder(t *testing.T, ctx context.Context, ws []*etcdsync.Semaphore, got <-chan int, capacity int) {
	t.Helper()
	for i := range ws {
		require.NoError(t, ws[i].Release(ctx))
		if i+capacity < len(ws) {
			select {
			case j := <-got:
				require.Equal(t, i+capacity, j, "FIFO")
			case <-time.After(testTimeout):
				t.Fatalf("waiter %d did not hold", i+capacity)
			}
		}
	}
}

// Waiters that queue behind a full Semaphore's waiters and give up reach
// only the front of the queue: each give-up deletes a key behind all 20
// waiters (one permit each, capacity 3 held), and only the first two
// waiters, which watch the whole prefix (at most capacity+1 keys ahead),
// hear it; every other waiter watches a run of keys ahead of it, none
// behind. So at most two events per give-up, not one per waiter. Ten
// waiters of one or two permits queue behind them and give up newest
// first; then the 20 hold in queue order and leave no key.
func TestSemaphoreGiveUpsBehindWaitersReachOnlyTheFrontTwo(t *testing.T) {
	t.Parallel()
	c, admin, ctx := kitSingleClient(t)
	const name, prefix = "semgiveup", "semgiveup/"
	const capacity, n, quitters = 3, 20, 10
	holders, ws, got, cnt := semaphoreQueue(t, ctx, c, admin, name, capacity, n)
	queued := capacity + n
	giveUps := make([]func(), quitters)
	for j := range giveUps {
		q := etcdsync.NewSemaphore(session(t, admin), name, capacity)
		permits := int64(1 + j%2)
		giveUps[j] = queueToGiveUp(t, admin, prefix, queued+j+1, func(ctx context.Context) error { return q.Acquire(ctx, permits) })
	}
	events := cnt.events.Load()
	giveUpNewestFirst(t, admin, prefix, queued, giveUps)
	// Nothing else is deleted under the name meanwhile, and a waiter's
	// watch of the prefix sees deletes alone: no slack.
	heardAtMost(t, cnt, events, 2*quitters, 2*quitters,
		fmt.Sprintf("%d give-ups behind %d waiters, heard by the first two alone", quitters, n))
	releaseNewestFirst(t, ctx, holders, got)
	releaseInOrder(t, ctx, ws, got, capacity)
	require.Empty(t, keys(t, admin, prefix))
}

// releaseNewestFirst releases the holders newest first; each release lets
// in the next waiter (got delivers waiters' numbers), in FIFO order.
func releaseNewestFirst(t *testing.T, ctx context.Context, holders []*etcdsync.Semaphore, got <-chan int) {
	t.Helper()
	for k := len(holders) - 1; k >= 0; k-- {
		require.NoError(t, holders[k].Release(ctx))
		select {
		case i := <-got:
			require.Equal(t, len(holders)-1-k, i, "FIFO")
		case <-time.After(testTimeout):
			t.Fatalf("no waiter held after release %d", len(holders)-k)
		}
	}
}

// Bad input and another capacity: errors wrapping sentinels, no key left.
func TestSemaphoreErrors(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	s := session(t, cli)
	require.ErrorIs(t, etcdsync.NewSemaphore(nil, "x", 1).Acquire(ctx, 1), etcdsync.ErrInvalidArgument)
	require.ErrorIs(t, etcdsync.NewSemaphore(s, "", 1).Acquire(ctx, 1), etcdsync.ErrInvalidName)
	for _, capacity := range []int64{0, -1} {
		require.ErrorIs(t, etcdsync.NewSemaphore(s, "semerr", capacity).Acquire(ctx, 1), etcdsync.ErrInvalidArgument)
	}
	sm := etcdsync.NewSemaphore(s, "semerr", 2)
	for _, n := range []int64{0, -1, 3} {
		require.ErrorIs(t, sm.Acquire(ctx, n), etcdsync.ErrInvalidArgument, "n=%d", n)
		require.ErrorIs(t, sm.TryAcquire(ctx, n), etcdsync.ErrInvalidArgument, "n=%d", n)
	}
	require.ErrorIs(t, sm.Release(ctx), etcdsync.ErrLockReleased)
	resp, err := cli.Get(ctx, "", clientv3.WithFromKey(), clientv3.WithCountOnly())
	require.NoError(t, err)
	require.Zero(t, resp.Count)

	require.NoError(t, sm.Acquire(ctx, 1))
	other := etcdsync.NewSemaphore(session(t, cli), "semerr", 5)
	for _, acquire := range []func(context.Context, int64) error{other.Acquire, other.TryAcquire} {
		err := acquire(ctx, 1)
		require.ErrorIs(t, err, etcdsync.ErrInvalidArgument)
		require.Contains(t, err.Error(), "capacity")
		require.Equal(t, []string{sm.Key()}, keys(t, cli, "semerr/"))
	}
	// A Mutex's key under the name is no semaphore participant.
	require.NoError(t, sm.Release(ctx))
	m := heldMutex(t, ctx, cli, "semerr")
	require.ErrorIs(t, sm.Acquire(ctx, 1), etcdsync.ErrInvalidArgument)
	require.Equal(t, []string{m.Key()}, keys(t, cli, "semerr/"))
	require.NoError(t, m.Unlock(ctx))
}

// Cancels at any moment leave no key; a waiter whose key vanishes returns
// ErrSessionExpired at once.
func TestSemaphoreLeftovers(t *testing.T) {
	t.Parallel()
	_, cli, ctx := kitSingleClient(t)
	holder := etcdsync.NewSemaphore(session(t, cli), "semleft", 2)
	require.NoError(t, holder.Acquire(ctx, 2))
	sm := etcdsync.NewSemaphore(session(t, cli), "semleft", 2)
	cancelsLeaveOnly(t, ctx, cli, "semleft/", holder.Key(), 60, 12, func(rctx context.Context, i int) error { return sm.Acquire(rctx, int64(i%2+1)) })
	waiterLosesOwnKey(t, ctx, cli, "semleft/", holder.Key(), func() error { return sm.Acquire(ctx, 1) }, "a waiter")
	require.NoError(t, holder.Release(ctx))
	require.Empty(t, keys(t, cli, "semleft/"))
}

// Weights summed in int64: with a capacity near MaxInt64 the sum of the
// keys ahead overflows and a waiter holds with a full hold ahead of it.
func TestSemaphoreWeightsSaturate(t *testing.T) {
	t.Parallel()
	_, cli, ctx := singleClient(t)
	const capacity = math.MaxInt64
	const name = "r12overflow"
	a := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	require.NoError(t, a.Acquire(ctx, capacity))
	b := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	bgot := async(func() error { return b.Acquire(ctx, capacity) })
	waitKeys(t, cli, name+"/", 2)
	d := etcdsync.NewSemaphore(session(t, cli), name, capacity)
	dctx, cancel := context.WithCancel(ctx)
	defer cancel()
	dgot := async(func() error { return d.Acquire(dctx, capacity) })
	waitKeys(t, cli, name+"/", 3)
	select {
	case err := <-dgot:
		if err == nil {
			t.Errorf("a third full hold (%s) while the first (%s) holds", d.Key(), a.Key())
			_ = d.Release(ctx)
		}
	case <-time.After(time.Second):
	}
	cancel()
	require.NoError(t, a.Release(ctx))
	require.NoError(t, resultWithin(t, bgot, testTimeout, "second full hold"))
	require.NoError(t, b.Release(ctx))
}

// One Semaphore value, Acquire from two goroutines: one holds, the other
// waits for its Release, then holds at a later revision.
func TestSemaphoreValueExcludesItsGoroutines(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	sm := etcdsync.NewSemaphore(session(t, c.Client(t)), "r12two", 3)
	g1 := async(func() error { return sm.Acquire(ctx, 1) })
	g2 := async(func() error { return sm.Acquire(ctx, 2) })
	var first error
	select {
	case first = <-g1:
	case first = <-g2:
	case <-time.After(testTimeout):
		t.Fatal("neither Acquire returned")
	}
	require.NoError(t, first)
	rev := sm.Rev()
	require.Len(t, keys(t, admin, "r12two/"), 1)
	select {
	case err := <-g2:
		require.NoError(t, err)
		t.Fatal("both Acquires of one value hold")
	case err := <-g1:
		require.NoError(t, err)
		t.Fatal("both Acquires of one value hold")
	case <-time.After(300 * time.Millisecond):
	}
	// whichever is left
	both := make(chan error, 2)
	go func() {
		select {
		case err := <-g1:
			both <- err
		case err := <-g2:
			both <- err
		}
	}()
	require.NoError(t, sm.Release(ctx))
	require.NoError(t, resultWithin(t, both, testTimeout, "second Acquire"))
	require.Greater(t, sm.Rev(), rev)
	require.NoError(t, sm.Release(ctx))
	require.Empty(t, keys(t, admin, "r12two/"))
}

// Weights saturate on the try path too: with capacity MaxInt64 and two
// keys of MaxInt64/2+1 ahead, TryAcquire(1) is ErrLocked, and Acquire(1)
// waits until both are gone.
func TestSemaphoreTryWeightsSaturate(t *testing.T) {
	t.Parallel()
	_, admin, ctx := singleClient(t)
	const capacity = math.MaxInt64
	const half = math.MaxInt64/2 + 1
	name := "r12bsat"
	a := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	require.NoError(t, a.Acquire(ctx, half))
	b := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	bgot := async(func() error { return b.Acquire(ctx, half) })
	waitKeys(t, admin, name+"/", 2)
	d := etcdsync.NewSemaphore(session(t, admin), name, capacity)
	err := d.TryAcquire(ctx, 1)
	if err == nil {
		_ = d.Release(ctx)
	}
	require.ErrorIs(t, err, etcdsync.ErrLocked)
	dgot := async(func() error { return d.Acquire(ctx, capacity-half) })
	notYet(t, dgot, 300*time.Millisecond, "third while the first two (over capacity) are ahead")
	require.NoError(t, a.Release(ctx))
	require.NoError(t, resultWithin(t, bgot, testTimeout, "b"))
	require.NoError(t, b.Release(ctx))
	require.NoError(t, resultWithin(t, dgot, testTimeout, "d"))
	require.NoError(t, d.Release(ctx))
}

// A Semaphore of capacity 3: A(1) and B(1) hold, C asks for 3 and waits, W
// asks for 1 behind C. W keeps B and C of the keys ahead and counts A as
// far (place.keepNearest). When C gives up, W may hold beside A and B
// (1+1+1 <= 3): C's delete alone gives W its turn, so W watches the prefix
// (place.front) and takes the turn on that event with no RPC.
func TestSemaphoreTurnBehindALargeAcquireNeedsNoRead(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	name := "semhet"
	a := etcdsync.NewSemaphore(session(t, admin), name, 3)
	b := etcdsync.NewSemaphore(session(t, admin), name, 3)
	require.NoError(t, a.Acquire(ctx, 1))
	require.NoError(t, b.Acquire(ctx, 1))
	cctx, ccancel := context.WithCancel(ctx)
	defer ccancel()
	cs := etcdsync.NewSemaphore(session(t, admin), name, 3)
	gc := async(func() error { return cs.Acquire(cctx, 3) })
	waitKeys(t, admin, name+"/", 3)
	cnt := counter{created: make(chan struct{}, 16)}
	cli := c.Client(t, cnt.dial()...)
	w := etcdsync.NewSemaphore(session(t, cli), name, 3)
	gw := async(func() error { return w.Acquire(ctx, 1) })
	waitKeys(t, admin, name+"/", 4)
	within(t, cnt.created, testTimeout, "w's watch of the prefix (C's delete alone would give it the turn)")
	notYet(t, gw, 10*time.Millisecond, "w behind C")
	cnt.take()
	before := cnt.unary.Load()
	ccancel()
	require.ErrorIs(t, resultWithin(t, gc, testTimeout, "C cancelled"), context.Canceled)
	require.NoError(t, resultWithin(t, gw, testTimeout, "w after C withdrew"))
	n := cnt.unary.Load() - before
	_, methods := cnt.take()
	require.Zero(t, n, "RPCs on the critical path of W's turn (C's withdrawal to W's Acquire): %v", methods)
	require.NoError(t, w.Release(ctx))
	require.NoError(t, a.Release(ctx))
	require.NoError(t, b.Release(ctx))
}

// A request for every permit behind three holders of one, which release
// newest first: it must learn where it stands before the last release
// (it watches two of the holders: whichever goes first wakes it), so that
// the last release hands it the permits with no RPC. Watching only the
// oldest holder, it heard nothing until the last release, then read.
func TestSemaphoreLargeAcquireBehindHoldersReleasingInAnyOrderNeedsNoRead(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const name = "semanyorder"
	hs := make([]*etcdsync.Semaphore, 3)
	for i := range hs {
		hs[i] = etcdsync.NewSemaphore(session(t, admin), name, 3)
		require.NoError(t, hs[i].Acquire(ctx, 1))
	}
	cnt := counter{created: make(chan struct{}, 16)}
	w := etcdsync.NewSemaphore(session(t, c.Client(t, cnt.dial()...)), name, 3)
	gw := async(func() error { return w.Acquire(ctx, 3) })
	awaitCreated(t, cnt.created, 3, testTimeout, "w's watches (its own key, the two oldest holders')")
	var releases []func() error
	for _, h := range hs {
		releases = append(releases, func() error { return h.Release(ctx) })
	}
	releasedInAnyOrder(t, &cnt, releases, gw, "w")
	require.NoError(t, w.Release(ctx))
}

// A server whose --max-txn-ops is below the keys a waiter rereads in one
// transaction (its own and the keys ahead it keeps, up to 64): the server
// refuses that read, and the waiter lists the queue instead. It used to
// retry the refused read for as long as it waited, and never held: here
// the waiter behind four holders and two waiters (seven gets; the
// server takes four) as the holders release.
func TestSemaphoreWaiterUnderASmallMaxTxnOpsHolds(t *testing.T) {
	t.Parallel()
	c := etcdtest.Start(t, etcdtest.Options{MaxTxnOps: 4})
	admin, ctx := c.Client(t), ctxT(t)
	const name = "semtxnops"
	var hs []*etcdsync.Semaphore
	for range 4 {
		h := etcdsync.NewSemaphore(session(t, admin), name, 4)
		require.NoError(t, h.Acquire(ctx, 1))
		hs = append(hs, h)
	}
	var got []<-chan error
	for i := range 3 { // two waiters, then w
		s := etcdsync.NewSemaphore(session(t, admin), name, 4)
		hs = append(hs, s)
		got = append(got, async(func() error { return s.Acquire(ctx, 1) }))
		waitKeys(t, admin, name+"/", 5+i)
	}
	time.Sleep(200 * time.Millisecond) // w in its watches
	for i, h := range hs[:4] {
		require.NoError(t, h.Release(ctx))
		time.Sleep(100 * time.Millisecond)
		if i == 2 {
			require.NoError(t, resultWithin(t, got[2], 5*time.Second, "w with three permits free"))
		}
	}
	for i, err := range got[:2] {
		require.NoError(t, resultWithin(t, err, 5*time.Second, fmt.Sprintf("waiter %d", i)))
	}
	for _, h := range hs[4:] {
		require.NoError(t, h.Release(ctx))
	}
	require.Empty(t, keys(t, admin, name+"/"))
}

// Heterogeneous weights under contention: 6 participants of a Semaphore
// of capacity 4 acquire 1, 2 or 3 permits in a loop; the permits held never
// exceed 4 and every acquire ends.
func TestSemaphoreMixedWeightsNeverOvercommit(t *testing.T) {
	t.Parallel()
	c, admin, ctx := singleClient(t)
	const capacity = 4
	var held atomic.Int64
	var wg sync.WaitGroup
	for i := range 6 {
		sm := etcdsync.NewSemaphore(session(t, c.Client(t)), "semw", capacity)
		n := int64(1 + i%3)
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range 12 {
				if err := sm.Acquire(ctx, n); err != nil {
					t.Errorf("participant %d round %d: %v", i, r, err)
					return
				}
				if got := held.Add(n); got > capacity {
					t.Errorf("participant %d round %d: %d permits held at once", i, r, got)
				}
				time.Sleep(time.Millisecond)
				held.Add(-n)
				if err := sm.Release(ctx); err != nil {
					t.Errorf("release: %v", err)
					return
				}
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	within(t, done, testTimeout, "semaphore participants")
	waitNoKeys(t, admin, "semw/")
}
